#include "tpusync/node/store_node.h"

#include <algorithm>

namespace tpusync::node {

using transport::DeadlineInMs;
using transport::EncodeStatus;
using transport::InFrame;
using transport::MetaReader;
using transport::MetaWriter;
using transport::Op;
using transport::Stream;

namespace {
constexpr int64_t kIoTimeoutMs = 30000;
constexpr auto kIdleLinkTimeout = std::chrono::minutes(10);

Status Reply(Stream& s, uint64_t id, const Status& st, const std::vector<uint8_t>& per_key,
             const std::vector<const uint8_t*>& blocks = {}, uint64_t block_bytes = 0) {
  MetaWriter w;
  const auto head = EncodeStatus(st);
  w.Bytes(head).U32(static_cast<uint32_t>(per_key.size())).Bytes(per_key);
  transport::OutFrame f;
  f.op = Op::kStoreReply;
  f.request_id = id;
  const auto meta = w.Take();
  f.meta = meta;
  f.blocks = blocks;
  f.block_bytes = blocks.empty() ? 0 : block_bytes;
  return s.Send(f, DeadlineInMs(kIoTimeoutMs));
}
}  // namespace

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
    TPUSYNC_ASSIGN_OR_RETURN(std::string k, r.Str(block::kMaxKeyBytes));
    TPUSYNC_RETURN_IF_ERROR(block::ValidateKey(k));
    keys.push_back(std::move(k));
  }
  return keys;
}

Result<std::unique_ptr<StoreNode>> StoreNode::Start(StoreNodeOptions options, Secret secret) {
  if (options.block_bytes == 0 || options.capacity_bytes < options.block_bytes) {
    return Status::InvalidArgument(StrCat("capacity ", options.capacity_bytes,
                                          " bytes cannot hold one block of ", options.block_bytes));
  }
  std::unique_ptr<StoreNode> n(new StoreNode());
  memory::HostPoolOptions po;
  const size_t blocks = options.capacity_bytes / BlockAllocator::StrideFor(options.block_bytes);
  po.size_bytes = BlockAllocator::StrideFor(options.block_bytes) * blocks;
  TPUSYNC_ASSIGN_OR_RETURN(auto host, memory::HostPool::Create(po));
  TPUSYNC_ASSIGN_OR_RETURN(n->pool_, BlockAllocator::Create(std::move(host), options.block_bytes));
  n->stats_.blocks_total = blocks;
  auto so = options.server;
  so.listen = options.listen;
  StoreNode* self = n.get();
  TPUSYNC_ASSIGN_OR_RETURN(
      n->server_,
      transport::Server::Start(so, std::move(secret),
                               [self](std::shared_ptr<transport::Link> l) { self->Serve(l); }));
  return n;
}

StoreNode::~StoreNode() { Stop(); }

void StoreNode::Stop() {
  if (server_) server_->Stop();
}

StoreNodeStats StoreNode::stats() const {
  std::lock_guard lock(stats_mu_);
  StoreNodeStats s = stats_;
  s.blocks_used = pool_->num_blocks() - pool_->num_free();
  s.rejected_peers = server_ ? server_->rejected() : 0;
  s.links = server_ ? server_->links() : 0;
  return s;
}

void StoreNode::Serve(const std::shared_ptr<transport::Link>& link) {
  Stream& s = *link->streams[0];
  for (;;) {
    auto f = s.RecvHead(transport::Clock::now() + kIdleLinkTimeout);
    if (!f.ok()) return;
    Status st;
    switch (f->op()) {
      case Op::kStorePut: st = HandlePut(s, *f); break;
      case Op::kStoreGet: st = HandleGet(s, *f); break;
      case Op::kStoreLookup: st = HandleLookup(s, *f); break;
      case Op::kStoreRemove: st = HandleRemove(s, *f); break;
      default:
        transport::LogWarning(StrCat("store node: unexpected ", transport::OpName(f->op()),
                                     " frame from ", s.peer(), "; closing the link"));
        return;
    }
    if (!st.ok() || s.broken()) return;  // reply failed: the link is out of step
  }
}

Result<std::vector<BlockId>> StoreNode::Reserve(size_t n) {
  auto ids = pool_->Alloc(n);
  if (ids.ok()) return ids;
  const size_t short_by = n - std::min(n, pool_->num_free());
  size_t evicted = 0;
  for (const auto& v : index_.EvictionCandidates(block::Tier::kHost, short_by)) {
    auto loc = index_.Remove(v.key, block::Tier::kHost);
    if (loc.ok()) {
      (void)pool_->Free({&*loc, 1});
      evicted++;
    }
  }
  {
    std::lock_guard lock(stats_mu_);
    stats_.evictions += evicted;
  }
  return pool_->Alloc(n);
}

Status StoreNode::HandlePut(Stream& s, const InFrame& f) {
  const uint64_t id = f.header.request_id;
  MetaReader r(f.meta);
  auto keys = DecodeKeys(r);
  Status bad = keys.ok() ? r.ExpectEnd() : keys.status();
  if (bad.ok() && keys->size() != f.header.num_blocks) {
    bad = Status::InvalidArgument(
        StrCat("put of ", keys->size(), " keys carries ", f.header.num_blocks, " blocks"));
  }
  if (bad.ok() && f.header.block_bytes != pool_->block_bytes()) {
    bad = Status::InvalidArgument(StrCat("put of ", f.header.block_bytes,
                                         "-byte blocks to a node of ", pool_->block_bytes(),
                                         "-byte blocks"));
  }
  if (!bad.ok()) {
    TPUSYNC_RETURN_IF_ERROR(s.SkipBlocks(f, DeadlineInMs(kIoTimeoutMs)));
    return Reply(s, id, bad, {});
  }
  const size_t n = keys->size();
  // Phase 1: reserve (invisible to readers) and receive straight into the reserved blocks.
  Result<std::vector<BlockId>> ids = Status::Internal("unset");
  {
    std::lock_guard lock(mu_);
    ids = Reserve(n);
  }
  if (!ids.ok()) {
    TPUSYNC_RETURN_IF_ERROR(s.SkipBlocks(f, DeadlineInMs(kIoTimeoutMs)));
    {
      std::lock_guard lock(stats_mu_);
      stats_.put_no_space += n;
    }
    return Reply(s, id, Status::OK(),
                 std::vector<uint8_t>(n, static_cast<uint8_t>(PutResult::kNoSpace)));
  }
  std::vector<uint8_t*> dst;
  for (BlockId b : *ids) dst.push_back(pool_->SlotAddress(BlockAllocator::SlotOf(b)));
  Status got = s.RecvBlocks(f, dst, DeadlineInMs(kIoTimeoutMs));
  if (!got.ok()) {
    (void)pool_->Free(*ids);  // nothing was committed
    std::lock_guard lock(stats_mu_);
    stats_.put_corrupt += (got.code() == StatusCode::kCorrupted);
    if (s.broken()) return got;
    return Reply(s, id, got, {});
  }
  // Phase 2: commit. First committed writer wins.
  std::vector<uint8_t> result(n, static_cast<uint8_t>(PutResult::kStored));
  std::vector<BlockId> dup;
  {
    std::lock_guard lock(mu_);
    for (size_t i = 0; i < n; ++i) {
      if (!index_.Insert((*keys)[i], block::Tier::kHost, (*ids)[i]).ok()) {
        result[i] = static_cast<uint8_t>(PutResult::kExists);
        dup.push_back((*ids)[i]);
      }
    }
  }
  if (!dup.empty()) (void)pool_->Free(dup);
  {
    std::lock_guard lock(stats_mu_);
    stats_.puts++;
    stats_.put_blocks += n - dup.size();
    stats_.put_exists += dup.size();
    stats_.bytes_in += n * pool_->block_bytes();
  }
  return Reply(s, id, Status::OK(), result);
}

Status StoreNode::HandleGet(Stream& s, const InFrame& f) {
  MetaReader r(f.meta);
  auto keys = DecodeKeys(r);
  if (!keys.ok() || f.header.num_blocks) {
    if (f.header.num_blocks) TPUSYNC_RETURN_IF_ERROR(s.SkipBlocks(f, DeadlineInMs(kIoTimeoutMs)));
    return Reply(s, f.header.request_id,
                 keys.ok() ? Status::InvalidArgument("a get carries no payload") : keys.status(),
                 {});
  }
  std::vector<uint8_t> found(keys->size(), 0);
  std::vector<BlockId> leased;
  {
    // READ LEASE: look up and borrow under the lock; send without it.
    std::lock_guard lock(mu_);
    for (size_t i = 0; i < keys->size(); ++i) {
      auto p = index_.Lookup((*keys)[i]);
      if (!p || !p->in(block::Tier::kHost)) continue;
      const BlockId b = p->location[static_cast<size_t>(block::Tier::kHost)];
      if (pool_->AcquireBorrow({&b, 1}).ok()) {
        found[i] = 1;
        leased.push_back(b);
      }
    }
  }
  std::vector<const uint8_t*> src;
  for (BlockId b : leased) src.push_back(pool_->SlotAddress(BlockAllocator::SlotOf(b)));
  const Status sent = Reply(s, f.header.request_id, Status::OK(), found, src, pool_->block_bytes());
  pool_->ReleaseBorrow(leased);
  std::lock_guard lock(stats_mu_);
  stats_.gets++;
  stats_.get_hits += leased.size();
  stats_.get_misses += keys->size() - leased.size();
  stats_.bytes_out += leased.size() * pool_->block_bytes();
  return sent;
}

Status StoreNode::HandleLookup(Stream& s, const InFrame& f) {
  MetaReader r(f.meta);
  auto keys = DecodeKeys(r);
  if (!keys.ok() || f.header.num_blocks) {
    if (f.header.num_blocks) TPUSYNC_RETURN_IF_ERROR(s.SkipBlocks(f, DeadlineInMs(kIoTimeoutMs)));
    return Reply(s, f.header.request_id,
                 keys.ok() ? Status::InvalidArgument("a lookup carries no payload") : keys.status(),
                 {});
  }
  std::vector<uint8_t> found(keys->size(), 0);
  {
    std::lock_guard lock(mu_);
    for (size_t i = 0; i < keys->size(); ++i) found[i] = index_.Lookup((*keys)[i]).has_value();
  }
  {
    std::lock_guard lock(stats_mu_);
    stats_.lookups++;
  }
  return Reply(s, f.header.request_id, Status::OK(), found);
}

Status StoreNode::HandleRemove(Stream& s, const InFrame& f) {
  MetaReader r(f.meta);
  auto keys = DecodeKeys(r);
  if (!keys.ok() || f.header.num_blocks) {
    if (f.header.num_blocks) TPUSYNC_RETURN_IF_ERROR(s.SkipBlocks(f, DeadlineInMs(kIoTimeoutMs)));
    return Reply(s, f.header.request_id,
                 keys.ok() ? Status::InvalidArgument("a remove carries no payload") : keys.status(),
                 {});
  }
  std::vector<uint8_t> removed(keys->size(), 0);
  {
    std::lock_guard lock(mu_);
    for (size_t i = 0; i < keys->size(); ++i) {
      auto loc = index_.Remove((*keys)[i], block::Tier::kHost);
      if (loc.ok()) {
        (void)pool_->Free({&*loc, 1});  // a leased get keeps the memory until it is sent
        removed[i] = 1;
      }
    }
  }
  {
    std::lock_guard lock(stats_mu_);
    stats_.removes++;
  }
  return Reply(s, f.header.request_id, Status::OK(), removed);
}

}  // namespace tpusync::node
