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
// Blocks move straight between the caller's memory (pool blocks, or raw rows for the remote tier)
// and the socket (writev / readv). A batch for one node is sent as requests of at most
// kMaxRequestBytes of payload, so a node's per-connection receive buffer stays bounded.
//
// DEADLINE CONTRACT: every request to one node waits at most connect.timeout (a new link's
// connect and handshake) plus `timeout`; the nodes of one replica round are asked at the same
// time, each on its own thread, so a call waits at most replication x (connect.timeout +
// timeout) in total however many nodes are down or hung.
//
// LEASED PREFIX CONTRACT: LookupPrefix with a lease leaves leases only on the keys of the prefix
// it returns: keys found past the first miss were leased by their node too, and are released
// (kUnleaseFlag) before it returns, so a lookup never pins blocks its caller will not read. A
// caller that reads only part of the prefix ends the rest with EndLeases.
//
// NODE LIST RULE: an address listed twice is refused (its "replicas" would be one node). A name
// and an IP of one node (localhost:7000, 127.0.0.1:7000) are not detected; list each node once.
// Every reply carries the node's block size (store_node.h): a node with another block size
// fails each request to it with a named error, and CheckNodes asks each node once.
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <span>
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

// Payload bytes per request (a larger batch for one node is split).
inline constexpr size_t kMaxRequestBytes = size_t{64} << 20;
// STRIPE CONTRACT: a batch of at least 2 x kStripeMinBytes for one node is cut into up to
// kMaxStripes contiguous parts of at least kStripeMinBytes, sent at the same time over separate
// links of the pool (a node serves each link on its own thread), so one large get or put uses
// several TCP streams instead of stream 0 of one link. Keys keep their order in the result. The
// call returns only after every part ended (no part writes into the caller's memory afterwards);
// when a part fails, the call fails with the first failing part's status, as a sequential split
// did. Rejected: striping one request's blocks over the streams of one link (a wire change: the
// node would have to reassemble frames arriving on several streams).
inline constexpr size_t kStripeMinBytes = size_t{8} << 20;
inline constexpr size_t kMaxStripes = 4;

class StoreClient {
 public:
  static Result<std::unique_ptr<StoreClient>> Create(std::shared_ptr<BlockAllocator> pool,
                                                     Secret secret, StoreClientOptions options);
  // A client without a pool, for the raw-memory calls only (PutRaw / GetRaw / lookups / remove).
  static Result<std::unique_ptr<StoreClient>> CreateRaw(size_t block_bytes, Secret secret,
                                                        StoreClientOptions options);
  // Node indices for `key`, best first (all nodes, ranked).
  std::vector<size_t> Rank(std::string_view key) const;
  // Stores block i under keys[i] on its replicas. Returns, per key, how many replicas hold it
  // (stored now or already there; 0 where every replica was full). Fails with the last node's
  // error only when no node took the request at all (unreachable, or it refused it: another
  // block size, a wrong secret, a payload damaged in flight). Every call of this class refuses
  // an empty or over-long key (block::ValidateKey) before any request leaves.
  Result<std::vector<uint32_t>> Put(const std::vector<std::string>& keys,
                                    const std::vector<BlockId>& blocks);
  // Copies keys[i] into dst[i] when found on any replica; returns found flags. Get, LookupPrefix
  // and Remove fail (with the last node's error) only when no node answered at all.
  Result<std::vector<bool>> Get(const std::vector<std::string>& keys,
                                const std::vector<BlockId>& dst);
  // Length of the leading run of keys present on some replica (one batched request per node per
  // replica round).
  Result<size_t> LookupPrefix(const std::vector<std::string>& keys);
  // Same, and every key of the prefix found on a node is leased there for `lease` (not evicted
  // until a get reads it or the lease expires; store_node.h READ LEASE CONTRACT).
  // leased_on (optional) gets, for each key of the prefix, the node holding its lease.
  Result<size_t> LookupPrefix(const std::vector<std::string>& keys, std::chrono::milliseconds lease,
                              std::vector<size_t>* leased_on = nullptr);
  // Ends one lease of keys[i] on node nodes[i] (from LookupPrefix's leased_on): the prefix keys a
  // caller will not read. Best effort: a node that does not answer lets the leases expire.
  void EndLeases(const std::vector<std::string>& keys, const std::vector<size_t>& nodes);
  // Asks every node once (a lookup of one key, no lease). Fails with the first node that answers
  // with an error that a retry would not cure: another block size, a refused secret. Nodes that
  // are down or do not answer are skipped (they may come up later).
  Status CheckNodes();
  // Raw-memory forms (the remote tier's rows): src[i] / dst[i] point at block_bytes bytes.
  // GetRaw fills sums[i] (when sums is not empty: one per key) for every found key with the
  // checksum its bytes were verified against on arrival (Checksum64 of the block), so a caller
  // that copies the row later can tell whether the row changed since (the store's PROMOTION
  // CHECK).
  Result<std::vector<uint32_t>> PutRaw(const std::vector<std::string>& keys,
                                       std::span<const uint8_t* const> src);
  Result<std::vector<bool>> GetRaw(const std::vector<std::string>& keys,
                                   std::span<uint8_t* const> dst, std::span<uint64_t> sums = {});
  size_t block_bytes() const { return block_bytes_; }
  size_t num_nodes() const { return addrs_.size(); }
  // Removes keys from every replica; returns whether each was present anywhere.
  Result<std::vector<bool>> Remove(const std::vector<std::string>& keys);

 private:
  StoreClient(std::shared_ptr<BlockAllocator> pool, Secret secret, StoreClientOptions options);
  static Result<std::unique_ptr<StoreClient>> Make(std::shared_ptr<BlockAllocator> pool,
                                                   size_t block_bytes, Secret secret,
                                                   StoreClientOptions options);
  // Sends one request to node `n` and returns its per-key result bytes; a Get reply's blocks
  // land in dst[i] for each found key i, and (sums not empty: parallel to dst) the checksum
  // each was verified against in sums[i].
  Result<std::vector<uint8_t>> Call(size_t n, transport::Op op,
                                    const std::vector<std::string>& keys,
                                    std::span<const uint8_t* const> payload,
                                    std::span<uint8_t* const> dst, uint8_t flags = 0,
                                    std::span<const uint8_t> extra_meta = {},
                                    std::span<uint64_t> sums = {});
  // Call, split into requests of at most kMaxRequestBytes of payload / received blocks, striped
  // over several links (STRIPE CONTRACT).
  Result<std::vector<uint8_t>> CallChunked(size_t n, transport::Op op,
                                           const std::vector<std::string>& keys,
                                           std::span<const uint8_t* const> payload,
                                           std::span<uint8_t* const> dst,
                                           std::span<uint64_t> sums = {});
  // Keys [lo, hi) of a CallChunked batch, one request after another on one link at a time.
  Result<std::vector<uint8_t>> CallRange(size_t n, transport::Op op,
                                         const std::vector<std::string>& keys,
                                         std::span<const uint8_t* const> payload,
                                         std::span<uint8_t* const> dst, size_t lo, size_t hi,
                                         std::span<uint64_t> sums = {});
  Result<size_t> Lookup(const std::vector<std::string>& keys, uint32_t lease_ms,
                        std::vector<size_t>* leased_on);
  // Runs fn(node, key indices) for every entry of per_node at the same time (DEADLINE
  // CONTRACT) and returns each entry's result, in the map's order.
  template <typename Fn>
  auto ForEachNode(const std::map<size_t, std::vector<size_t>>& per_node, Fn fn)
      -> std::vector<decltype(fn(size_t{}, per_node.begin()->second))>;
  std::shared_ptr<BlockAllocator> pool_;
  size_t block_bytes_ = 0;
  StoreClientOptions options_;
  std::vector<transport::Address> addrs_;
  std::vector<uint64_t> seeds_;
  transport::LinkPool links_;
};

}  // namespace tpusync::node
