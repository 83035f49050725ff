#include "tpusync/store/kv_store.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <unordered_map>

#include "tpusync/base/seconds.h"
#include "tpusync/tier/disk_tier.h"
#include "tpusync/tier/host_tier.h"

namespace tpusync::store {
namespace {

using block::Tier;
using Clock = std::chrono::steady_clock;

uint64_t SinceNs(Clock::time_point t0) {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count());
}

void Record(LatencyStats& s, uint64_t ns) {
  ++s.count;
  s.total_ns += ns;
  s.max_ns = std::max(s.max_ns, ns);
}

uint8_t* RowOf(const memory::RowBuffer& b, size_t i) {
  return b.base + (b.rows.empty() ? i : b.rows[i]) * b.stride;
}

}  // namespace

Result<std::vector<std::unique_ptr<tier::BlockTier>>> KVStore::OpenTiers(const KVStoreOptions& o,
                                                                         size_t tiers_below) {
  if (o.block_bytes == 0) return Status::InvalidArgument("KVStore needs block_bytes > 0");
  if (o.host_blocks == 0 && o.disk_dir.empty()) {
    return Status::InvalidArgument("KVStore needs host_blocks > 0 or a disk tier");
  }
  // FAILED OPEN RULE: everything that can refuse the store runs before the host tier exists
  // (the store's settings, then the disk tier), because a host tier in /dev/shm outlives its
  // process by design: a refused open would leave its segment behind, holding host_blocks x
  // block_bytes of RAM.
  const size_t num_tiers = (o.host_blocks > 0) + !o.disk_dir.empty() + tiers_below;
  TPUSYNC_RETURN_IF_ERROR(CheckConfig(ConfigFrom(o), num_tiers));
  std::vector<std::unique_ptr<tier::BlockTier>> tiers;
  if (!o.disk_dir.empty()) {
    if (o.disk_blocks == 0) return Status::InvalidArgument("a disk tier needs disk_blocks > 0");
    tier::DiskTierOptions d;
    d.directory = o.disk_dir;
    d.block_bytes = o.block_bytes;
    d.num_blocks = o.disk_blocks;
    d.segment_blocks = o.disk_segment_blocks;
    d.fingerprint = o.fingerprint;
    d.direct_io = o.disk_direct_io;
    d.io_backend = o.io_backend;
    d.io_threads = o.io_threads;
    d.manifest_progressive_write_back = o.disk_manifest_progressive_write_back;
    TPUSYNC_ASSIGN_OR_RETURN(auto disk, tier::DiskTier::Open(d));
    tiers.push_back(std::move(disk));
  }
  if (o.host_blocks > 0) {
    tier::HostTierOptions h;
    h.block_bytes = o.block_bytes;
    h.num_blocks = o.host_blocks;
    if (!o.name_space.empty()) h.shm_name = "tpusync-" + o.name_space + "-host";
    h.fingerprint = o.fingerprint;
    h.prefault = o.prefault;
    h.huge_pages = o.huge_pages;
    TPUSYNC_ASSIGN_OR_RETURN(auto host, tier::HostTier::Open(h));
    tiers.insert(tiers.begin(), std::move(host));  // the fastest tier first
  }
  return tiers;
}

StoreConfig KVStore::ConfigFrom(const KVStoreOptions& o) {
  StoreConfig c;
  c.policy = o.policy;
  c.policy_history = o.policy_history;
  c.writeback_batch = o.writeback_batch;
  c.writeback_headroom = o.writeback_headroom;
  c.put_wait_s = o.put_wait_s;
  c.write_through = o.write_through;
  c.index_recency = o.index_recency;
  c.checkpoint_s = o.disk_checkpoint_s;
  c.checkpoint_writes = o.disk_checkpoint_writes;
  return c;
}

Status KVStore::CheckConfig(const StoreConfig& config, size_t num_tiers) {
  if (num_tiers == 0) return Status::InvalidArgument("KVStore needs at least one tier");
  if (config.write_through && num_tiers < 2) {
    return Status::InvalidArgument("write_through needs a tier below the first (disk or remote)");
  }
  if (config.write_through && config.write_through_queue == 0) {
    return Status::InvalidArgument("write_through needs write_through_queue > 0");
  }
  if (config.writeback_batch == 0) {
    // The write-back round advances by this many blocks: 0 would loop for ever under the lock.
    return Status::InvalidArgument("writeback_batch must be > 0");
  }
  if (std::isnan(config.put_wait_s) || std::isnan(config.checkpoint_s)) {
    return Status::InvalidArgument("put_wait_s and checkpoint_s must be numbers (not NaN)");
  }
  return MakePolicy(config.policy, config.policy_history).status();
}

Result<std::unique_ptr<KVStore>> KVStore::Open(const KVStoreOptions& o,
                                               std::shared_ptr<concurrency::ThreadPool> engine) {
  TPUSYNC_ASSIGN_OR_RETURN(auto tiers, OpenTiers(o));
  return Open(std::move(tiers), ConfigFrom(o), std::move(engine));
}

Result<std::unique_ptr<KVStore>> KVStore::Open(std::vector<std::unique_ptr<tier::BlockTier>> tiers,
                                               const StoreConfig& config,
                                               std::shared_ptr<concurrency::ThreadPool> engine) {
  if (!engine) return Status::InvalidArgument("KVStore needs an engine");
  TPUSYNC_RETURN_IF_ERROR(CheckConfig(config, tiers.size()));
  for (const auto& t : tiers) {
    if (t->block_bytes() != tiers[0]->block_bytes()) {
      return Status::InvalidArgument("every tier of a KVStore must store the same block size");
    }
  }
  std::unique_ptr<KVStore> s(new KVStore(config.index_recency));
  s->block_bytes_ = tiers[0]->block_bytes();
  s->tiers_ = std::move(tiers);
  s->engine_ = std::move(engine);
  s->config_ = config;
  TPUSYNC_ASSIGN_OR_RETURN(s->policy_, MakePolicy(config.policy, config.policy_history));
  const size_t cap = s->tiers_[0]->capacity();
  s->headroom_ = config.writeback_headroom
                     ? config.writeback_headroom
                     : std::max<size_t>(std::max<size_t>(1, config.writeback_batch), cap / 8);
  s->headroom_ = std::min(s->headroom_, cap);
  TPUSYNC_RETURN_IF_ERROR(s->Start());
  return s;
}

Status KVStore::Start() {
  counters_.resize(tiers_.size());
  // Size the index for every block the tiers can hold (capped: a remote tier may be vast), so a
  // put never pays for a rehash. Best effort: the index still grows on demand if this fails.
  size_t capacity = 0;
  for (const auto& t : tiers_) capacity += std::min<size_t>(t->capacity(), size_t{1} << 26);
  (void)index_.Reserve(std::min<size_t>(capacity, size_t{1} << 26));
  // Rebuild the index from what the tiers recovered, oldest write first so LRU order survives.
  struct Found {
    size_t tier;
    tier::RecoveredBlock block;
  };
  std::vector<Found> found;
  for (size_t t = 0; t < tiers_.size(); ++t) {
    counters_[t].kind = tiers_[t]->kind();
    for (auto& b : tiers_[t]->TakeRecovered()) found.push_back({t, std::move(b)});
  }
  std::sort(found.begin(), found.end(),
            [](const Found& a, const Found& b) { return a.block.sequence < b.block.sequence; });
  for (auto& f : found) {
    sequence_ = std::max(sequence_, f.block.sequence + 1);
    if (!index_.Insert(f.block.key, tiers_[f.tier]->kind(), f.block.location).ok()) {
      tiers_[f.tier]->Release(f.block.location, /*forget=*/false);
    }
  }
  if (tiers_.size() > 1) writeback_ = std::thread([this] { WritebackLoop(); });
  if (config_.write_through) wt_thread_ = std::thread([this] { WriteThroughLoop(); });
  bool has_disk = false;
  for (const auto& t : tiers_) has_disk = has_disk || t->kind() == Tier::kDisk;
  if (has_disk && (config_.checkpoint_s > 0 || config_.checkpoint_writes > 0)) {
    // FIRST CHECKPOINT (tier.h): an empty tier without one (a cold start) gets it now - an empty
    // walk, a few small files - so it journals from its very first write; a tier holding blocks
    // (an open by scan) gets it from the checkpoint thread, in the background, at once.
    for (auto& t : tiers_) {
      if (t->CheckpointMissing() && t->used() == 0) (void)t->Checkpoint(WalkOf(t->kind()));
    }
    ckpt_thread_ = std::thread([this] { CheckpointLoop(); });
  }
  started_ = true;
  return Status::OK();
}

KVStore::~KVStore() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wb_cv_.notify_all();
  wt_cv_.notify_all();
  room_cv_.notify_all();
  ckpt_cv_.notify_all();
  if (ckpt_thread_.joinable()) ckpt_thread_.join();
  if (writeback_.joinable()) writeback_.join();
  if (wt_thread_.joinable()) wt_thread_.join();
  {
    std::unique_lock<std::mutex> lock(ops_mu_);
    ops_cv_.wait(lock, [this] { return active_ops_ == 0; });
  }
  // CLEAN CLOSE (tier.h CLEAN-CLOSE HOOK): write-back and write-through are joined (each finishes
  // the batch it was writing and indexes it before it stops) and every Put / Get has completed,
  // so no write to any tier is in flight or can start: each tier now gets the blocks the index
  // places in it (the disk tier writes its manifest; a failure is counted and logged there).
  // Only a store that started: one that failed in Open (a bad policy name, say) never indexed
  // what its tiers recovered, and an empty manifest would make the next open forget them all.
  if (!started_) return;
  for (auto& t : tiers_) {
    const Tier kind = t->kind();
    (void)t->CheckpointOnClose(WalkOf(kind));
  }
}

tier::BlockChunks KVStore::WalkOf(Tier kind) {
  // CHUNKED WALK (tier.h): the index lock per kWalkChunk keys, released between chunks; the
  // cursor is an entry id (block/block_index.h CURSOR CONTRACT: no rehash moves an entry).
  constexpr size_t kWalkChunk = 4096;
  auto cursor = std::make_shared<uint64_t>(0);
  return [this, kind, cursor](const tier::BlockVisitor& visit) {
    return index_.ForEachInChunk(kind, cursor.get(), kWalkChunk, visit);
  };
}

void KVStore::CheckpointLoop() {
  const auto every = SecondsToDuration(config_.checkpoint_s);  // inf: never by time
  std::vector<Clock::time_point> last(tiers_.size(), Clock::now());
  std::vector<Clock::time_point> retry_at(tiers_.size(), Clock::time_point{});
  std::unique_lock<std::mutex> lock(mu_);
  bool first = true;  // FIRST CHECKPOINT: a tier without one is not kept waiting 100 ms
  while (!stop_) {
    if (!first) ckpt_cv_.wait_for(lock, std::chrono::milliseconds(100), [this] { return stop_; });
    first = false;
    if (stop_) break;
    lock.unlock();
    for (size_t t = 0; t < tiers_.size(); ++t) {
      // FIRST CHECKPOINT (tier.h): a tier with nothing on disk to restart from gets one at once.
      const bool missing = tiers_[t]->CheckpointMissing();
      const uint64_t changes = tiers_[t]->ChangesSinceCheckpoint();
      if (changes == 0 && !missing) continue;
      const Clock::time_point now = Clock::now();
      const bool due = missing ||
                       (config_.checkpoint_writes > 0 && changes >= config_.checkpoint_writes) ||
                       (config_.checkpoint_s > 0 && now - last[t] >= every);
      if (!due) continue;
      if (now < retry_at[t]) continue;
      const Tier kind = tiers_[t]->kind();
      // Only the index lock is held while the tier copies the keys (CHECKPOINT HOOK); a failure
      // is counted and logged by the tier, and retried after 30 s (a full disk is not retried,
      // and logged, ten times a second).
      const Status s = tiers_[t]->Checkpoint(WalkOf(kind));
      last[t] = Clock::now();
      if (!s.ok()) retry_at[t] = last[t] + std::chrono::seconds(30);
    }
    lock.lock();
  }
}

Status KVStore::CheckpointNow() {
  Status first;
  for (auto& t : tiers_) {
    const Tier kind = t->kind();
    const Status s = t->Checkpoint(WalkOf(kind));
    if (first.ok() && !s.ok()) first = s;
  }
  return first;
}

void KVStore::OpBegin() {
  std::lock_guard<std::mutex> lock(ops_mu_);
  ++active_ops_;
}
void KVStore::OpEnd() {
  std::lock_guard<std::mutex> lock(ops_mu_);
  if (--active_ops_ == 0) ops_cv_.notify_all();
}

size_t KVStore::TierIndex(Tier kind) const {
  for (size_t t = 0; t < tiers_.size(); ++t) {
    if (tiers_[t]->kind() == kind) return t;
  }
  return tiers_.size();
}

size_t KVStore::Parts(size_t blocks) const {
  const size_t bytes = blocks * block_bytes_;
  return std::clamp<size_t>(bytes / (256 * 1024), 1, std::min(blocks, engine_->num_threads()));
}

Status KVStore::CheckRows(const memory::RowBuffer& b, size_t n) const {
  if (n == 0) return Status::OK();
  if (b.stride < block_bytes_) {
    return Status::InvalidArgument(
        StrCat("buffer row stride ", b.stride, " is smaller than the block size ", block_bytes_));
  }
  if (!b.rows.empty() && b.rows.size() != n) {
    return Status::InvalidArgument(
        StrCat(b.rows.size(), " row indices given for ", n, " keys; counts must match"));
  }
  if (b.rows.empty() && n > b.num_rows) {
    return Status::InvalidArgument(
        StrCat("buffer holds ", b.num_rows, " blocks but ", n, " keys were given"));
  }
  for (uint64_t r : b.rows) {
    if (r >= b.num_rows) {
      return Status::InvalidArgument(
          StrCat("row index ", r, " is out of range for a buffer of ", b.num_rows, " blocks"));
    }
  }
  return Status::OK();
}

Status KVStore::CheckDistinctRows(const memory::RowBuffer& b) const {
  // DISTINCT ROWS (get): two keys read into one row race, the row ends with either block, and a
  // lower tier verifying the bytes there could see the other key's.
  std::vector<std::pair<uint64_t, size_t>> rows;
  rows.reserve(b.rows.size());
  for (size_t i = 0; i < b.rows.size(); ++i) rows.push_back({b.rows[i], i});
  std::sort(rows.begin(), rows.end());
  for (size_t j = 1; j < rows.size(); ++j) {
    if (rows[j].first == rows[j - 1].first) {
      return Status::InvalidArgument(StrCat("row index ", rows[j].first, " is given for keys #",
                                            rows[j - 1].second, " and #", rows[j].second,
                                            "; a get writes every key into a row of its own"));
    }
  }
  return Status::OK();
}

bool KVStore::DropVictim(size_t t) {
  const Tier kind = tiers_[t]->kind();
  const bool has_lower = t + 1 < tiers_.size();
  // Usually the least recent block is droppable: look at a few first, then further.
  auto cands = index_.EvictionCandidates(kind, 8);
  if (cands.size() == 8) {
    bool any = false;
    for (const block::Victim& v : cands) {
      if (demoting_.count(v.key)) continue;
      auto p = has_lower ? index_.Lookup(v.key, false) : std::nullopt;
      if (!has_lower || (p && p->in(tiers_[t + 1]->kind())) || demote_failed_.count(v.key) ||
          !policy_->AdmitBelow(v.key, kind)) {
        any = true;
        break;
      }
    }
    if (!any) cands = index_.EvictionCandidates(kind, config_.writeback_batch * 2 + 8);
  }
  for (const block::Victim& v : cands) {
    if (demoting_.count(v.key)) continue;
    bool droppable = !has_lower;
    if (has_lower) {
      auto p = index_.Lookup(v.key, /*touch=*/false);
      droppable = (p && p->in(tiers_[t + 1]->kind())) || demote_failed_.count(v.key) ||
                  !policy_->AdmitBelow(v.key, kind);
    }
    if (!droppable) continue;
    auto loc = index_.Remove(v.key, kind);
    if (!loc.ok()) continue;
    tiers_[t]->Release(*loc, /*forget=*/false);
    ++counters_[t].evictions;
    Emit(StoreEvent::Kind::kRemoved, kind, v.key);
    if (!index_.Lookup(v.key, false)) {
      ++evicted_;
      demote_failed_.erase(v.key);
    }
    return true;
  }
  return false;
}

Result<uint64_t> KVStore::MakeRoom(size_t t, std::unique_lock<std::mutex>& lock,
                                   std::optional<Clock::time_point> wait_until) {
  const bool wait = wait_until.has_value();
  for (;;) {
    auto loc = tiers_[t]->Reserve();
    if (loc.ok()) return loc;
    if (DropVictim(t)) continue;
    // Room can still come from write-back below, or from puts in flight becoming evictable.
    const bool can_come = t + 1 < tiers_.size() || (t == 0 && inflight_.size() > 1);
    if (!wait || !can_come || stop_) {
      return Status::PoolExhausted(StrCat("the ", block::TierName(tiers_[t]->kind()),
                                          " tier is full of pinned or in-flight blocks (",
                                          tiers_[t]->capacity(), " blocks)"));
    }
    wb_cv_.notify_all();
    if (room_cv_.wait_until(lock, *wait_until) == std::cv_status::timeout) {
      if (tiers_[t]->used() < tiers_[t]->capacity() || DropVictim(t)) continue;
      return Status::PoolExhausted(StrCat("the ", block::TierName(tiers_[t]->kind()),
                                          " tier stayed full for ", config_.put_wait_s,
                                          " s: write-back to the next tier did not free a slot"));
    }
  }
}

concurrency::Future KVStore::Put(std::vector<std::string> keys, memory::RowBuffer src,
                                 std::shared_ptr<std::vector<uint8_t>> stored) {
  const auto t0 = Clock::now();
  Status bad = CheckRows(src, keys.size());
  for (size_t i = 0; bad.ok() && i < keys.size(); ++i) bad = block::ValidateKey(keys[i]);
  if (!bad.ok()) return concurrency::Future::Completed(bad);
  stored->assign(keys.size(), 0);
  // A put larger than the free room goes out in chunks: each chunk's blocks become visible (and
  // evictable / demotable) when it completes, which is what lets the next chunk find room.
  struct State {
    std::vector<std::string> keys;
    std::atomic<size_t> pending{1};  // chunks in flight + the submitting call
    std::mutex mu;
    Status first_error;
    concurrency::Future user;
  };
  struct Chunk {
    std::vector<tier::BlockWrite> ops;
    std::vector<size_t> index;  // ops[j] is keys[index[j]]
  };
  auto state = std::make_shared<State>();
  state->keys = std::move(keys);
  state->user->TryStart();  // running from the start: Cancel cannot complete it while bytes move
  OpBegin();
  auto part_done = [this, state, t0](const Status& s) {
    if (!s.ok()) {
      std::lock_guard<std::mutex> lock(state->mu);
      if (state->first_error.ok()) state->first_error = s;
    }
    if (state->pending.fetch_sub(1) != 1) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      Record(put_latency_, SinceNs(t0));
    }
    OpEnd();
    state->user->Complete(state->first_error);
  };
  tier::BlockTier* top = tiers_[0].get();
  auto submit = [&](std::shared_ptr<Chunk> chunk) {
    state->pending.fetch_add(1);
    const size_t parts = Parts(chunk->ops.size());
    std::vector<concurrency::ThreadPool::Task> tasks;
    for (size_t p = 0; p < parts; ++p) {
      const size_t lo = chunk->ops.size() * p / parts, hi = chunk->ops.size() * (p + 1) / parts;
      tasks.push_back([chunk, top, lo, hi](const concurrency::FutureCore&) {
        top->WriteBatch(std::span(chunk->ops).subspan(lo, hi - lo));
        return Status::OK();
      });
    }
    concurrency::Future inner = engine_->SubmitBatch(std::move(tasks));
    inner->OnComplete([this, state, chunk, stored, part_done](const Status& s) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        for (size_t j = 0; j < chunk->ops.size(); ++j) {
          tier::BlockWrite& op = chunk->ops[j];
          const std::string& key = state->keys[chunk->index[j]];
          inflight_.erase(key);
          if (s.ok() && op.status.ok() && index_.Insert(key, tiers_[0]->kind(), op.location).ok()) {
            (*stored)[chunk->index[j]] = 1;
            ++put_stored_;
            Emit(StoreEvent::Kind::kStored, tiers_[0]->kind(), key);
            if (config_.write_through) {
              if (wt_queue_.size() >= config_.write_through_queue) {
                wt_queue_.pop_front();
                ++write_through_dropped_;
              }
              wt_queue_.push_back(key);
            }
          } else {
            tiers_[0]->Release(op.location, /*forget=*/op.status.ok());  // WRITTEN, NOT INDEXED
            ++put_rejected_;
          }
        }
      }
      room_cv_.notify_all();
      wb_cv_.notify_all();
      if (config_.write_through) wt_cv_.notify_all();
      part_done(s);
    });
  };
  auto chunk = std::make_shared<Chunk>();
  const auto put_deadline = t0 + SecondsToDuration(config_.put_wait_s);  // ONE PUT WAIT
  {
    std::unique_lock<std::mutex> lock(mu_);
    puts_ += state->keys.size();
    for (size_t i = 0; i < state->keys.size(); ++i) {
      const std::string& key = state->keys[i];
      policy_->OnAccess(key);
      if (inflight_.count(key) || index_.Lookup(key, /*touch=*/true)) {
        (*stored)[i] = 1;
        ++put_present_;
        continue;
      }
      inflight_.insert(key);
      auto loc = MakeRoom(0, lock);
      if (!loc.ok() && !chunk->ops.empty()) {
        lock.unlock();
        submit(std::move(chunk));
        chunk = std::make_shared<Chunk>();
        lock.lock();
      }
      if (!loc.ok()) loc = MakeRoom(0, lock, put_deadline);
      if (!loc.ok()) {
        inflight_.erase(key);
        ++put_rejected_;
        continue;
      }
      chunk->ops.push_back({key, RowOf(src, i), *loc, sequence_++, Status(), std::nullopt});
      chunk->index.push_back(i);
    }
  }
  if (!chunk->ops.empty()) submit(std::move(chunk));
  concurrency::Future user = state->user;
  part_done(Status::OK());
  return user;
}

concurrency::Future KVStore::Get(std::vector<std::string> keys, memory::RowBuffer dst,
                                 std::shared_ptr<std::vector<uint8_t>> found) {
  const auto t0 = Clock::now();
  Status bad = CheckRows(dst, keys.size());
  if (bad.ok()) bad = CheckDistinctRows(dst);
  for (size_t i = 0; bad.ok() && i < keys.size(); ++i) bad = block::ValidateKey(keys[i]);
  if (!bad.ok()) return concurrency::Future::Completed(bad);
  found->assign(keys.size(), 0);
  struct Job {
    std::vector<std::string> keys;
    std::vector<std::vector<tier::BlockRead>> reads;  // per tier
    std::vector<std::vector<size_t>> index;
    memory::RowBuffer dst;
  };
  auto job = std::make_shared<Job>();
  job->keys = std::move(keys);
  job->reads.resize(tiers_.size());
  job->index.resize(tiers_.size());
  job->dst = std::move(dst);
  {
    std::lock_guard<std::mutex> lock(mu_);
    gets_ += job->keys.size();
    for (size_t i = 0; i < job->keys.size(); ++i) {
      const std::string& key = job->keys[i];
      auto p = index_.Lookup(key, /*touch=*/true);
      size_t t = tiers_.size();
      if (p) {
        for (t = 0; t < tiers_.size() && !p->in(tiers_[t]->kind()); ++t) {
        }
      }
      if (t == tiers_.size()) {
        ++misses_;
        continue;
      }
      const uint64_t loc = p->location[static_cast<size_t>(tiers_[t]->kind())];
      if (!tiers_[t]->Hold(loc).ok()) {
        ++misses_;
        continue;
      }
      policy_->OnAccess(key);
      ++counters_[t].hits;
      job->reads[t].push_back({key, RowOf(job->dst, i), loc, Status(), std::nullopt});
      job->index[t].push_back(i);
    }
  }
  OpBegin();
  std::vector<concurrency::ThreadPool::Task> tasks;
  for (size_t t = 0; t < tiers_.size(); ++t) {
    const size_t n = job->reads[t].size();
    if (n == 0) continue;
    const size_t parts = Parts(n);
    tier::BlockTier* tier = tiers_[t].get();
    for (size_t p = 0; p < parts; ++p) {
      const size_t lo = n * p / parts, hi = n * (p + 1) / parts;
      tasks.push_back([job, tier, t, lo, hi](const concurrency::FutureCore&) {
        tier->ReadBatch(std::span(job->reads[t]).subspan(lo, hi - lo));
        return Status::OK();
      });
    }
  }
  concurrency::Future user;
  user->TryStart();  // running from the start: Cancel cannot complete it while bytes move
  concurrency::Future inner = engine_->SubmitBatch(std::move(tasks));
  inner->OnComplete([this, job, found, user, t0](const Status& s) {
    struct Forget {
      size_t tier;
      uint64_t loc;
    };
    std::vector<Forget> forget;
    std::vector<tier::BlockWrite> promote;
    struct Promotable {
      size_t key;                     // index into job->keys (and the caller's rows)
      std::optional<uint64_t> check;  // the checksum the lower tier verified, where it has one
    };
    std::vector<Promotable> promote_from;
    {
      std::unique_lock<std::mutex> lock(mu_);
      for (size_t t = 0; t < tiers_.size(); ++t) {
        for (size_t j = 0; j < job->reads[t].size(); ++j) {
          tier::BlockRead& op = job->reads[t][j];
          const size_t i = job->index[t][j];
          tiers_[t]->Unhold(op.location);
          if (s.ok() && op.status.ok()) {
            (*found)[i] = 1;
            if (t > 0) promote_from.push_back({i, op.checksum});
            continue;
          }
          ++misses_;
          // kNotFound: a shared tier (remote) no longer holds the key - forget it like a
          // corrupted block, without counting it as corruption.
          if (op.status.code() == StatusCode::kCorrupted ||
              op.status.code() == StatusCode::kNotFound) {
            corrupted_ += op.status.code() == StatusCode::kCorrupted;
            const Tier kind = tiers_[t]->kind();
            auto p = index_.Lookup(op.key, false);
            if (p && p->in(kind) && p->location[static_cast<size_t>(kind)] == op.location) {
              (void)index_.Remove(op.key, kind);
              Emit(StoreEvent::Kind::kRemoved, kind, op.key);
              forget.push_back({t, op.location});
            }
          }
        }
      }
      // Promote lower-tier hits into the fastest tier when that needs no waiting.
      // PROMOTION CHECK: the copy comes out of the caller's row, which the caller may change
      // (another thread sharing the buffer) once the read verified it, so the fastest tier
      // checks it against the verified checksum (the disk slot's; the reply frame's for a remote
      // read) while it copies and indexes nothing on a mismatch.
      for (const Promotable& from : promote_from) {
        const size_t i = from.key;
        const std::string& key = job->keys[i];
        auto p = index_.Lookup(key, false);
        if (!p || p->in(tiers_[0]->kind()) || inflight_.count(key)) continue;
        auto loc = MakeRoom(0, lock);
        if (!loc.ok()) break;
        inflight_.insert(key);
        promote.push_back({key, RowOf(job->dst, i), *loc, sequence_++, Status(), from.check});
      }
    }
    for (const Forget& f : forget) tiers_[f.tier]->Release(f.loc, /*forget=*/true);
    if (!promote.empty()) tiers_[0]->WriteBatch(promote);
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (tier::BlockWrite& op : promote) {
        inflight_.erase(std::string(op.key));
        if (op.status.ok() && index_.Lookup(op.key, false) &&
            index_.Insert(op.key, tiers_[0]->kind(), op.location).ok()) {
          ++counters_[0].promotions_in;
          Emit(StoreEvent::Kind::kStored, tiers_[0]->kind(), op.key);
        } else {
          tiers_[0]->Release(op.location, false);
        }
      }
      Record(get_latency_, SinceNs(t0));
    }
    OpEnd();
    user->Complete(s);
  });
  return user;
}

size_t KVStore::Lookup(std::span<const std::string_view> keys, std::vector<block::Placement>* out) {
  const size_t local = index_.LookupPrefix(keys, out);
  if (local == keys.size() || tiers_.empty()) return local;
  // SHARED TIER HOOK (tier.h): the rest may be in the last tier although this store never wrote
  // it (another client's blocks on the store nodes).
  tier::BlockTier& last = *tiers_.back();
  std::vector<uint64_t> locs;
  const size_t found = last.AdoptPrefix(keys.subspan(local), &locs);
  if (found == 0) return local;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t j = 0; j < found; ++j) {
      if (!index_.Insert(keys[local + j], last.kind(), locs[j]).ok()) {
        last.Release(locs[j], /*forget=*/false);  // indexed meanwhile (or already elsewhere)
      } else {
        Emit(StoreEvent::Kind::kStored, last.kind(), keys[local + j]);  // readable here now
      }
    }
  }
  return index_.LookupPrefix(keys, out);
}

Status KVStore::Pin(std::span<const std::string_view> keys) {
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < keys.size(); ++i) {
    if (!index_.Lookup(keys[i], false)) {
      return Status::NotFound(StrCat("cannot pin key #", i, ": it is not stored"));
    }
  }
  for (auto k : keys) TPUSYNC_RETURN_IF_ERROR(index_.Pin(k));
  return Status::OK();
}

Status KVStore::Unpin(std::span<const std::string_view> keys) {
  std::lock_guard<std::mutex> lock(mu_);
  std::unordered_map<std::string_view, uint32_t> need;
  for (auto k : keys) ++need[k];
  for (size_t i = 0; i < keys.size(); ++i) {
    auto p = index_.Lookup(keys[i], false);
    if (!p) return Status::NotFound(StrCat("cannot unpin key #", i, ": it is not stored"));
    if (p->pins < need[keys[i]]) {
      return Status::FailedPrecondition(
          StrCat("unpin of key #", i, " which is not pinned (unbalanced pin/unpin)"));
    }
  }
  for (auto k : keys) TPUSYNC_RETURN_IF_ERROR(index_.Unpin(k));
  return Status::OK();
}

Result<size_t> KVStore::Remove(std::span<const std::string_view> keys) {
  struct Forget {
    size_t tier;
    uint64_t loc;
  };
  std::vector<Forget> forget;
  size_t removed = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < keys.size(); ++i) {
      auto p = index_.Lookup(keys[i], false);
      if (p && p->pins > 0) {
        return Status::FailedPrecondition(
            StrCat("cannot remove key #", i, ": it is pinned; unpin it first"));
      }
    }
    for (auto k : keys) {
      auto p = index_.Erase(k);
      if (!p.ok()) continue;
      ++removed;
      for (size_t t = 0; t < tiers_.size(); ++t) {
        if (p->in(tiers_[t]->kind())) {
          Emit(StoreEvent::Kind::kRemoved, tiers_[t]->kind(), k);
          forget.push_back({t, p->location[static_cast<size_t>(tiers_[t]->kind())]});
        }
      }
      demote_failed_.erase(std::string(k));
    }
  }
  for (const Forget& f : forget) tiers_[f.tier]->Release(f.loc, /*forget=*/true);
  return removed;
}

void KVStore::Clear() {
  std::vector<std::pair<block::BlockKey, block::Placement>> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    all = index_.Snapshot();
    index_.Clear();
    demote_failed_.clear();
    wt_queue_.clear();
    if (event_capacity_ > 0) {
      events_.clear();  // superseded: a consumer re-reads the (empty) store after kCleared
      Emit(StoreEvent::Kind::kCleared, block::Tier::kHost, {});
    }
  }
  for (const auto& [key, p] : all) {
    for (size_t t = 0; t < tiers_.size(); ++t) {
      if (p.in(tiers_[t]->kind())) {
        tiers_[t]->Release(p.location[static_cast<size_t>(tiers_[t]->kind())], /*forget=*/true);
      }
    }
  }
}

void KVStore::WritebackLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    const bool wrote = WritebackRound(lock);
    if (stop_) break;
    if (!wrote) {
      wb_idle_ = true;
      room_cv_.notify_all();
      wb_cv_.wait_for(lock, std::chrono::milliseconds(100));
    }
  }
  wb_idle_ = true;
  room_cv_.notify_all();
}

bool KVStore::WritebackRound(std::unique_lock<std::mutex>& lock) {
  bool wrote = false;
  for (size_t t = 0; t + 1 < tiers_.size(); ++t) {
    tier::BlockTier& top = *tiers_[t];
    tier::BlockTier& low = *tiers_[t + 1];
    const Tier kind = top.kind();
    // Only the coldest `headroom_` blocks need a copy below, and only when the tier is that full.
    if (top.used() + headroom_ <= top.capacity()) continue;
    auto eligible = [&](const std::string& key) {
      if (demoting_.count(key) || demote_failed_.count(key)) return false;
      auto p = index_.Lookup(key, false);
      return p && p->in(kind) && !p->in(low.kind()) && policy_->AdmitBelow(key, kind);
    };
    // One scan of the cold window per round, written in chunks of writeback_batch (the scan is
    // O(headroom); rescanning per chunk would hold the store lock far longer than the I/O).
    std::vector<block::Victim> dirty;
    for (block::Victim& v : index_.EvictionCandidates(kind, headroom_)) {
      if (eligible(v.key)) dirty.push_back(std::move(v));
    }
    for (size_t first = 0; first < dirty.size() && !stop_; first += config_.writeback_batch) {
      const size_t last = std::min(dirty.size(), first + config_.writeback_batch);
      std::vector<tier::BlockWrite> ops;
      std::vector<std::string> keys;
      std::vector<uint64_t> from;
      keys.reserve(last - first);
      for (size_t d = first; d < last; ++d) {
        const block::Victim& v = dirty[d];
        if (!eligible(v.key)) continue;  // changed while the lock was released
        auto p = index_.Lookup(v.key, false);
        if (p->location[static_cast<size_t>(kind)] != v.location) continue;
        auto loc = MakeRoom(t + 1, lock);
        if (!loc.ok()) break;
        if (!top.Hold(v.location).ok()) {
          low.Release(*loc, false);
          continue;
        }
        demoting_.insert(v.key);
        keys.push_back(v.key);
        from.push_back(v.location);
        ops.push_back({{}, nullptr, *loc, sequence_++, Status(), std::nullopt});
      }
      if (ops.empty()) continue;
      wb_idle_ = false;
      writeback_inflight_ += ops.size();
      lock.unlock();
      std::vector<std::vector<uint8_t>> bounce;
      bounce.reserve(ops.size());
      for (size_t j = 0; j < ops.size(); ++j) {
        ops[j].key = keys[j];
        ops[j].data = top.Address(from[j]);
        if (ops[j].data == nullptr) {  // not byte-addressable: stage through a read
          bounce.emplace_back(block_bytes_);
          tier::BlockRead r{keys[j], bounce.back().data(), from[j], Status(), std::nullopt};
          top.ReadBatch({&r, 1});
          ops[j].data = r.status.ok() ? bounce.back().data() : nullptr;
        }
      }
      std::vector<tier::BlockWrite> ready;
      for (auto& op : ops) {
        if (op.data) ready.push_back(op);
      }
      low.WriteBatch(ready);
      lock.lock();
      bool failed = false;
      for (size_t j = 0, r = 0; j < ops.size(); ++j) {
        Status st = ops[j].data ? ready[r++].status : Status::IOError("source read failed");
        top.Unhold(from[j]);
        demoting_.erase(keys[j]);
        auto p = index_.Lookup(keys[j], false);
        if (st.ok() && p && !p->in(low.kind()) &&
            index_.Insert(keys[j], low.kind(), ops[j].location).ok()) {
          ++counters_[t + 1].demotions_in;
          Emit(StoreEvent::Kind::kStored, low.kind(), keys[j]);
          continue;
        }
        // WRITTEN, NOT INDEXED: a key removed (or cleared) while its write landed must not come
        // back after a crash from the header just written, so its slot is forgotten.
        low.Release(ops[j].location, /*forget=*/st.ok());
        if (!st.ok()) {
          ++writeback_errors_;
          demote_failed_.insert(keys[j]);
          failed = true;
        }
      }
      writeback_inflight_ -= ops.size();
      wrote = true;
      room_cv_.notify_all();
      if (failed) {
        // Back off so a full disk is not hammered; the failed blocks are now droppable from DRAM.
        wb_cv_.wait_for(lock, std::chrono::milliseconds(20));
        break;
      }
    }
  }
  return wrote;
}

void KVStore::WriteThroughLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    if (wt_queue_.empty()) {
      room_cv_.notify_all();  // Flush waits for an empty queue
      wt_cv_.wait_for(lock, std::chrono::milliseconds(100));
      continue;
    }
    if (Clock::now() < wt_pause_until_) {  // the last tier failed recently: skip, counted
      write_through_dropped_ += wt_queue_.size();
      wt_queue_.clear();
      continue;
    }
    if (WriteThroughBatch(lock)) {
      wt_backoff_ = std::chrono::milliseconds(0);
    } else {
      wt_backoff_ = std::min<std::chrono::milliseconds>(
          std::chrono::milliseconds(30000),
          std::max<std::chrono::milliseconds>(std::chrono::milliseconds(1000), wt_backoff_ * 2));
      wt_pause_until_ = Clock::now() + wt_backoff_;
    }
  }
  room_cv_.notify_all();
}

bool KVStore::WriteThroughBatch(std::unique_lock<std::mutex>& lock) {
  const size_t last = tiers_.size() - 1;
  tier::BlockTier& low = *tiers_[last];
  const Tier low_kind = low.kind();
  struct Copy {
    std::string key;
    size_t from_tier;
    uint64_t from;
    uint64_t to;
    uint64_t sequence;
  };
  std::vector<Copy> copies;
  std::vector<std::string> later;  // being moved by write-back right now: retried after it
  const size_t batch = std::max<size_t>(1, config_.writeback_batch);
  while (!wt_queue_.empty() && copies.size() < batch) {
    std::string key = std::move(wt_queue_.front());
    wt_queue_.pop_front();
    // Being moved by write-back (to the last tier, or to a middle tier such as disk above store
    // nodes): copied, or found below, once that move ended. Never dropped silently.
    if (demoting_.count(key)) {
      later.push_back(std::move(key));
      continue;
    }
    // Gone or already below: nothing to copy.
    auto p = index_.Lookup(key, /*touch=*/false);
    if (!p || p->in(low_kind)) continue;
    size_t t = 0;
    while (t < last && !p->in(tiers_[t]->kind())) ++t;
    if (t == last) continue;
    const uint64_t from = p->location[static_cast<size_t>(tiers_[t]->kind())];
    auto loc = MakeRoom(last, lock);
    if (!loc.ok()) {  // every handle of the last tier pinned / in flight: drop the copy
      ++write_through_dropped_;
      continue;
    }
    if (!tiers_[t]->Hold(from).ok()) {
      low.Release(*loc, false);
      continue;
    }
    demoting_.insert(key);
    copies.push_back({std::move(key), t, from, *loc, sequence_++});
  }
  for (auto& key : later) wt_queue_.push_back(std::move(key));
  if (copies.empty()) {
    // Only keys write-back is moving: let it finish (it writes without the lock) instead of
    // spinning over them.
    if (!later.empty()) wt_cv_.wait_for(lock, std::chrono::milliseconds(2));
    return true;
  }
  wt_busy_ = true;
  lock.unlock();
  std::vector<tier::BlockWrite> ops;
  std::vector<std::vector<uint8_t>> bounce;
  std::vector<size_t> op_of(copies.size(), SIZE_MAX);
  bounce.reserve(copies.size());
  for (size_t j = 0; j < copies.size(); ++j) {
    const Copy& c = copies[j];
    const uint8_t* data = tiers_[c.from_tier]->Address(c.from);
    if (data == nullptr) {  // not byte-addressable (disk): stage through a read
      bounce.emplace_back(block_bytes_);
      tier::BlockRead r{c.key, bounce.back().data(), c.from, Status(), std::nullopt};
      tiers_[c.from_tier]->ReadBatch({&r, 1});
      data = r.status.ok() ? bounce.back().data() : nullptr;
    }
    if (data == nullptr) continue;
    op_of[j] = ops.size();
    ops.push_back({c.key, data, c.to, c.sequence, Status(), std::nullopt});
  }
  low.WriteBatch(ops);
  lock.lock();
  wt_busy_ = false;
  bool all_ok = true;
  for (size_t j = 0; j < copies.size(); ++j) {
    const Copy& c = copies[j];
    tiers_[c.from_tier]->Unhold(c.from);
    demoting_.erase(c.key);
    const Status st =
        op_of[j] == SIZE_MAX ? Status::IOError("source read failed") : ops[op_of[j]].status;
    auto p = index_.Lookup(c.key, false);
    if (st.ok() && p && !p->in(low_kind) && index_.Insert(c.key, low_kind, c.to).ok()) {
      ++write_through_;
      Emit(StoreEvent::Kind::kStored, low_kind, c.key);
      continue;
    }
    low.Release(c.to, /*forget=*/st.ok());  // WRITTEN, NOT INDEXED (see WritebackRound)
    if (!st.ok()) {
      ++write_through_errors_;
      all_ok = false;
    }
  }
  room_cv_.notify_all();
  return all_ok;
}

Status KVStore::Flush(std::chrono::nanoseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  if (tiers_.size() < 2) return Status::OK();
  wb_idle_ = false;
  wb_cv_.notify_all();
  wt_cv_.notify_all();
  if (!room_cv_.wait_for(lock, timeout, [this] {
        return (wb_idle_ && wt_queue_.empty() && !wt_busy_) || stop_;
      })) {
    return Status::Timeout("write-back or write-through still busy at the flush deadline");
  }
  return Status::OK();
}

StoreStats KVStore::stats() const {
  StoreStats s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    s.tiers = counters_;
    s.puts = puts_;
    s.put_stored = put_stored_;
    s.put_present = put_present_;
    s.put_rejected = put_rejected_;
    s.gets = gets_;
    s.misses = misses_;
    s.evicted = evicted_;
    s.corrupted = corrupted_;
    s.writeback_errors = writeback_errors_;
    s.writeback_inflight = writeback_inflight_;
    s.write_through = write_through_;
    s.write_through_dropped = write_through_dropped_;
    s.write_through_errors = write_through_errors_;
    s.put_latency = put_latency_;
    s.get_latency = get_latency_;
    s.policy = std::string(policy_->name());
  }
  for (size_t t = 0; t < tiers_.size(); ++t) {
    s.tiers[t].tier = tiers_[t]->stats();
    s.tiers[t].indexed = index_.Count(tiers_[t]->kind());
  }
  s.keys = index_.size();
  s.engine_queue = engine_->queue_depth();
  return s;
}

void KVStore::Emit(StoreEvent::Kind kind, Tier tier, std::string_view key) {
  if (event_capacity_ == 0) return;
  if (events_.size() >= event_capacity_) {
    events_.pop_front();
    ++events_dropped_;
  }
  events_.push_back(StoreEvent{kind, tier, std::string(key)});
}

void KVStore::EnableEvents(size_t capacity) {
  std::lock_guard<std::mutex> lock(mu_);
  event_capacity_ = capacity;
  if (capacity == 0) {
    events_.clear();
    events_dropped_ = 0;
  }
  while (events_.size() > capacity) {
    events_.pop_front();
    ++events_dropped_;
  }
}

std::vector<StoreEvent> KVStore::TakeEvents(size_t max, uint64_t* dropped) {
  std::lock_guard<std::mutex> lock(mu_);
  const size_t n = std::min(max, events_.size());
  std::vector<StoreEvent> out(std::make_move_iterator(events_.begin()),
                              std::make_move_iterator(events_.begin() + n));
  events_.erase(events_.begin(), events_.begin() + n);
  if (dropped) {
    *dropped = events_dropped_;
    events_dropped_ = 0;
  }
  return out;
}

}  // namespace tpusync::store
