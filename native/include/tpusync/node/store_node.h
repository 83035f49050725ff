// StoreNode: one node of the distributed prefix cache. Serves put / get / lookup / remove of
// fixed-size blocks by key over the authenticated transport, from a HostBlockPool-style pool
// indexed by a BlockIndex (the lead switches it to the tiered KVStore at merge).
//
// TWO-PHASE PUT CONTRACT: a put first reserves pool blocks (invisible to readers), receives the
// payload straight into them (readv), verifies every checksum, and only then commits the keys to
// the index. A reader therefore never sees a partial or corrupt block; a put whose payload fails
// its checksum frees its reservation and commits nothing. The first committed writer of a key
// wins; a later put of the same key is reported as "exists" and its bytes are dropped.
//
// READ LEASE CONTRACT: a get looks keys up and borrows their blocks under the node's lock, then
// writes them to the socket without it; a concurrent remove or eviction drops the key at once, but
// the borrowed memory is recycled only after the get finished sending it.
//
// EVICTION: when the pool is full, a put evicts least-recently-used unpinned keys.
//
// Protocol: every request is one frame on stream 0 of a link, answered by one kStoreReply frame
// (metadata: status, then one byte per key; Get replies carry the found blocks as payload).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tpusync/base/status.h"
#include "tpusync/block/block_index.h"
#include "tpusync/memory/block_allocator.h"
#include "tpusync/transport/link.h"

namespace tpusync::node {

using memory::BlockAllocator;
using memory::BlockId;
using transport::Secret;

inline constexpr uint32_t kMaxKeysPerRequest = 1u << 16;

// Per-key results in a put reply.
enum class PutResult : uint8_t { kStored = 0, kExists = 1, kNoSpace = 2 };

struct StoreNodeOptions {
  std::string listen = "127.0.0.1:0";
  size_t capacity_bytes = 1ull << 30;
  size_t block_bytes = 256 << 10;
  transport::ServerOptions server;
};

struct StoreNodeStats {
  uint64_t blocks_total = 0, blocks_used = 0;
  uint64_t puts = 0, put_blocks = 0, put_exists = 0, put_corrupt = 0, put_no_space = 0;
  uint64_t gets = 0, get_hits = 0, get_misses = 0;
  uint64_t lookups = 0, removes = 0, evictions = 0;
  uint64_t bytes_in = 0, bytes_out = 0;
  uint64_t rejected_peers = 0, links = 0;
};

class StoreNode {
 public:
  static Result<std::unique_ptr<StoreNode>> Start(StoreNodeOptions options, Secret secret);
  ~StoreNode();
  const transport::Address& address() const { return server_->address(); }
  size_t block_bytes() const { return pool_->block_bytes(); }
  StoreNodeStats stats() const;
  // Stops accepting, ends every connection and joins all threads (SIGTERM path).
  void Stop();

 private:
  StoreNode() = default;
  void Serve(const std::shared_ptr<transport::Link>& link);
  Status HandlePut(transport::Stream& s, const transport::InFrame& f);
  Status HandleGet(transport::Stream& s, const transport::InFrame& f);
  Status HandleLookup(transport::Stream& s, const transport::InFrame& f);
  Status HandleRemove(transport::Stream& s, const transport::InFrame& f);
  Result<std::vector<BlockId>> Reserve(size_t n);  // mu_ held; evicts LRU keys when full

  std::unique_ptr<BlockAllocator> pool_;
  block::BlockIndex index_;
  std::unique_ptr<transport::Server> server_;
  mutable std::mutex mu_;  // orders reserve / commit / lookup+borrow / remove / evict
  mutable std::mutex stats_mu_;
  StoreNodeStats stats_;
};

// Keys <-> frame metadata (u32 count, then length-prefixed keys); validated on decode.
std::vector<uint8_t> EncodeKeys(const std::vector<std::string>& keys);
Result<std::vector<std::string>> DecodeKeys(transport::MetaReader& r);

}  // namespace tpusync::node
