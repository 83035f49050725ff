// RemoteTier: a BlockTier over a set of store nodes (node/store_node.h), so that a KVStore can
// demote to, and look up in, the distributed prefix cache like any other tier.
//
// LOCATION CONTRACT: the nodes address blocks by key, not by location, so a remote location is a
// local handle (0..capacity) that names "key K, written to / found on the nodes". `capacity` is
// the number of remote blocks this store indexes at once, not the nodes' size: the nodes evict on
// their own (LRU, shared by every client), so a read of a location whose key the nodes no longer
// hold reports kNotFound and the store forgets it (served as a miss, never as data).
//
// PLACEMENT / REPLICAS: StoreClient's rendezvous hashing and replication factor; a write counts as
// stored when at least one replica took it; a read falls through to the next replica when one is
// dead or misses the key.
//
// LEASE CONTRACT: AdoptPrefix (the store's Lookup hook) looks keys up with a read lease on the
// nodes, so the blocks a Lookup reported stay on the nodes until the following Get reads them or
// `lease` passes. Only the keys it adopts stay leased: those past the nodes' prefix
// (StoreClient LEASED PREFIX CONTRACT) and those it has no free handle for are released at once.
//
// Open asks every node once (StoreClient::CheckNodes): a node with another block size or that
// refuses the secret fails the open by name; a node that is down is skipped (it may come up).
//
// INTEGRITY: bytes are checksummed on the wire (verified on receipt) and in the node's own tiers;
// a read also checks that the location still names the asked key (a mismatch is kCorrupted).
// Release(forget) removes the key from the nodes (explicit remove / corruption); plain eviction
// leaves it there for other clients.
//
// Rejected alternative: a remote "tier" inside KVStore itself - it would put network code under
// store/ (dependencies point one way: store -> tier, node -> store).
#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tpusync/node/store_client.h"
#include "tpusync/tier/tier.h"

namespace tpusync::node {

struct RemoteTierOptions {
  size_t block_bytes = 0;
  size_t capacity_blocks = 1 << 16;  // remote blocks indexed locally (handles)
  StoreClientOptions client;
  std::chrono::milliseconds lease{10000};
};

class RemoteTier final : public tier::BlockTier {
 public:
  static Result<std::unique_ptr<RemoteTier>> Open(RemoteTierOptions options, Secret secret);

  block::Tier kind() const override { return block::Tier::kRemote; }
  size_t block_bytes() const override { return options_.block_bytes; }
  size_t capacity() const override { return slots_.size(); }
  size_t used() const override;
  Result<uint64_t> Reserve() override;
  void Release(uint64_t location, bool forget) override;
  Status Hold(uint64_t location) override;
  void Unhold(uint64_t location) override;
  void WriteBatch(std::span<tier::BlockWrite> ops) override;
  void ReadBatch(std::span<tier::BlockRead> ops) override;
  size_t AdoptPrefix(std::span<const std::string_view> keys,
                     std::vector<uint64_t>* locations) override;
  std::vector<tier::RecoveredBlock> TakeRecovered() override { return {}; }
  tier::TierStats stats() const override;

  StoreClient& client() { return *client_; }

 private:
  explicit RemoteTier(RemoteTierOptions options) : options_(std::move(options)) {}
  struct Slot {
    bool used = false;
    bool releasing = false;
    uint32_t holds = 0;
    std::string key;
  };
  void FreeLocked(uint64_t location);  // mu_ held; returns the slot to the free list

  RemoteTierOptions options_;
  std::unique_ptr<StoreClient> client_;
  mutable std::mutex mu_;
  std::vector<Slot> slots_;
  std::vector<uint64_t> free_;
  tier::TierStats stats_;
};

}  // namespace tpusync::node
