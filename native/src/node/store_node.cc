#include "tpusync/node/store_node.h"

#include <algorithm>
#include <cstdio>
#include <unordered_set>

namespace tpusync::node {

using transport::DeadlineInMs;
using transport::EncodeStatus;
using transport::InFrame;
using transport::MetaReader;
using transport::MetaWriter;
using transport::Op;
using transport::Stream;

// REQUEST MEMORY CONTRACT: new[] of a byte array leaves it unfilled, so a large buffer's pages
// are committed only where a payload lands (std::vector would zero every byte first).
struct StoreNode::Scratch {
  std::unique_ptr<uint8_t[]> bytes;
  size_t size = 0;
  uint8_t* Reserve(size_t n) {
    if (size < n) {
      bytes.reset();
      bytes.reset(new uint8_t[n]);
      size = n;
    }
    return bytes.get();
  }
};

namespace {
constexpr int64_t kIoTimeoutMs = 30000;
constexpr auto kIdleLinkTimeout = std::chrono::minutes(10);

}  // namespace

Status StoreNode::Reply(Stream& s, uint64_t id, const Status& st,
                        const std::vector<uint8_t>& per_key,
                        const std::vector<const uint8_t*>& blocks) {
  MetaWriter w;
  const auto head = EncodeStatus(st);
  w.Bytes(head).U32(static_cast<uint32_t>(per_key.size())).Bytes(per_key);
  w.U64(options_.block_bytes);
  transport::OutFrame f;
  f.op = Op::kStoreReply;
  f.request_id = id;
  const auto meta = w.Take();
  f.meta = meta;
  f.blocks = blocks;
  f.block_bytes = blocks.empty() ? 0 : options_.block_bytes;
  return s.Send(f, DeadlineInMs(kIoTimeoutMs));
}

std::vector<uint8_t> EncodeKeys(const std::vector<std::string>& keys) {
  MetaWriter w;
  w.U32(static_cast<uint32_t>(keys.size()));
  for (const auto& k : keys) w.Str(k);
  return w.Take();
}

Result<std::vector<std::string>> DecodeKeys(MetaReader& r) {
  TPUSYNC_ASSIGN_OR_RETURN(uint32_t n, r.U32());
  if (n == 0 || n > kMaxKeysPerRequest) {
    return Status::InvalidArgument(
        StrCat("a request carries ", n, " keys (1..", kMaxKeysPerRequest, " allowed)"));
  }
  std::vector<std::string> keys;
  keys.reserve(std::min<size_t>(n, r.remaining() / 5 + 1));
  for (uint32_t i = 0; i < n; ++i) {
    // Any length the frame holds, so that ValidateKey names what is wrong with the key.
    TPUSYNC_ASSIGN_OR_RETURN(std::string k, r.Str(transport::kMaxMetaBytes));
    TPUSYNC_RETURN_IF_ERROR(block::ValidateKey(k));
    keys.push_back(std::move(k));
  }
  return keys;
}

Result<std::unique_ptr<StoreNode>> StoreNode::Start(StoreNodeOptions options, Secret secret) {
  if (options.block_bytes > kMaxNodeRequestBytes) {
    return Status::InvalidArgument(StrCat("block size ", options.block_bytes,
                                          " bytes exceeds a node request's limit of ",
                                          kMaxNodeRequestBytes, " (no block could be stored)"));
  }
  if (options.block_bytes == 0 || options.capacity_bytes < options.block_bytes) {
    return Status::InvalidArgument(StrCat("capacity ", options.capacity_bytes,
                                          " bytes cannot hold one block of ", options.block_bytes));
  }
  if (!options.disk_dir.empty() && options.disk_capacity_bytes < options.block_bytes) {
    return Status::InvalidArgument(StrCat("disk capacity ", options.disk_capacity_bytes,
                                          " bytes cannot hold one block of ", options.block_bytes));
  }
  std::unique_ptr<StoreNode> n(new StoreNode());
  n->options_ = options;
  n->max_leased_keys_ = options.capacity_bytes / options.block_bytes / kLeasedShare;
  n->engine_ =
      std::make_shared<concurrency::ThreadPool>(std::max<size_t>(1, options.engine_threads));
  store::KVStoreOptions ko;
  ko.block_bytes = options.block_bytes;
  ko.host_blocks = options.capacity_bytes / options.block_bytes;
  ko.disk_dir = options.disk_dir;
  if (!options.disk_dir.empty()) ko.disk_blocks = options.disk_capacity_bytes / options.block_bytes;
  ko.prefault = false;  // a node may be sized far above what its first minutes use
  ko.name_space = options.name_space;
  ko.fingerprint = options.fingerprint;
  TPUSYNC_ASSIGN_OR_RETURN(n->store_, store::KVStore::Open(ko, n->engine_));
  for (const auto& t : n->store_->stats().tiers) {
    n->recovered_blocks_ += t.tier.recovered;
    if (n->cold_start_reason_.empty()) n->cold_start_reason_ = t.tier.cold_start_reason;
  }
  if (!options.name_space.empty()) {
    // One line either way, so an operator sees whether the restart kept the cache.
    if (n->cold_start_reason_.empty()) {
      std::fprintf(stderr,
                   "tpusync store node: namespace '%s': %s, %llu blocks re-attached and verified\n",
                   options.name_space.c_str(),
                   n->recovered_blocks_ ? "warm restart" : "no cached blocks (first start)",
                   static_cast<unsigned long long>(n->recovered_blocks_));
    } else {
      std::fprintf(stderr, "tpusync store node: namespace '%s': cold start: %s\n",
                   options.name_space.c_str(), n->cold_start_reason_.c_str());
    }
  }
  auto so = options.server;
  so.listen = options.listen;
  StoreNode* self = n.get();
  TPUSYNC_ASSIGN_OR_RETURN(
      n->server_,
      transport::Server::Start(so, std::move(secret),
                               [self](std::shared_ptr<transport::Link> l) { self->Serve(l); }));
  return n;
}

StoreNode::~StoreNode() {
  Stop();
  server_.reset();  // every handler thread is joined before the store goes away
  store_.reset();
}

void StoreNode::Stop() {
  if (server_) server_->Stop();
}

StoreNodeStats StoreNode::stats() {
  SweepLeases(false);
  const store::StoreStats ks = store_->stats();
  std::lock_guard lock(stats_mu_);
  StoreNodeStats s = stats_;
  for (const auto& t : ks.tiers) {
    if (t.kind == block::Tier::kHost) {
      s.blocks_total = t.tier.capacity_blocks;
      s.blocks_used = t.tier.used_blocks;
    } else if (t.kind == block::Tier::kDisk) {
      s.disk_blocks_total = t.tier.capacity_blocks;
      s.disk_blocks_used = t.tier.used_blocks;
    }
  }
  s.evictions = ks.evicted;
  s.recovered_blocks = recovered_blocks_;
  s.rejected_peers = server_ ? server_->rejected() : 0;
  s.links = server_ ? server_->links() : 0;
  {
    std::lock_guard l2(lease_mu_);
    s.leases_active = 0;
    for (const auto& [k, l] : leases_) s.leases_active += l.count;
  }
  return s;
}

void StoreNode::Serve(const std::shared_ptr<transport::Link>& link) {
  Stream& s = *link->streams[0];
  // The connection's receive / send buffer (REQUEST MEMORY CONTRACT). Shared so a store
  // operation that outlives its wait keeps the memory it writes into.
  auto buf = std::make_shared<Scratch>();
  for (;;) {
    auto f = s.RecvHead(transport::Clock::now() + kIdleLinkTimeout);
    if (!f.ok()) return;  // the peer closed the link, went idle too long or sent a bad header
    SweepLeases(false);
    Status st;
    switch (f->op()) {
      case Op::kStorePut: st = HandlePut(s, *f, buf); break;
      case Op::kStoreGet: st = HandleGet(s, *f, buf); break;
      case Op::kStoreLookup: st = HandleLookup(s, *f); break;
      case Op::kStoreRemove: st = HandleRemove(s, *f); break;
      default:
        transport::LogWarning(StrCat("store node: unexpected ", transport::OpName(f->op()),
                                     " frame from ", s.peer(), "; closing the link"));
        return;
    }
    if (!st.ok() || s.broken()) {
      // The link is out of step (the peer vanished or stalled mid-frame, or the reply failed):
      // nothing of an unfinished put was committed.
      transport::LogWarning(
          StrCat("store node: ", transport::OpName(f->op()), " from ", s.peer(),
                 " ended its link: ", st.ok() ? std::string("the stream broke") : st.ToString()));
      std::lock_guard lock(stats_mu_);
      stats_.requests_failed++;
      return;
    }
    if (buf->size > kKeptRequestBytes) buf = std::make_shared<Scratch>();
  }
}

namespace {
// Waits for a store operation; on timeout the buffer it writes into is handed to the operation
// so that it stays valid until the engine is done with it, and the connection gets a new one.
template <typename Buffer>
Status WaitStore(concurrency::Future f, std::shared_ptr<Buffer>& buf) {
  Status st = f->Wait(std::chrono::milliseconds(kIoTimeoutMs));
  if (st.code() == StatusCode::kTimeout && !f->done()) {
    f->OnComplete([keep = buf](const Status&) {});
    buf = std::make_shared<Buffer>();
  }
  return st;
}
}  // namespace

Status StoreNode::HandlePut(Stream& s, const InFrame& f, std::shared_ptr<Scratch>& buf) {
  const uint64_t id = f.header.request_id;
  const size_t bb = store_->block_bytes();
  MetaReader r(f.meta);
  auto keys = DecodeKeys(r);
  Status bad = keys.ok() ? r.ExpectEnd() : keys.status();
  if (bad.ok() && keys->size() != f.header.num_blocks) {
    bad = Status::InvalidArgument(
        StrCat("put of ", keys->size(), " keys carries ", f.header.num_blocks, " blocks"));
  }
  if (bad.ok() && f.header.block_bytes != bb) {
    bad = Status::InvalidArgument(
        StrCat("put of ", f.header.block_bytes, "-byte blocks to a node of ", bb, "-byte blocks"));
  }
  if (bad.ok() && keys->size() * bb > kMaxNodeRequestBytes) {
    bad = Status::InvalidArgument(StrCat("put of ", keys->size() * bb, " bytes in one request (",
                                         kMaxNodeRequestBytes, " allowed)"));
  }
  if (!bad.ok()) {
    TPUSYNC_RETURN_IF_ERROR(s.SkipBlocks(f, DeadlineInMs(kIoTimeoutMs)));
    return Reply(s, id, bad, {});
  }
  const size_t n = keys->size();
  // Phase 1: receive into the connection's buffer (invisible to readers), checksums verified.
  uint8_t* base = buf->Reserve(n * bb);
  std::vector<uint8_t*> dst;
  for (size_t i = 0; i < n; ++i) dst.push_back(base + i * bb);
  Status got = s.RecvBlocks(f, dst, DeadlineInMs(kIoTimeoutMs));
  if (!got.ok()) {
    std::lock_guard lock(stats_mu_);
    stats_.put_corrupt += (got.code() == StatusCode::kCorrupted);
    if (s.broken()) return got;
    return Reply(s, id, got, {});  // nothing was committed
  }
  // Phase 2: commit through the KVStore (visible only once completely written to a tier).
  std::vector<uint8_t> result(n, static_cast<uint8_t>(PutResult::kStored));
  std::vector<block::Placement> placed;
  std::unordered_set<std::string_view> seen;
  for (size_t i = 0; i < n; ++i) {
    const std::string_view k = (*keys)[i];
    // A key stored before, or an earlier copy of it in this request (same key, same bytes).
    if (!seen.insert(k).second || store_->Lookup({&k, 1}, &placed) == 1) {
      result[i] = static_cast<uint8_t>(PutResult::kExists);
    }
  }
  auto stored = std::make_shared<std::vector<uint8_t>>();
  Status st = WaitStore(store_->Put(*keys, {base, bb, n, {}}, stored), buf);
  size_t new_blocks = 0, exists = 0, no_space = 0;
  for (size_t i = 0; i < n; ++i) {
    const std::string_view k = (*keys)[i];
    // A key the batch's later keys evicted again (a batch beyond the node's unpinned room) is
    // not stored: reported stored, it counted as a replica the node did not hold.
    if (!st.ok() || i >= stored->size() || !(*stored)[i] || store_->Lookup({&k, 1}, &placed) != 1) {
      result[i] = static_cast<uint8_t>(PutResult::kNoSpace);
      ++no_space;
    } else if (result[i] == static_cast<uint8_t>(PutResult::kExists)) {
      ++exists;
    } else {
      ++new_blocks;
    }
  }
  {
    std::lock_guard lock(stats_mu_);
    stats_.puts++;
    stats_.put_blocks += new_blocks;
    stats_.put_exists += exists;
    stats_.put_no_space += no_space;
    stats_.bytes_in += n * bb;
  }
  return Reply(s, id, Status::OK(), result);
}

Status StoreNode::HandleGet(Stream& s, const InFrame& f, std::shared_ptr<Scratch>& buf) {
  const size_t bb = store_->block_bytes();
  MetaReader r(f.meta);
  auto keys = DecodeKeys(r);
  Status bad = keys.ok() ? r.ExpectEnd() : keys.status();
  if (bad.ok() && f.header.num_blocks) bad = Status::InvalidArgument("a get carries no payload");
  if (bad.ok() && keys->size() * bb > kMaxNodeRequestBytes) {
    bad = Status::InvalidArgument(StrCat("get of ", keys->size() * bb, " bytes in one request (",
                                         kMaxNodeRequestBytes, " allowed)"));
  }
  if (!bad.ok()) {
    if (f.header.num_blocks) TPUSYNC_RETURN_IF_ERROR(s.SkipBlocks(f, DeadlineInMs(kIoTimeoutMs)));
    return Reply(s, f.header.request_id, bad, {});
  }
  const size_t n = keys->size();
  // REQUEST MEMORY CONTRACT: the buffer is unfilled; the store writes only the blocks it finds,
  // so a get of missing keys commits none of it.
  uint8_t* base = buf->Reserve(n * bb);
  auto found = std::make_shared<std::vector<uint8_t>>();
  Status st = WaitStore(store_->Get(*keys, {base, bb, n, {}}, found), buf);
  if (!st.ok()) return Reply(s, f.header.request_id, st, {});
  std::vector<const uint8_t*> src;
  std::vector<uint8_t> flags(n, 0);
  {
    std::unordered_set<std::string_view> ended;
    std::lock_guard lock(lease_mu_);
    for (size_t i = 0; i < n; ++i) {
      if (!(*found)[i]) continue;
      flags[i] = 1;
      src.push_back(base + i * bb);
      // READ LEASE: a read ends one lease of each distinct key it read.
      if (ended.insert((*keys)[i]).second) EndLease((*keys)[i]);
    }
  }
  const Status sent = Reply(s, f.header.request_id, Status::OK(), flags, src);
  std::lock_guard lock(stats_mu_);
  stats_.gets++;
  stats_.get_hits += src.size();
  stats_.get_misses += n - src.size();
  stats_.bytes_out += src.size() * bb;
  return sent;
}

void StoreNode::EndLease(const std::string& key) {
  auto it = leases_.find(key);
  if (it == leases_.end()) return;
  const std::string_view k = key;
  (void)store_->Unpin({&k, 1});
  if (--it->second.count == 0) leases_.erase(it);
}

void StoreNode::EndAllLeases(const std::string& key) {
  auto it = leases_.find(key);
  if (it == leases_.end()) return;
  const std::string_view k = key;
  for (uint32_t i = 0; i < it->second.count; ++i) (void)store_->Unpin({&k, 1});
  leases_.erase(it);
}

void StoreNode::SweepLeases(bool force) {
  const auto now = transport::Clock::now();
  std::lock_guard lock(lease_mu_);
  if (!force && now < next_sweep_) return;
  next_sweep_ = now + std::chrono::milliseconds(kLeaseSweepMs);
  uint64_t expired = 0;
  for (auto it = leases_.begin(); it != leases_.end();) {
    if (it->second.expires > now) {
      ++it;
      continue;
    }
    const std::string_view k = it->first;
    for (uint32_t i = 0; i < it->second.count; ++i) (void)store_->Unpin({&k, 1});
    expired += it->second.count;
    it = leases_.erase(it);
  }
  if (expired) {
    std::lock_guard l2(stats_mu_);
    stats_.leases_expired += expired;
  }
}

Status StoreNode::HandleLookup(Stream& s, const InFrame& f) {
  MetaReader r(f.meta);
  auto keys = DecodeKeys(r);
  Status bad = keys.ok() ? Status::OK() : keys.status();
  uint32_t lease_ms = 0;
  const bool unlease = f.header.flags & kUnleaseFlag;
  if (bad.ok() && unlease && (f.header.flags & kLeaseFlag)) {
    bad = Status::InvalidArgument("a lookup cannot both lease and end leases");
  }
  if (bad.ok() && (f.header.flags & kLeaseFlag)) {
    auto ms = r.U32();
    if (!ms.ok()) {
      bad = ms.status();
    } else if (*ms == 0 || *ms > kMaxLeaseMs) {
      bad = Status::InvalidArgument(StrCat("lease of ", *ms, " ms (1..", kMaxLeaseMs, " allowed)"));
    } else {
      lease_ms = *ms;
    }
  }
  if (bad.ok()) bad = r.ExpectEnd();
  if (bad.ok() && f.header.num_blocks) bad = Status::InvalidArgument("a lookup carries no payload");
  if (!bad.ok()) {
    if (f.header.num_blocks) TPUSYNC_RETURN_IF_ERROR(s.SkipBlocks(f, DeadlineInMs(kIoTimeoutMs)));
    return Reply(s, f.header.request_id, bad, {});
  }
  std::vector<uint8_t> found(keys->size(), 0);
  std::vector<block::Placement> placed;
  uint64_t leased = 0, refused = 0;
  {
    std::lock_guard lock(lease_mu_);
    const auto expires = transport::Clock::now() + std::chrono::milliseconds(lease_ms);
    std::unordered_map<std::string_view, size_t> first;  // key -> its first index in the request
    for (size_t i = 0; i < keys->size(); ++i) {
      const std::string_view k = (*keys)[i];
      if (lease_ms == 0 && !unlease) {
        found[i] = store_->Lookup({&k, 1}, &placed) == 1;
        continue;
      }
      if (auto [it, fresh] = first.emplace(k, i); !fresh) {
        found[i] = found[it->second];  // one lease per distinct key of a request
        continue;
      }
      if (unlease) {
        if (leases_.contains((*keys)[i])) {
          EndLease((*keys)[i]);
          found[i] = 1;
        }
        continue;
      }
      // LEASE BOUND: past it a found key is reported found and pins nothing more.
      auto held = leases_.find((*keys)[i]);
      const bool bounded = held == leases_.end() ? leases_.size() >= max_leased_keys_
                                                 : held->second.count >= kMaxLeasesPerKey;
      if (bounded) {
        found[i] = store_->Lookup({&k, 1}, &placed) == 1;
        if (found[i] && held != leases_.end()) {
          held->second.expires = std::max(held->second.expires, expires);
        }
        refused += found[i];
        continue;
      }
      // Pin succeeds only for a stored key: lookup and lease in one step.
      if (!store_->Pin({&k, 1}).ok()) continue;
      found[i] = 1;
      Lease& l = leases_[(*keys)[i]];
      ++l.count;
      l.expires = std::max(l.expires, expires);
      ++leased;
    }
  }
  {
    std::lock_guard lock(stats_mu_);
    stats_.lookups++;
    stats_.leases += leased;
    stats_.leases_refused += refused;
  }
  return Reply(s, f.header.request_id, Status::OK(), found);
}

Status StoreNode::HandleRemove(Stream& s, const InFrame& f) {
  MetaReader r(f.meta);
  auto keys = DecodeKeys(r);
  Status bad = keys.ok() ? r.ExpectEnd() : keys.status();
  if (bad.ok() && f.header.num_blocks) bad = Status::InvalidArgument("a remove carries no payload");
  if (!bad.ok()) {
    if (f.header.num_blocks) TPUSYNC_RETURN_IF_ERROR(s.SkipBlocks(f, DeadlineInMs(kIoTimeoutMs)));
    return Reply(s, f.header.request_id, bad, {});
  }
  std::vector<uint8_t> removed(keys->size(), 0);
  {
    std::lock_guard lock(lease_mu_);
    for (size_t i = 0; i < keys->size(); ++i) {
      EndAllLeases((*keys)[i]);
      const std::string_view k = (*keys)[i];
      auto n = store_->Remove({&k, 1});
      removed[i] = n.ok() && *n == 1;
    }
  }
  {
    std::lock_guard lock(stats_mu_);
    stats_.removes++;
  }
  return Reply(s, f.header.request_id, Status::OK(), removed);
}

}  // namespace tpusync::node
