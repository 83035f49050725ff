// StoreClient: the client of a set of store nodes: rendezvous (highest-random-weight) hashing of
// keys onto nodes, a replication factor, batched requests (one per node per round) and failover
// to the next replica when a node is unreachable or misses a key.
//
// PLACEMENT CONTRACT: key k lives on the `replication` nodes with the highest
// Checksum64(k, seed = Checksum64(node address)). Every client with the same node list computes
// the same placement without coordination, and adding or removing one node moves only the keys
// whose top-ranked nodes changed (about 1/N of them). Rejected alternative: a consistent-hash ring
// needs virtual nodes to balance and a shared ring layout; rendezvous needs neither.
//
// Blocks move straight between the caller's pool blocks and the socket (writev / readv).
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "tpusync/base/status.h"
#include "tpusync/memory/block_allocator.h"
#include "tpusync/node/store_node.h"
#include "tpusync/transport/link.h"

namespace tpusync::node {

struct StoreClientOptions {
  std::vector<std::string> nodes;
  size_t replication = 1;
  transport::ConnectOptions connect{
      .streams = 1, .timeout = std::chrono::milliseconds(5000), .socket = {}, .wrap = {}};
  std::chrono::milliseconds timeout{10000};  // per request
};

class StoreClient {
 public:
  static Result<std::unique_ptr<StoreClient>> Create(std::shared_ptr<BlockAllocator> pool,
                                                     Secret secret, StoreClientOptions options);
  // Node indices for `key`, best first (all nodes, ranked).
  std::vector<size_t> Rank(std::string_view key) const;
  // Stores block i under keys[i] on its replicas. Returns, per key, how many replicas hold it
  // (stored now or already there). kUnavailable only when no node could be reached at all.
  Result<std::vector<uint32_t>> Put(const std::vector<std::string>& keys,
                                    const std::vector<BlockId>& blocks);
  // Copies keys[i] into dst[i] when found on any replica; returns found flags. Get, LookupPrefix
  // and Remove fail (with the last node's error) only when no node answered at all.
  Result<std::vector<bool>> Get(const std::vector<std::string>& keys,
                                const std::vector<BlockId>& dst);
  // Length of the leading run of keys present on some replica (one batched request per node per
  // replica round).
  Result<size_t> LookupPrefix(const std::vector<std::string>& keys);
  // Removes keys from every replica; returns whether each was present anywhere.
  Result<std::vector<bool>> Remove(const std::vector<std::string>& keys);

 private:
  StoreClient(std::shared_ptr<BlockAllocator> pool, Secret secret, StoreClientOptions options);
  // Sends one request to node `n` and returns the reply frame's metadata (payload left to `recv`).
  Result<std::vector<uint8_t>> Call(size_t n, transport::Op op,
                                    const std::vector<std::string>& keys,
                                    const std::vector<BlockId>* payload,
                                    const std::vector<BlockId>* dst_found);
  std::shared_ptr<BlockAllocator> pool_;
  StoreClientOptions options_;
  std::vector<transport::Address> addrs_;
  std::vector<uint64_t> seeds_;
  transport::LinkPool links_;
};

}  // namespace tpusync::node
