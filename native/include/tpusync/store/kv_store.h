// KVStore: content-addressed KV blocks over a cascade of tiers (host DRAM -> disk [-> remote]).
//
// Keys are engine block hashes (opaque bytes, block/block_key.h); values are fixed-size blocks.
// One store holds one block shape: several shapes means several stores.
//
// VISIBILITY CONTRACT: a key becomes visible to Lookup / Get only after its bytes are completely
// written to a tier; Put of a key already stored (or being stored) writes nothing (content
// addressing: same key, same bytes) and reports it stored.
//
// REMOTE: a store opened with a RemoteTier (node/remote_tier.h) last demotes host -> disk -> remote
// (disk first: it is local and its reads cost no network); a remote read that finds the key gone
// (the nodes evict on their own) is a miss and the key is forgotten, like a corrupted one.
//
// CASCADE CONTRACT: Put writes to the fastest tier. When a tier is full the least-recently-used
// unpinned block that already has a copy below (clean) - or that the policy refuses below - is
// dropped at once; dirty blocks are written down by the write-back worker, which keeps the coldest
// `writeback_headroom` blocks of each tier clean ahead of need. A Put waits for that worker at most
// `put_wait` (a bounded queue), then reports the block not stored; it never does disk I/O itself.
// The last tier evicts LRU. A Get served from a lower tier promotes the block to the fastest tier
// when that needs no wait. Pinned keys are never dropped from any tier.
//
// WRITE-THROUGH CONTRACT (option `write_through`, for a last tier that other processes read - the
// store nodes of a shared prefix cache): every block a Put newly stores is also copied to the LAST
// tier, asynchronously, by a write-through worker, so other stores see it without waiting for this
// one's DRAM to overflow. The Put completes when the fastest tier holds the block (it never waits
// for the copy); the copy is best effort: the queue is bounded (`write_through_queue` keys, the
// oldest dropped and counted), and after a failed batch (a dead node) copies pause for a back-off
// (1 s doubling to 30 s, queued keys dropped and counted) so a dead tier costs neither a stall nor
// a retry storm. A key that write-back is moving at that moment is retried after the move (from
// wherever it landed), never skipped uncounted. Flush waits for queued copies too. Copies run on
// their own thread, so a slow
// last tier never delays write-back demotions (which keep DRAM free for Puts). Rejected
// alternatives: a synchronous copy inside Put (a network round trip on vLLM's step), and a
// write-back headroom of the whole tier (every block would also be written to the disk tier).
//
// FAULT CONTRACT: a failed tier write (ENOSPC, I/O error) is counted; the block stays where it
// was (and may be dropped later from DRAM, counted). A corrupted or truncated block is counted,
// removed from the index, its slot reclaimed, and served as a miss. Nothing throws; per-key results
// come back in the `stored` / `found` vectors, the future carries only a batch-level Status.
//
// WARM RESTART: Open() indexes every block the tiers recovered (in their write order, so LRU
// survives), after the tiers themselves verified layout, fingerprint and checksums.
//
// CHECKPOINTS (tier.h CHECKPOINT HOOK, tier/disk_tier.h CHECKPOINT CONTRACT): a checkpoint thread
// asks each tier every 100 ms how many slots changed since its last checkpoint and has it write
// one when `checkpoint_writes` changed (0: never by count) or when any changed and
// `checkpoint_s` passed since the last (0: never by time), and at once when a tier has none on
// disk (tier.h FIRST CHECKPOINT: inside Open for an empty tier, else on the thread). The walk is
// chunked (tier.h CHUNKED WALK): the index lock is held for 4096 keys at a time; puts and gets go
// on between chunks. With both 0 there is no thread and no first checkpoint (a crash restart
// scans). Defaults: 60 s or 65536 changed slots (at ~10 us per header read, a crash restart reads
// at most ~0.7 s of headers after the manifest, however large the tier).
//
// CLEAN CLOSE: the destructor stops write-back and write-through (each finishes and indexes the
// batch it is writing), waits for every Put / Get in flight, then gives each tier the keys the
// index places in it (tier.h CLEAN-CLOSE HOOK): the disk tier writes its manifest, so the next
// Open skips the header scan (tier/disk_tier.h RESTART CONTRACT). A process killed before that
// leaves no manifest; the next Open scans.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#include "tpusync/block/block_index.h"
#include "tpusync/concurrency/future.h"
#include "tpusync/concurrency/thread_pool.h"
#include "tpusync/memory/row_buffer.h"
#include "tpusync/store/policy.h"
#include "tpusync/tier/tier.h"

namespace tpusync::store {

struct KVStoreOptions {
  size_t block_bytes = 0;
  size_t host_blocks = 0;
  // Non-empty: the host tier lives in /dev/shm/tpusync-<namespace>-host and survives the process;
  // the disk tier (if any) is re-attached too. Letters, digits, '-', '_', '.'.
  std::string name_space;
  std::string fingerprint;  // model fingerprint: a restart with another one is a cold start
  std::string disk_dir;     // empty: no disk tier
  size_t disk_blocks = 0;
  size_t disk_segment_blocks = 0;
  bool disk_direct_io = true;
  double disk_checkpoint_s = 60.0;           // CHECKPOINTS: 0 = no timed checkpoint
  size_t disk_checkpoint_writes = 1u << 16;  // CHECKPOINTS: 0 = no checkpoint by count
  // tier/disk_manifest.h WRITE-BACK CONTRACT (DiskTierOptions::manifest_progressive_write_back).
  bool disk_manifest_progressive_write_back = true;
  std::string io_backend = "auto";
  size_t io_threads = 4;
  std::string policy = "lru";
  size_t policy_history = size_t{1} << 20;
  size_t writeback_batch = 32;
  size_t writeback_headroom = 0;  // 0: max(writeback_batch, host_blocks / 8)
  double put_wait_s = 5.0;
  bool prefault = true;
  bool huge_pages = true;      // hugetlbfs pages if reserved, else transparent huge pages (madvise)
  bool write_through = false;  // WRITE-THROUGH CONTRACT: copy every new block to the last tier
  // Recency mode of the store's index (block/block_index.h, RECENCY CONTRACT): which unpinned
  // block a full tier gives up first (Python: KVStore(recency=...)).
  block::Recency index_recency = block::BlockIndex::kDefaultRecency;
};

// Knobs of a store built from explicit tiers (tests, or a remote tier added by a caller).
struct StoreConfig {
  std::string policy = "lru";
  size_t policy_history = size_t{1} << 20;
  size_t writeback_batch = 32;
  size_t writeback_headroom = 0;
  double put_wait_s = 5.0;
  bool write_through = false;
  size_t write_through_queue = size_t{1} << 16;  // queued keys at most (oldest dropped, counted)
  double checkpoint_s = 60.0;                    // CHECKPOINTS
  size_t checkpoint_writes = size_t{1} << 16;    // CHECKPOINTS
  block::Recency index_recency = block::BlockIndex::kDefaultRecency;
};

struct LatencyStats {
  uint64_t count = 0;
  uint64_t total_ns = 0;
  uint64_t max_ns = 0;
};

struct TierCounters {
  block::Tier kind = block::Tier::kHost;
  uint64_t hits = 0;       // Get keys served from this tier
  uint64_t evictions = 0;  // blocks dropped from this tier to make room
  uint64_t promotions_in = 0;
  uint64_t demotions_in = 0;  // blocks written into this tier by write-back
  size_t indexed = 0;         // keys the index places in this tier
  tier::TierStats tier;
};

struct StoreStats {
  std::vector<TierCounters> tiers;
  uint64_t puts = 0;          // keys offered to Put
  uint64_t put_stored = 0;    // keys newly written
  uint64_t put_present = 0;   // keys already stored
  uint64_t put_rejected = 0;  // keys not stored (no room in time, write error)
  uint64_t gets = 0;          // keys asked of Get
  uint64_t misses = 0;        // keys absent from every tier (corrupted reads included)
  uint64_t evicted = 0;       // keys that left the store for lack of room
  uint64_t corrupted = 0;     // corrupted / truncated blocks detected on read (served as misses)
  uint64_t writeback_errors = 0;
  uint64_t writeback_inflight = 0;     // blocks being written down right now
  uint64_t write_through = 0;          // blocks copied to the last tier by write-through
  uint64_t write_through_dropped = 0;  // queued copies skipped (queue bound, failure back-off)
  uint64_t write_through_errors = 0;   // copies the last tier failed
  uint64_t engine_queue = 0;
  size_t keys = 0;
  LatencyStats put_latency, get_latency;
  std::string policy;
};

// A change of where a key lives, for KV-event publishers (tpusync.core.events via the bindings).
// EVENT CONTRACT: with events enabled, every index change is recorded under the store lock in the
// order it happened: kStored when a key becomes readable in a tier (put, promotion, write-back
// demotion), kRemoved when it leaves one (LRU drop, corruption, Remove), kCleared for Clear().
// The queue is bounded: when the consumer falls behind, the oldest events are dropped and counted
// (events_dropped), and the consumer should resynchronise (publish AllBlocksCleared and
// re-announce). Rejected alternative: a callback into Python from engine threads - it would take
// the GIL inside the store lock and let a slow publisher stall every put and get.
struct StoreEvent {
  enum class Kind : uint8_t { kStored = 0, kRemoved = 1, kCleared = 2 };
  Kind kind = Kind::kStored;
  block::Tier tier = block::Tier::kHost;  // unused for kCleared
  std::string key;
};

class KVStore {
 public:
  static Result<std::unique_ptr<KVStore>> Open(const KVStoreOptions& options,
                                               std::shared_ptr<concurrency::ThreadPool> engine);
  // The host / disk tiers that Open(options) would build, and its StoreConfig (so a caller can add
  // `tiers_below` tiers below them, e.g. node/remote_tier.h, and use the Open below). The store's
  // settings are checked first and the host tier is opened last (FAILED OPEN RULE in the .cc):
  // open the tiers below before calling this.
  static Result<std::vector<std::unique_ptr<tier::BlockTier>>> OpenTiers(
      const KVStoreOptions& options, size_t tiers_below = 0);
  static StoreConfig ConfigFrom(const KVStoreOptions& options);
  // Tiers fastest first; every tier must have the same block size.
  static Result<std::unique_ptr<KVStore>> Open(std::vector<std::unique_ptr<tier::BlockTier>> tiers,
                                               const StoreConfig& config,
                                               std::shared_ptr<concurrency::ThreadPool> engine);
  ~KVStore();
  KVStore(const KVStore&) = delete;
  KVStore& operator=(const KVStore&) = delete;

  size_t block_bytes() const { return block_bytes_; }
  size_t num_tiers() const { return tiers_.size(); }
  tier::BlockTier& tier_at(size_t i) { return *tiers_[i]; }

  // Put and Get fail as a whole (InvalidArgument, nothing moved) when a key is not 1..kMaxKeyBytes
  // bytes (block/block_key.h) or the buffer does not hold one row per key.
  //
  // Writes row(i) of `src` under keys[i]. stored->at(i) = 1 when the key is stored afterwards.
  concurrency::Future Put(std::vector<std::string> keys, memory::RowBuffer src,
                          std::shared_ptr<std::vector<uint8_t>> stored);
  // Reads keys[i] into row(i) of `dst`; found->at(i) = 1 for a verified hit (a miss leaves the
  // row's bytes unspecified).
  concurrency::Future Get(std::vector<std::string> keys, memory::RowBuffer dst,
                          std::shared_ptr<std::vector<uint8_t>> found);
  // Length of the leading run of stored keys (touching them) and where each lives. Local tiers
  // first; when the run ends before the last key and the last tier is shared (AdoptPrefix), the
  // rest is looked up there and the keys it holds are indexed in it.
  size_t Lookup(std::span<const std::string_view> keys, std::vector<block::Placement>* out);
  // All-or-nothing: every key must be stored (Pin) / pinned (Unpin).
  Status Pin(std::span<const std::string_view> keys);
  Status Unpin(std::span<const std::string_view> keys);
  // Forgets keys in every tier (unknown keys are skipped; pinned keys are refused, nothing
  // removed). Returns how many were removed.
  Result<size_t> Remove(std::span<const std::string_view> keys);
  // Forgets every key, pins included.
  void Clear();
  // Waits until the write-back worker has nothing left to write (or the timeout passes).
  Status Flush(std::chrono::nanoseconds timeout);
  // Writes a checkpoint of every tier now (CHECKPOINTS; tier.h CHECKPOINT HOOK), whatever the
  // counts, while puts and gets go on: for benchmarks, tests and operators. Serialised with the
  // checkpoint thread's by the tier. The first failure is returned (every tier is still tried).
  Status CheckpointNow();
  StoreStats stats() const;

  // Starts (capacity > 0) or stops (0) recording StoreEvents; stopping drops the queue.
  void EnableEvents(size_t capacity);
  // The index's recency mode (StoreConfig::index_recency).
  block::Recency index_recency() const { return index_.recency(); }
  // Removes and returns up to `max` of the oldest recorded events; *dropped (optional) receives
  // and resets the count of events lost to the bound since the last call.
  std::vector<StoreEvent> TakeEvents(size_t max, uint64_t* dropped = nullptr);

 private:
  void Emit(StoreEvent::Kind kind, block::Tier tier, std::string_view key);  // mu_ held
  explicit KVStore(block::Recency recency) : index_(recency) {}
  Status Start();
  // A free location in tier t, dropping clean / refused LRU victims; with a `wait_until`, waits
  // for write-back until then (a put passes one deadline, put_wait_s after its call, for all its
  // keys: ONE PUT WAIT). `lock` holds mu_.
  Result<uint64_t> MakeRoom(size_t t, std::unique_lock<std::mutex>& lock,
                            std::optional<std::chrono::steady_clock::time_point> wait_until = {});
  bool DropVictim(size_t t);  // mu_ held
  void WritebackLoop();
  void WriteThroughLoop();
  void CheckpointLoop();                       // CHECKPOINTS
  tier::BlockChunks WalkOf(block::Tier kind);  // a chunked walk of the index (tier.h CHUNKED WALK)
  // One write-through batch (mu_ held through `lock`, released during the copy); true when every
  // copy it attempted succeeded.
  bool WriteThroughBatch(std::unique_lock<std::mutex>& lock);
  bool WritebackRound(std::unique_lock<std::mutex>& lock);  // true when it wrote something
  size_t TierIndex(block::Tier kind) const;
  void OpBegin();
  void OpEnd();
  Status CheckRows(const memory::RowBuffer& buf, size_t n) const;
  Status CheckDistinctRows(const memory::RowBuffer& buf) const;
  // The store's own settings, for a store of num_tiers tiers (before any tier is opened).
  static Status CheckConfig(const StoreConfig& config, size_t num_tiers);
  size_t Parts(size_t blocks) const;

  size_t block_bytes_ = 0;
  std::vector<std::unique_ptr<tier::BlockTier>> tiers_;
  std::shared_ptr<concurrency::ThreadPool> engine_;
  std::unique_ptr<TierPolicy> policy_;
  StoreConfig config_;
  size_t headroom_ = 1;

  mutable std::mutex mu_;
  block::BlockIndex index_;
  std::unordered_set<std::string, block::BlockKeyHash, std::equal_to<>> inflight_;
  std::unordered_set<std::string, block::BlockKeyHash, std::equal_to<>> demoting_;
  std::unordered_set<std::string, block::BlockKeyHash, std::equal_to<>> demote_failed_;
  uint64_t sequence_ = 1;
  bool started_ = false;  // Start() indexed what the tiers recovered (CLEAN CLOSE in ~KVStore)
  std::condition_variable room_cv_;  // write-back made room / went idle
  std::condition_variable wb_cv_;    // wakes the write-back worker
  bool stop_ = false;
  bool wb_idle_ = true;
  std::thread writeback_;
  std::thread wt_thread_;
  std::thread ckpt_thread_;
  std::condition_variable ckpt_cv_;   // wakes the checkpoint thread to stop
  std::condition_variable wt_cv_;     // wakes the write-through worker
  std::deque<std::string> wt_queue_;  // keys to copy to the last tier (mu_ held)
  bool wt_busy_ = false;              // a write-through batch is in flight
  // Failure back-off: queued copies are dropped (counted) until wt_pause_until_.
  std::chrono::steady_clock::time_point wt_pause_until_{};
  std::chrono::milliseconds wt_backoff_{0};
  std::mutex ops_mu_;
  std::condition_variable ops_cv_;
  size_t active_ops_ = 0;

  // Counters (mu_ held to update).
  std::vector<TierCounters> counters_;
  uint64_t puts_ = 0, put_stored_ = 0, put_present_ = 0, put_rejected_ = 0, gets_ = 0, misses_ = 0,
           evicted_ = 0, corrupted_ = 0, writeback_errors_ = 0, writeback_inflight_ = 0,
           write_through_ = 0, write_through_dropped_ = 0, write_through_errors_ = 0;
  LatencyStats put_latency_, get_latency_;
  std::deque<StoreEvent> events_;  // mu_ held; bounded by event_capacity_
  size_t event_capacity_ = 0;      // 0: events off
  uint64_t events_dropped_ = 0;
};

}  // namespace tpusync::store
