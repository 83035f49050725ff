// StoreNode: one node of the distributed prefix cache. Serves put / get / lookup / remove of
// fixed-size blocks by key over the authenticated transport, from its own tiered KVStore
// (store/kv_store.h: host DRAM, optionally a disk tier below it; LRU, checksums and counters
// come from there).
//
// TWO-PHASE PUT CONTRACT: a put first receives the payload into a per-connection receive buffer
// (reserved, invisible to readers), verifies every wire checksum, and only then hands the blocks
// to the KVStore, whose VISIBILITY CONTRACT makes a key visible only once its bytes are completely
// written to a tier. A reader therefore never sees a partial or corrupt block; a put whose payload
// fails its checksum commits nothing. Same key, same bytes: a put of a key already stored is
// reported "exists" and its bytes are dropped. Rejected alternative: receiving straight into a
// reserved host-tier slot (no staging copy) - it needs a reserve/commit API inside KVStore, which
// another change is reworking; the one memcpy per block costs far less than the wire.
//
// READ LEASE CONTRACT: a lookup with kLeaseFlag pins every key it finds in the KVStore for the
// requested lease (at most kMaxLeaseMs): the key is not evicted until a get reads it (which ends
// one lease) or the lease expires (expired leases are dropped at most kLeaseSweepMs after expiry,
// on the next request or stats call). A lookup with kUnleaseFlag ends one lease of each key it
// names (a client that leased keys it will not read: those past the first miss of a prefix).
// A remove ends every lease of the key and removes it. A get copies its blocks out of the
// KVStore (under the tier's hold) before sending them, so a concurrent remove or eviction never
// changes bytes on the wire.
// LEASE BOUND: leases never pin more than half of the node's DRAM blocks (kLeasedShare) nor
// more than kMaxLeasesPerKey times one key; a lookup past either bound still reports the key
// found, and past the per-key bound extends the key's expiry, but pins nothing more
// (stats().leases_refused), so lookups that are never followed by reads cannot fill a node
// until no put finds room.
//
// Every reply's metadata ends with the node's block size (u64), so a client configured with
// another block size gets a named error on its first request instead of puts that fail one by
// one (StoreClient::CheckNodes).
//
// WARM RESTART CONTRACT: a node started with a namespace keeps its DRAM tier in
// /dev/shm/tpusync-<namespace>-host (and re-attaches its disk tier), exactly like a serving
// KVStore (store/kv_store.h WARM RESTART, tier/host_tier.h WARM-RESTART CONTRACT): a node killed
// with SIGKILL and started again with the same namespace, capacity, block size and fingerprint
// serves every block whose bytes verify; a torn or corrupt slot is dropped, never served. Any
// mismatch (another fingerprint, capacity or block size) is a cold start, logged on stderr with
// its reason and reported by cold_start_reason(). One process per namespace (a second node on the
// same namespace fails to start). Without a namespace the DRAM tier is private and starts cold.
//
// REQUEST MEMORY CONTRACT: a link's request buffer is allocated without being filled (pages are
// committed only as a put's payload arrives or a get's found blocks are copied in: a get of
// missing keys commits none of it), and after a request it is
// kept only up to kKeptRequestBytes, so an idle link holds at most that much beyond the store's
// capacity. A lookup leases each distinct key of a request once (duplicates in one request take
// no further lease, and a get ends one lease per distinct key it read).
//
// EVICTION: when the KVStore is full, a put evicts least-recently-used unpinned keys (demoting to
// the disk tier first when the node has one).
//
// Protocol: every request is one frame on stream 0 of a link, answered by one kStoreReply frame
// (metadata: status, then one byte per key; Get replies carry the found blocks as payload).
// docs/wire-protocol.md lists the store ops.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <unordered_map>
#include "tpusync/base/status.h"

#include "tpusync/block/block_index.h"
#include "tpusync/concurrency/thread_pool.h"
#include "tpusync/memory/block_allocator.h"
#include "tpusync/store/kv_store.h"
#include "tpusync/transport/link.h"

namespace tpusync::node {

using memory::BlockAllocator;
using memory::BlockId;
using transport::Secret;

inline constexpr uint32_t kMaxKeysPerRequest = 1u << 16;
// kStoreLookup flag: lease the found keys; the metadata then ends with a u32 lease in ms.
inline constexpr uint8_t kLeaseFlag = 1;
// kStoreLookup flag: end one lease of each key (found = a lease was ended). Not with kLeaseFlag.
inline constexpr uint8_t kUnleaseFlag = 2;
inline constexpr int64_t kMaxLeaseMs = 600000;
// LEASE BOUND (above).
inline constexpr uint32_t kMaxLeasesPerKey = 64;
inline constexpr size_t kLeasedShare = 2;  // at most 1 / kLeasedShare of the DRAM blocks
inline constexpr int64_t kLeaseSweepMs = 100;
// A request's payload (put) or reply payload (get) must fit in this many bytes.
inline constexpr size_t kMaxNodeRequestBytes = size_t{256} << 20;
// REQUEST MEMORY CONTRACT: the most request buffer a link keeps between requests.
inline constexpr size_t kKeptRequestBytes = size_t{16} << 20;

// Per-key results in a put reply.
enum class PutResult : uint8_t { kStored = 0, kExists = 1, kNoSpace = 2 };

struct StoreNodeOptions {
  std::string listen = "127.0.0.1:0";
  size_t capacity_bytes = 1ull << 30;  // host DRAM tier
  size_t block_bytes = 256 << 10;
  std::string disk_dir;  // non-empty: a disk tier below DRAM
  size_t disk_capacity_bytes = 0;
  size_t engine_threads = 2;  // the KVStore's copy threads
  // Non-empty: the DRAM tier lives in /dev/shm and survives the process (WARM RESTART CONTRACT).
  std::string name_space;
  std::string fingerprint;  // model fingerprint; a restart with another one starts cold
  transport::ServerOptions server;
};

struct StoreNodeStats {
  uint64_t blocks_total = 0, blocks_used = 0;
  uint64_t puts = 0, put_blocks = 0, put_exists = 0, put_corrupt = 0, put_no_space = 0;
  uint64_t gets = 0, get_hits = 0, get_misses = 0;
  uint64_t lookups = 0, removes = 0, evictions = 0;
  uint64_t leases = 0, leases_expired = 0, leases_active = 0;
  uint64_t leases_refused = 0;  // lookups past the LEASE BOUND: found, not pinned
  uint64_t disk_blocks_total = 0, disk_blocks_used = 0;
  uint64_t bytes_in = 0, bytes_out = 0;
  uint64_t rejected_peers = 0, links = 0;
  // Requests that ended their link: the peer vanished or stalled mid-frame, a reply could not be
  // sent (each also logged with its peer and reason).
  uint64_t requests_failed = 0;
  uint64_t recovered_blocks = 0;  // blocks re-attached and verified at start (warm restart)
};

class StoreNode {
 public:
  static Result<std::unique_ptr<StoreNode>> Start(StoreNodeOptions options, Secret secret);
  ~StoreNode();
  const transport::Address& address() const { return server_->address(); }
  size_t block_bytes() const { return store_->block_bytes(); }
  // Also ends expired leases first (READ LEASE CONTRACT).
  StoreNodeStats stats();
  // Why cached blocks were discarded at start (empty: warm restart, or nothing to re-attach).
  const std::string& cold_start_reason() const { return cold_start_reason_; }
  // The node's store (tests and the CLI's metrics read its counters).
  store::KVStore& store() { return *store_; }
  // Stops accepting, ends every connection and joins all threads (SIGTERM path).
  void Stop();

 private:
  StoreNode() = default;
  struct Scratch;  // a link's request buffer (REQUEST MEMORY CONTRACT)
  void Serve(const std::shared_ptr<transport::Link>& link);
  Status HandlePut(transport::Stream& s, const transport::InFrame& f,
                   std::shared_ptr<Scratch>& buf);
  Status HandleGet(transport::Stream& s, const transport::InFrame& f,
                   std::shared_ptr<Scratch>& buf);
  Status HandleLookup(transport::Stream& s, const transport::InFrame& f);
  Status HandleRemove(transport::Stream& s, const transport::InFrame& f);
  // Sends a kStoreReply: status, per-key results, the node's block size, then `blocks`.
  Status Reply(transport::Stream& s, uint64_t id, const Status& st,
               const std::vector<uint8_t>& per_key, const std::vector<const uint8_t*>& blocks = {});
  // Lease bookkeeping; EndLease / EndAllLeases need lease_mu_ held.
  void SweepLeases(bool force);
  void EndLease(const std::string& key);
  void EndAllLeases(const std::string& key);

  StoreNodeOptions options_;
  std::string cold_start_reason_;
  uint64_t recovered_blocks_ = 0;
  std::shared_ptr<concurrency::ThreadPool> engine_;
  std::unique_ptr<store::KVStore> store_;
  std::unique_ptr<transport::Server> server_;
  struct Lease {
    uint32_t count = 0;  // pins held on the key for leases
    transport::Deadline expires;
  };
  mutable std::mutex lease_mu_;
  std::unordered_map<std::string, Lease> leases_;
  size_t max_leased_keys_ = 0;  // LEASE BOUND: distinct keys leases may pin
  transport::Deadline next_sweep_{};
  mutable std::mutex stats_mu_;
  StoreNodeStats stats_;
};

// Keys <-> frame metadata (u32 count, then length-prefixed keys); validated on decode.
std::vector<uint8_t> EncodeKeys(const std::vector<std::string>& keys);
Result<std::vector<std::string>> DecodeKeys(transport::MetaReader& r);

}  // namespace tpusync::node
