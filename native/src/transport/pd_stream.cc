#include "tpusync/transport/pd_stream.h"

#include "tpusync/base/checksum.h"
#include "tpusync/base/stream_copy.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <set>
#include <thread>

namespace tpusync::transport {
namespace {
// Target payload bytes per kPdData frame (at least one block per frame). Measured on the 2-core
// reference machine, 2 MiB blocks: 1 MiB (one block per frame) beat 4 MiB by ~1.2x and 16 MiB by
// ~2x - the sender's checksum pass and the kernel's copy then share the block in L2.
constexpr size_t kPdFrameBytes = size_t{1} << 20;

// HASH-AHEAD CONTRACT: when the producer has no origin checksums (CHECKSUM CONTRACT), a stream
// that sends at least kHashAheadMinBytes, on a link narrower than
// PdProducerOptions::hash_ahead_below_streams, gets a hasher thread that computes the checksums
// of the stream's blocks in send order, at most `ahead` blocks beyond the frame being sent, while
// the sender thread writes earlier frames to the socket. The frame carries the same checksums as
// before (no wire change). Why (measured, 2 MiB blocks, 1 stream, cpu-clock profile): hashing a
// block read it cold from DRAM and cost ~4-6x the socket copy of the same, then warm, bytes, and
// the two ran one after the other on the sender thread while the consumer idled. With the
// hasher (same run, 512 MiB, loaded 2-vCPU machine) the sender thread's CPU fell from 0.16-0.18 s
// to 0.11-0.13 s (the hasher took 0.09-0.11 s beside it) and one stream moved 0.56-1.56 GB/s
// instead of 0.63-0.75 GB/s. Wide links already hash on one thread per
// stream, and small pulls keep hashing inline (a thread start would dominate a 16 KiB round
// trip). Rejected alternatives: checksums after the payload (a wire change that keeps the cold
// read on the sender's critical path) and hashing at RegisterSend (every registered byte hashed
// even if never pulled, and the cost only moves).
constexpr size_t kHashAheadMinBytes = size_t{4} << 20;

class HashAhead {
 public:
  HashAhead(std::vector<const uint8_t*> order, uint64_t block_bytes, size_t ahead)
      : order_(std::move(order)), sums_(order_.size()), bb_(block_bytes), ahead_(ahead) {
    thread_ = std::thread([this] { Run(); });
  }
  ~HashAhead() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  HashAhead(const HashAhead&) = delete;
  HashAhead& operator=(const HashAhead&) = delete;

  // The sender is about to send positions [from, upto): lets the hasher run `ahead` past `from`
  // and waits (bounded by `deadline`) until [0, upto) is hashed.
  Result<std::span<const uint64_t>> Take(size_t from, size_t upto, Deadline deadline) {
    std::unique_lock lock(mu_);
    if (from > consumed_) {
      consumed_ = from;
      cv_.notify_all();
    }
    if (!cv_.wait_until(lock, deadline, [&] { return done_ >= upto; })) {
      return Status::Timeout("deadline passed while hashing blocks to send");
    }
    return std::span<const uint64_t>(sums_).subspan(from, upto - from);
  }

 private:
  void Run() {
    for (size_t i = 0; i < order_.size(); ++i) {
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return stop_ || i < consumed_ + ahead_; });
        if (stop_) return;
      }
      const uint64_t sum = Checksum64(order_[i], bb_);  // outside the lock: the slow part
      std::lock_guard lock(mu_);
      sums_[i] = sum;
      done_ = i + 1;
      cv_.notify_all();
    }
  }

  const std::vector<const uint8_t*> order_;
  std::vector<uint64_t> sums_;  // [0, done_) written under mu_, then read-only
  const uint64_t bb_;
  const size_t ahead_;
  std::mutex mu_;
  std::condition_variable cv_;
  size_t done_ = 0, consumed_ = 0;
  bool stop_ = false;
  std::thread thread_;
};
}  // namespace

namespace {

constexpr uint8_t kPullShmOk = 1;
constexpr auto kIdleLinkTimeout = std::chrono::minutes(10);

uint32_t GroupsOf(size_t n, uint32_t bpg) { return static_cast<uint32_t>((n + bpg - 1) / bpg); }

}  // namespace

std::string_view PdStateName(PdState s) {
  switch (s) {
    case PdState::kPending: return "pending";
    case PdState::kDone: return "done";
    case PdState::kFailed: return "failed";
  }
  return "unknown";
}

// ------------------------------------------------------------------------------------- producer

struct PdProducer::Entry {
  uint64_t id = 0;
  std::vector<BlockId> blocks;
  uint32_t bpg = 1;
  Deadline deadline;
  uint64_t bytes = 0;
  std::vector<uint64_t> checksums;  // empty or one per block (CHECKSUM CONTRACT)
  // mu_, SHARED-SEND CONTRACT: the readers the first pull named (0: not pulled yet) and the OK
  // acknowledgements so far; the send is done when they are equal.
  uint32_t readers = 0;
  uint32_t acked = 0;
  // mu_: links whose serving thread is pulling this request over TCP (sending it or waiting for
  // its ack; CANCEL CONTRACT); each is removed by that thread before the link can go away.
  std::set<Link*> sending;
  // RELAY CONTRACT (mu_): a relay's blocks[i] and checksums[i] are valid once opened[i] is set;
  // `ended` is set when the request leaves entries_ (waiting pulls then stop).
  bool relay = false;
  std::vector<uint8_t> opened;
  bool ended = false;
  // The blocks this entry holds a reference on: all of them, or a relay's opened ones.
  std::vector<BlockId> owned() const {
    if (!relay) return blocks;
    std::vector<BlockId> out;
    for (size_t i = 0; i < blocks.size(); ++i) {
      if (opened[i]) out.push_back(blocks[i]);
    }
    return out;
  }
};

Result<std::unique_ptr<PdProducer>> PdProducer::Start(std::shared_ptr<BlockAllocator> pool,
                                                      Secret secret, PdProducerOptions options) {
  if (!pool) return Status::InvalidArgument("PdProducer needs a block pool");
  std::unique_ptr<PdProducer> p(new PdProducer());
  p->pool_ = std::move(pool);
  p->options_ = options;
  const std::string& shm = p->pool_->host_pool().shm_name();
  if (!shm.empty()) {
    p->shm_fd_ = Fd(::open(("/dev/shm/" + shm).c_str(), O_RDONLY | O_CLOEXEC));
    if (!p->shm_fd_.valid()) {
      LogWarning(StrCat("cannot open /dev/shm/", shm, " for same-host peers (", strerror(errno),
                        "): they fall back to the socket path"));
    }
  }
  ServerOptions so = options.server;
  so.listen = options.listen;
  PdProducer* self = p.get();
  TPUSYNC_ASSIGN_OR_RETURN(p->tcp_, Server::Start(so, secret, [self](std::shared_ptr<Link> l) {
                             self->ServeLink(l, false);
                           }));
  if (!options.unix_path.empty()) {
    so.listen = "unix:" + options.unix_path;
    TPUSYNC_ASSIGN_OR_RETURN(p->unix_, Server::Start(so, secret, [self](std::shared_ptr<Link> l) {
                               self->ServeLink(l, true);
                             }));
  }
  p->reaper_ = std::thread([self] { self->ReapLoop(); });
  return p;
}

PdProducer::~PdProducer() { Stop(); }

void PdProducer::Stop() {
  {
    std::lock_guard lock(mu_);
    if (stop_) return;
    stop_ = true;
    cv_.notify_all();
    reap_cv_.notify_all();
  }
  if (tcp_) tcp_->Stop();
  if (unix_) unix_->Stop();
  if (reaper_.joinable()) reaper_.join();
  std::lock_guard lock(mu_);
  std::vector<uint64_t> ids;
  for (auto& [id, e] : entries_) ids.push_back(id);
  for (uint64_t id : ids) Finish(id, Status::Cancelled("producer stopped"));
}

// Shared by RegisterSend and RegisterRelay, which checked the block count: `e` has its blocks
// (a relay's are placeholders).
Status PdProducer::Register(std::shared_ptr<Entry> e, uint32_t blocks_per_group) {
  e->bpg = blocks_per_group == 0 ? static_cast<uint32_t>(e->blocks.size()) : blocks_per_group;
  std::lock_guard lock(mu_);
  if (stop_) return Status::FailedPrecondition("producer stopped");
  if (entries_.count(e->id)) {
    return Status::AlreadyExists(StrCat("request ", e->id, " is already registered"));
  }
  // OWNERSHIP CONTRACT: our own reference (a relay takes it block by block in Open).
  TPUSYNC_RETURN_IF_ERROR(pool_->Retain(e->owned()));
  ended_.erase(e->id);  // ENDED RULE: a registration again is a new request
  entries_[e->id] = e;
  cv_.notify_all();
  return Status::OK();
}

Status PdProducer::RegisterSend(uint64_t request_id, std::vector<BlockId> blocks,
                                uint32_t blocks_per_group, Deadline deadline,
                                std::vector<uint64_t> checksums) {
  if (blocks.empty()) return Status::InvalidArgument("RegisterSend needs at least one block");
  if (blocks.size() > (1u << 24)) {
    return Status::InvalidArgument(StrCat("RegisterSend of ", blocks.size(), " blocks"));
  }
  if (!checksums.empty() && checksums.size() != blocks.size()) {
    return Status::InvalidArgument(StrCat("RegisterSend of ", blocks.size(), " blocks with ",
                                          checksums.size(), " checksums (one per block or none)"));
  }
  auto e = std::make_shared<Entry>();
  e->id = request_id;
  e->deadline = deadline;
  e->blocks = std::move(blocks);
  e->checksums = std::move(checksums);
  return Register(std::move(e), blocks_per_group);
}

Status PdProducer::RegisterRelay(uint64_t request_id, uint32_t num_blocks,
                                 uint32_t blocks_per_group, Deadline deadline) {
  if (num_blocks == 0) return Status::InvalidArgument("RegisterRelay needs at least one block");
  if (num_blocks > (1u << 24)) {
    return Status::InvalidArgument(StrCat("RegisterRelay of ", num_blocks, " blocks"));
  }
  auto e = std::make_shared<Entry>();
  e->id = request_id;
  e->deadline = deadline;
  e->relay = true;
  e->blocks.assign(num_blocks, 0);
  e->checksums.assign(num_blocks, 0);
  e->opened.assign(num_blocks, 0);
  return Register(std::move(e), blocks_per_group);
}

Status PdProducer::Open(uint64_t request_id, uint32_t first, std::span<const BlockId> blocks,
                        std::span<const uint64_t> checksums) {
  if (checksums.size() != blocks.size()) {
    return Status::InvalidArgument(StrCat("Open of relay ", request_id, ": ", blocks.size(),
                                          " blocks with ", checksums.size(),
                                          " checksums (one per block)"));
  }
  std::lock_guard lock(mu_);
  auto it = entries_.find(request_id);
  if (it == entries_.end()) {
    return Status::NotFound(StrCat("relay ", request_id,
                                   " is not live on this producer (never registered, or already "
                                   "acknowledged, expired or cancelled)"));
  }
  Entry& e = *it->second;
  if (!e.relay) {
    return Status::InvalidArgument(
        StrCat("request ", request_id, " was registered with its blocks, not as a relay"));
  }
  if (uint64_t{first} + blocks.size() > e.blocks.size()) {
    return Status::InvalidArgument(StrCat("Open of blocks [", first, ", ", first + blocks.size(),
                                          ") of relay ", request_id, ", which has ",
                                          e.blocks.size()));
  }
  std::vector<BlockId> fresh;
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (!e.opened[first + i]) fresh.push_back(blocks[i]);  // the first copy stays
  }
  TPUSYNC_RETURN_IF_ERROR(pool_->Retain(fresh));  // OWNERSHIP CONTRACT: our own reference
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (e.opened[first + i]) continue;
    e.blocks[first + i] = blocks[i];
    e.checksums[first + i] = checksums[i];
    e.opened[first + i] = 1;
  }
  cv_.notify_all();
  return Status::OK();
}

Status PdProducer::Cancel(uint64_t request_id, Status reason) {
  if (reason.ok()) {
    return Status::InvalidArgument(
        StrCat("Cancel of request ", request_id, " needs a failure reason, not OK"));
  }
  std::lock_guard lock(mu_);
  return CancelLocked(request_id, std::move(reason), "cancel");
}

Status PdProducer::CancelLocked(uint64_t request_id, Status reason, std::string_view verb) {
  auto it = entries_.find(request_id);
  if (it == entries_.end()) {
    return Status::NotFound(StrCat("cannot ", verb, " request ", request_id,
                                   ": it is not live on this producer (never registered, or "
                                   "already acknowledged, expired, cancelled or released)"));
  }
  // CANCEL CONTRACT: shutdown (not close) is safe beside a sender blocked on the socket; the
  // sender fails, releases its borrow and the slots recycle.
  for (Link* l : it->second->sending) l->Close();
  Finish(request_id, std::move(reason));
  return Status::OK();
}

Status PdProducer::ServeRelease(const InFrame& release, const std::string& peer) {
  const uint64_t id = release.header.request_id;
  Status why;
  if (Status parsed = ParseStatus(release.meta, &why); !parsed.ok()) {
    return Status::InvalidArgument(
        StrCat("malformed PdRelease frame for request ", id, ": ", parsed.message()));
  }
  if (why.ok()) {
    return Status::InvalidArgument(
        StrCat("a PdRelease of request ", id, " must carry the consumer's failure reason, not OK"));
  }
  // ABANDON CONTRACT: ends like Cancel, the reason naming the consumer's release.
  std::lock_guard lock(mu_);
  return CancelLocked(
      id, Status(why.code(), StrCat("released by consumer ", peer, ": ", why.message())),
      "release");
}

void PdProducer::Finish(uint64_t request_id, Status reason) {
  auto it = entries_.find(request_id);
  if (it == entries_.end()) return;
  (void)pool_->Free(it->second->owned());  // a borrow of an in-flight send keeps memory valid
  it->second->ended = true;                // RELAY CONTRACT: pulls waiting for blocks stop
  PdStatus st;
  st.request_id = request_id;
  st.state = reason.ok() ? PdState::kDone : PdState::kFailed;
  st.reason = std::move(reason);
  st.bytes = it->second->bytes;
  if (!st.reason.ok()) {  // ENDED RULE
    if (ended_.insert_or_assign(request_id, st.reason).second) ended_order_.push_back(request_id);
    while (ended_order_.size() > kRecentlyEnded) {
      ended_.erase(ended_order_.front());
      ended_order_.pop_front();
    }
  }
  finished_.push_back(std::move(st));
  entries_.erase(it);
  cv_.notify_all();
}

std::vector<PdStatus> PdProducer::Poll() {
  std::lock_guard lock(mu_);
  std::vector<PdStatus> out = std::move(finished_);
  finished_.clear();
  for (auto& [id, e] : entries_) {
    PdStatus st;
    st.request_id = id;
    st.bytes = e->bytes;
    out.push_back(st);
  }
  return out;
}

size_t PdProducer::pending() const {
  std::lock_guard lock(mu_);
  return entries_.size();
}

void PdProducer::ReapLoop() {
  std::unique_lock lock(mu_);
  while (!stop_) {
    reap_cv_.wait_for(lock, std::chrono::milliseconds(20));
    const auto now = Clock::now();
    std::vector<uint64_t> expired;
    for (auto& [id, e] : entries_) {
      if (e->deadline <= now) expired.push_back(id);
    }
    for (uint64_t id : expired) {
      Finish(id, Status::Timeout(
                     StrCat("request ", id, ": deadline passed before the consumer acknowledged")));
    }
  }
}

void PdProducer::ServeLink(const std::shared_ptr<Link>& link, bool is_unix) {
  Stream& s0 = *link->streams[0];
  for (;;) {
    auto f = s0.RecvHead(Clock::now() + kIdleLinkTimeout);
    if (!f.ok()) return;  // peer gone, idle too long or server stopping
    if (f->op() == Op::kPing && f->header.num_blocks == 0) {
      if (!s0.SendMeta(Op::kPong, f->header.request_id, {}, DeadlineInMs(5000)).ok()) return;
      continue;
    }
    if (f->op() == Op::kPdRelease && f->header.num_blocks == 0) {
      // ABANDON CONTRACT: answered on this link, which stays usable (refused ones too).
      const Status verdict = ServeRelease(*f, s0.peer());
      if (!verdict.ok() && verdict.code() != StatusCode::kNotFound) {
        LogWarning(
            StrCat("producer: refused a release from ", s0.peer(), ": ", verdict.ToString()));
      }
      if (!s0.SendMeta(Op::kPdReleased, f->header.request_id, EncodeStatus(verdict),
                       DeadlineInMs(5000))
               .ok()) {
        return;
      }
      continue;
    }
    if (f->op() != Op::kPdPull || f->header.num_blocks != 0) {
      LogWarning(StrCat("producer: unexpected ", OpName(f->op()), " frame from ", s0.peer(),
                        "; closing the link"));
      return;
    }
    if (Status s = ServePull(*link, is_unix, *f); !s.ok()) {
      LogWarning(StrCat("producer: request ", f->header.request_id, " to ", s0.peer(), ": ",
                        s.ToString()));
      if (!link->healthy()) return;
    }
  }
}

Status PdProducer::ServePull(Link& link, bool is_unix, const InFrame& pull) {
  const uint64_t id = pull.header.request_id;
  Stream& s0 = *link.streams[0];
  auto refuse = [&](Status why) -> Status {
    TPUSYNC_RETURN_IF_ERROR(s0.SendMeta(Op::kError, id, EncodeStatus(why), DeadlineInMs(5000)));
    for (size_t i = 1; i < link.streams.size(); ++i) {
      TPUSYNC_RETURN_IF_ERROR(link.streams[i]->SendMeta(Op::kPdEnd, id, {}, DeadlineInMs(5000)));
    }
    // Every pull ends with exactly one PdAck from the consumer, a refused one too.
    auto ack = s0.Expect(Op::kPdAck, DeadlineInMs(5000));
    if (!ack.ok()) return ack.status();
    return why;
  };
  MetaReader r(pull.meta);
  auto n = r.U32();
  auto block_bytes = r.U64();
  auto wait_ms = r.U32();
  auto flags = r.U8();
  if (!n.ok() || !block_bytes.ok() || !wait_ms.ok() || !flags.ok()) {
    return refuse(Status::InvalidArgument("malformed PdPull frame"));
  }
  uint32_t readers = 1;  // SHARED-SEND CONTRACT: present only when above 1
  if (r.remaining() > 0) {
    auto named = r.U32();
    if (!named.ok() || *named < 2) {
      return refuse(Status::InvalidArgument("malformed PdPull frame (readers)"));
    }
    readers = *named;
  }
  if (!r.ExpectEnd().ok()) return refuse(Status::InvalidArgument("malformed PdPull frame"));
  const bool shm_path = (*flags & kPullShmOk) && is_unix && shm_fd_.valid();
  std::shared_ptr<Entry> e;
  Status other_readers;  // SHARED-SEND CONTRACT; refused below, never with mu_ held
  Status ended;          // ENDED RULE
  {
    std::unique_lock lock(mu_);
    const auto wait = std::min<std::chrono::milliseconds>(std::chrono::milliseconds(*wait_ms),
                                                          options_.max_pull_wait);
    cv_.wait_for(lock, wait,
                 [&] { return stop_ || entries_.count(id) > 0 || ended_.count(id) > 0; });
    if (auto it = entries_.find(id); it != entries_.end()) e = it->second;
    if (auto it = ended_.find(id); !e && it != ended_.end()) ended = it->second;
    if (e && e->readers != 0 && e->readers != readers) {
      other_readers = Status::InvalidArgument(
          StrCat("request ", id, ": this pull names ", readers, " reader(s), an earlier one ",
                 e->readers, " (every consumer of a shared send must name the same number)"));
    } else if (e && *n == e->blocks.size() && *block_bytes == pool_->block_bytes()) {
      // The blocks stay owned by us (Retain at RegisterSend); the borrow keeps them valid even
      // if the reaper expires or Cancel ends the request while the bytes are on the wire. Taken
      // under mu_ while the request is registered, so its blocks still have an owner (CANCEL
      // CONTRACT). A relay's blocks are borrowed frame by frame as they open (RELAY CONTRACT).
      if (!e->relay) {
        if (Status b = pool_->AcquireBorrow(e->blocks); !b.ok()) return b;
      }
      if (!shm_path) e->sending.insert(&link);
      e->readers = readers;
    }
  }
  if (!other_readers.ok()) return refuse(other_readers);
  if (!ended.ok()) {
    return refuse(Status(ended.code(), StrCat("request ", id,
                                              " ended on this producer before "
                                              "this pull: ",
                                              ended.message())));
  }
  if (!e) {
    return refuse(Status::NotFound(
        StrCat("request ", id,
               " is not registered on this producer (or its deadline passed); the pull "
               "waited ",
               std::min<uint64_t>(*wait_ms, options_.max_pull_wait.count()),
               " ms for it (at most the producer's max_pull_wait, ", options_.max_pull_wait.count(),
               " ms)")));
  }
  if (*n != e->blocks.size() || *block_bytes != pool_->block_bytes()) {
    return refuse(Status::InvalidArgument(
        StrCat("request ", id, ": the consumer expects ", *n, " blocks of ", *block_bytes,
               " bytes, the producer registered ", e->blocks.size(), " blocks of ",
               pool_->block_bytes(), " bytes")));
  }
  // A TCP pull stays in e->sending until its last byte left (or it failed): Cancel shuts it then.
  struct Unhook {
    PdProducer* self;
    Entry* e;
    Link* link;
    ~Unhook() {
      std::lock_guard lock(self->mu_);
      e->sending.erase(link);
    }
  } unhook{this, e.get(), &link};
  // The borrow this pull holds: all of e->blocks (a plain send, taken above), or a relay's
  // blocks of the frames it reached (`held`).
  bool borrowed_all = !e->relay;
  std::vector<BlockId> held;
  auto let_go = [&] {  // ends the borrow once; no sender thread runs when it is called
    if (borrowed_all) pool_->ReleaseBorrow(e->blocks);
    borrowed_all = false;
    pool_->ReleaseBorrow(held);
    held.clear();
  };
  std::vector<const uint8_t*> addrs(e->blocks.size(), nullptr);
  if (!e->relay) {
    for (size_t i = 0; i < addrs.size(); ++i) {
      addrs[i] = pool_->SlotAddress(BlockAllocator::SlotOf(e->blocks[i]));
    }
  }
  const uint64_t bb = pool_->block_bytes();
  const uint32_t groups = GroupsOf(addrs.size(), e->bpg);
  std::atomic<bool> failed{false};  // a stream of this pull failed (the others stop)
  // RELAY CONTRACT: waits until blocks [lo, hi) are open, then borrows them (under mu_, while the
  // request is still registered: CANCEL CONTRACT) and fills their addresses.
  auto await_open = [&](size_t lo, size_t hi) -> Status {
    if (!e->relay) return Status::OK();
    std::unique_lock lock(mu_);
    auto open = [&] {
      for (size_t i = lo; i < hi; ++i) {
        if (!e->opened[i]) return false;
      }
      return true;
    };
    cv_.wait_until(lock, e->deadline, [&] { return stop_ || e->ended || failed.load() || open(); });
    if (e->ended || stop_) {
      return Status::Cancelled(
          StrCat("relay ", id, " ended before its blocks [", lo, ", ", hi, ") landed here"));
    }
    if (failed.load()) return Status::Cancelled("another stream of the link failed");
    if (!open()) {
      return Status::Timeout(
          StrCat("relay ", id, ": blocks [", lo, ", ", hi, ") did not land here by the deadline"));
    }
    const std::span<const BlockId> ids(e->blocks.data() + lo, hi - lo);
    TPUSYNC_RETURN_IF_ERROR(pool_->AcquireBorrow(ids));
    held.insert(held.end(), ids.begin(), ids.end());
    for (size_t i = lo; i < hi; ++i) {
      addrs[i] = pool_->SlotAddress(BlockAllocator::SlotOf(e->blocks[i]));
    }
    return Status::OK();
  };
  Status sent;
  if (shm_path && !(sent = await_open(0, addrs.size())).ok()) {
    // the relay never filled: nothing offered
  } else if (shm_path) {
    MetaWriter w;
    w.U64(pool_->host_pool().size()).U64(bb).U32(e->bpg).U32(static_cast<uint32_t>(addrs.size()));
    for (const uint8_t* a : addrs) w.U64(static_cast<uint64_t>(a - pool_->host_pool().data()));
    for (uint64_t c : e->checksums) w.U64(c);  // CHECKSUM CONTRACT: after the offsets, or none
    sent = s0.SendMeta(Op::kPdShmOffer, id, w.bytes(), e->deadline);
    if (sent.ok()) sent = SendFd(s0.fd(), shm_fd_.get(), e->deadline);
  } else {
    // PIPELINE CONTRACT: each stream sends its share of every group, groups in order, with no
    // barrier between groups (the consumer counts arrivals per group, so streams may run ahead
    // of each other); one sender thread per extra stream per request, not per group. Frames are
    // capped near kPdFrameBytes so the checksum pass and the socket copy of a frame both hit a
    // warm cache. Rejected alternative: SendStriped per group - it joined every stream after each
    // group, so the slowest stream of each group stalled all the others.
    auto raw = link.raw();
    const size_t k = std::max<size_t>(1, raw.size());
    const size_t per_frame =
        std::clamp<size_t>(kPdFrameBytes / std::max<uint64_t>(bb, 1), 1, kMaxBlocksPerFrame);
    static const size_t kHardwareThreads =
        std::max<size_t>(1, std::thread::hardware_concurrency());  // once: it is a syscall
    const size_t below = options_.hash_ahead_below_streams > 0 ? options_.hash_ahead_below_streams
                                                               : kHardwareThreads;
    // Cheap screen first (a small pull must not pay for building the send order).
    const bool use_hasher =
        e->checksums.empty() && k < below && addrs.size() * bb >= kHashAheadMinBytes;
    auto fail = [&] {  // stops the other streams, also those waiting for relay blocks
      std::lock_guard lock(mu_);
      failed.store(true);
      cv_.notify_all();
    };
    auto send_stream = [&](size_t si) -> Status {
      std::unique_ptr<HashAhead> hasher;  // HASH-AHEAD CONTRACT
      if (use_hasher) {
        std::vector<const uint8_t*> order;
        for (uint32_t g = 0; g < groups; ++g) {
          const size_t first = size_t{g} * e->bpg;
          const size_t count = std::min<size_t>(e->bpg, addrs.size() - first);
          for (size_t b = first + count * si / k; b < first + count * (si + 1) / k; ++b) {
            order.push_back(addrs[b]);
          }
        }
        if (order.size() >= 2 && order.size() * bb >= kHashAheadMinBytes) {
          const size_t ahead = std::max<size_t>(2 * per_frame, kHashAheadMinBytes / bb);
          hasher = std::make_unique<HashAhead>(std::move(order), bb, ahead);
        }
      }
      size_t pos = 0;  // position of the next block in this stream's send order
      for (uint32_t g = 0; g < groups; ++g) {
        const size_t first = size_t{g} * e->bpg;
        const size_t count = std::min<size_t>(e->bpg, addrs.size() - first);
        const size_t lo = first + count * si / k, hi = first + count * (si + 1) / k;
        for (size_t b = lo; b < hi; b += per_frame) {
          if (failed.load(std::memory_order_relaxed)) {
            return Status::Cancelled("another stream of the link failed");
          }
          const size_t c = std::min(per_frame, hi - b);
          if (Status st = await_open(b, b + c); !st.ok()) {
            fail();
            return st;
          }
          MetaWriter w;
          w.U32(g).U32(groups).U32(e->bpg);
          w.U32(static_cast<uint32_t>(b)).U32(static_cast<uint32_t>(c));
          const auto meta = w.Take();
          OutFrame f;
          f.op = Op::kPdData;
          f.request_id = id;
          f.meta = meta;
          f.block_bytes = bb;
          f.blocks = std::span<const uint8_t* const>(addrs).subspan(b, c);
          // One stream: its PdEnd follows at once, so both leave in one segment.
          f.more = k == 1 && g + 1 == groups && b + c >= hi;
          if (!e->checksums.empty()) {
            f.checksums = std::span<const uint64_t>(e->checksums).subspan(b, c);
          } else if (hasher) {
            auto sums = hasher->Take(pos, pos + c, e->deadline);
            if (!sums.ok()) {
              fail();
              return sums.status();
            }
            f.checksums = *sums;
          }
          pos += c;
          if (Status st = raw[si]->Send(f, e->deadline); !st.ok()) {
            fail();
            return st;
          }
        }
      }
      return Status::OK();
    };
    // A stream that gets no block of any group (a pull smaller than the link is wide) needs no
    // sender thread: it only sends its PdEnd below. Every group but the last has bpg blocks, so
    // the first and the last group decide.
    const size_t last_count = addrs.size() - size_t{groups - 1} * e->bpg;
    auto has_data = [&](size_t si) {
      for (size_t count : {size_t{e->bpg}, last_count}) {
        if (count * (si + 1) / k > count * si / k) return true;
      }
      return false;
    };
    std::vector<Status> results(k);
    std::vector<std::thread> senders;
    for (size_t si = 1; si < k; ++si) {
      if (has_data(si)) senders.emplace_back([&, si] { results[si] = send_stream(si); });
    }
    results[0] = send_stream(0);
    for (auto& t : senders) t.join();
    for (auto& r : results) {
      if (!r.ok() && r.code() != StatusCode::kCancelled) {
        sent = r;
        break;
      }
    }
    if (sent.ok()) {
      for (auto& r : results) {
        if (!r.ok()) sent = r;
      }
    }
  }
  for (size_t i = 0; i < link.streams.size() && sent.ok(); ++i) {
    sent = link.streams[i]->SendMeta(Op::kPdEnd, id, {}, e->deadline);
  }
  // TCP: every byte left our blocks. Same-host: the consumer may still be copying out of them,
  // so the borrow lasts until its ack or its socket closes (CANCEL CONTRACT, SAME-HOST HOLD).
  if (!shm_path) let_go();
  if (sent.ok()) {
    // CANCEL CONTRACT: nothing left to stop; the consumer may already have put the link back in
    // its pool with the ack on its way, so a Cancel from now on leaves the link open. Same-host:
    // shutting the link would end the wait below while the consumer still copies.
    std::lock_guard lock(mu_);
    e->sending.erase(&link);
  }
  if (!sent.ok()) {
    let_go();
    // A failure between frames (a relay whose blocks never came, a hasher past the deadline)
    // leaves every stream in step: each gets the reason instead of its PdEnd, so the consumer
    // fails at once with it (not at its own deadline) and the link stays usable. A stream that
    // broke mid-frame leaves the link to be closed by our caller.
    const bool in_step = std::none_of(link.streams.begin(), link.streams.end(),
                                      [](const auto& st) { return st->broken(); });
    if (!in_step) return sent;
    for (auto& st : link.streams) {
      TPUSYNC_RETURN_IF_ERROR(st->SendMeta(Op::kError, id, EncodeStatus(sent), DeadlineInMs(5000)));
    }
    auto ack = s0.Expect(Op::kPdAck, DeadlineInMs(5000));
    if (!ack.ok()) return ack.status();
    return sent;
  }
  {
    std::lock_guard lock(mu_);
    e->bytes += bb * addrs.size();
  }
  // SAME-HOST HOLD: the slots stay borrowed until the consumer acknowledged or its socket closed,
  // past this send's deadline and past a Cancel (which end the registration, not the copy): it
  // reads them straight out of our segment, and a recycled slot would hand it another request's
  // bytes. Before, both let go at once, and a slow consumer published groups of reused bytes.
  auto ack = s0.Expect(Op::kPdAck, shm_path ? DeadlineInMs(3600 * 1000) : e->deadline);
  while (shm_path && !ack.ok() && ack.status().code() == StatusCode::kTimeout && !s0.broken()) {
    ack = s0.Expect(Op::kPdAck, DeadlineInMs(3600 * 1000));
  }
  if (shm_path && !ack.ok()) {
    bool stopping;
    {
      std::lock_guard lock(mu_);
      stopping = stop_;
    }
    if (stopping) {
      // Stop closed the link under a consumer that may still copy: keep its slots out of the
      // pool for good rather than recycle them under it.
      borrowed_all = false;
      held.clear();
      LogWarning(StrCat("producer stopped while a same-host consumer of request ", id,
                        " may still copy: its ", e->blocks.size(),
                        " block(s) stay out of the pool"));
      return ack.status();
    }
  }
  let_go();
  if (!ack.ok()) return ack.status();
  const Status verdict = DecodeStatus(ack->meta);
  std::lock_guard lock(mu_);
  if (verdict.ok()) {
    // Only this registration: after a Cancel (or an expiry) the id may have been registered anew.
    // SHARED-SEND CONTRACT: done after the last reader's OK.
    if (auto it = entries_.find(id);
        it != entries_.end() && it->second == e && ++e->acked >= e->readers) {
      Finish(id, Status::OK());
    }
    return Status::OK();
  }
  // The consumer failed (e.g. a corrupt block): keep the blocks until the deadline for a retry.
  return Status(verdict.code(), "consumer reported: " + verdict.message());
}

// ------------------------------------------------------------------------------------- consumer

struct PdConsumer::Mapping {
  const uint8_t* base = nullptr;
  size_t size = 0;
  Fd fd;  // kept to see whether the segment was removed (MAPPING CACHE)
  ~Mapping() {
    if (base) ::munmap(const_cast<uint8_t*>(base), size);
  }
};

struct PdConsumer::Source {
  Address peer;
  std::vector<BlockId> blocks;
  uint32_t readers = 1;  // SHARED-SEND CONTRACT
  std::vector<uint8_t*> addrs;
  uint32_t groups = 0, bpg = 0;
  std::vector<uint32_t> landed_in_group;
  std::vector<uint8_t> landed;
  std::vector<uint64_t> sums;   // the verified checksum of each block (CHECKSUM CONTRACT)
  std::vector<uint8_t> summed;  // whether sums[i] is known
  uint32_t ready = 0;
  bool shm = false;
  uint32_t offset = 0;  // index of this source's first block in the request (RELAY CONTRACT)
};

struct PdConsumer::Request {
  uint64_t id = 0;
  Deadline deadline;
  std::vector<Source> sources;
  std::vector<BlockId> all_blocks;  // borrowed until the request ends
  PdStatus status;
  size_t running = 0;
  std::set<Link*> links;  // in use, closed on destruction (and by Abandon)
  // ABANDON CONTRACT. `abandoned` is set under mu_ (read without it by the same-host copy loop);
  // `pulling` (mu_) counts sources inside PullFrom, the only code that writes destination
  // blocks; `borrowed` (mu_) says the destination borrow is still held, so it is returned once.
  std::atomic<bool> abandoned{false};
  // FAIL-FAST CONTRACT: set (under mu_) by Abandon and by the first source that fails; read
  // without mu_ like `abandoned`. Once set, no source starts and a running one stops writing:
  // its link is closed and the same-host copy loop checks it between blocks.
  std::atomic<bool> stop{false};
  Status first_failure;  // mu_: the failed source's reason, reported when the last source ended
  size_t pulling = 0;
  bool borrowed = false;
  PdLanded on_landed;  // RELAY CONTRACT: set at Begin, then only read
};

namespace {
ConnectOptions OneStream(ConnectOptions o) {
  o.streams = 1;
  return o;
}
// How long Recv waits past the request deadline for sources on workers to notice it.
constexpr auto kRecvGrace = std::chrono::seconds(2);
}  // namespace

PdConsumer::PdConsumer(std::shared_ptr<BlockAllocator> pool, Secret secret,
                       PdConsumerOptions options)
    : pool_(std::move(pool)),
      small_pull_bytes_(options.connect.streams > 1 ? options.small_pull_bytes : 0),
      links_(secret, options.connect),
      small_links_(std::move(secret), OneStream(options.connect)),
      abandon_timeout_(options.abandon_timeout) {}

Result<std::unique_ptr<PdConsumer>> PdConsumer::Create(std::shared_ptr<BlockAllocator> pool,
                                                       Secret secret, PdConsumerOptions options) {
  if (!pool) return Status::InvalidArgument("PdConsumer needs a block pool");
  if (options.connect.streams == 0 || options.connect.streams > 64) {
    // Checked here too, not only per link: every striped pull would fail with it later.
    return Status::InvalidArgument(
        StrCat("PdConsumer streams must be 1..64, got ", options.connect.streams));
  }
  return std::unique_ptr<PdConsumer>(
      new PdConsumer(std::move(pool), std::move(secret), std::move(options)));
}

PdConsumer::~PdConsumer() {
  {
    std::lock_guard lock(mu_);
    for (auto& [id, r] : requests_) {
      for (Link* l : r->links) l->Close();
    }
  }
  {
    std::lock_guard lock(mu_);
    stopping_ = true;  // workers finish the queued sources, then exit
  }
  work_cv_.notify_all();
  for (auto& w : workers_) w.join();
  links_.Clear();
  small_links_.Clear();
}

void PdConsumer::WorkerLoop() {
  std::unique_lock lock(mu_);
  --spawning_;
  for (;;) {
    ++idle_workers_;
    work_cv_.wait(lock, [this] { return stopping_ || !jobs_.empty(); });
    --idle_workers_;
    if (jobs_.empty()) return;  // stopping, nothing left
    Job job = std::move(jobs_.front());
    jobs_.pop_front();
    lock.unlock();
    RunSource(std::move(job.req), job.index);
    lock.lock();
  }
}

Status PdConsumer::StartRecv(uint64_t request_id, std::vector<PdSource> sources, Deadline deadline,
                             PdLanded on_landed) {
  return Begin(request_id, std::move(sources), deadline, 0, std::move(on_landed)).status();
}

Result<PdStatus> PdConsumer::Recv(uint64_t request_id, std::vector<PdSource> sources,
                                  Deadline deadline) {
  TPUSYNC_ASSIGN_OR_RETURN(auto req, Begin(request_id, std::move(sources), deadline, 1, {}));
  RunSource(req, 0);  // INLINE CONTRACT: the calling thread pulls the first source
  std::unique_lock lock(mu_);
  // Every wait of a source is bounded by the request deadline; the grace covers noticing it.
  if (!cv_.wait_until(lock, deadline + kRecvGrace, [&] {
        return req->running == 0 || (req->abandoned.load() && req->pulling == 0);
      })) {
    return Status::Timeout(StrCat("request ", request_id,
                                  ": a source is still running past the deadline (Poll reports "
                                  "its end)"));
  }
  if (auto it = requests_.find(request_id); it != requests_.end() && it->second == req) {
    requests_.erase(it);  // reported here, not again by Poll
  }
  return req->status;
}

Result<std::shared_ptr<PdConsumer::Request>> PdConsumer::Begin(uint64_t request_id,
                                                               std::vector<PdSource> sources,
                                                               Deadline deadline,
                                                               size_t first_queued,
                                                               PdLanded on_landed) {
  if (sources.empty()) return Status::InvalidArgument("StartRecv needs at least one source");
  auto req = std::make_shared<Request>();
  req->id = request_id;
  req->deadline = deadline;
  req->on_landed = std::move(on_landed);
  req->status.request_id = request_id;
  for (auto& s : sources) {
    if (s.blocks.empty()) return Status::InvalidArgument("a source with no destination blocks");
    if (s.readers == 0) return Status::InvalidArgument("a source with 0 readers (at least 1)");
    Source src;
    src.readers = s.readers;
    src.offset = static_cast<uint32_t>(req->all_blocks.size());
    TPUSYNC_ASSIGN_OR_RETURN(src.peer, ParseAddress(s.peer));
    for (BlockId b : s.blocks) {
      src.addrs.push_back(pool_->SlotAddress(BlockAllocator::SlotOf(b)));
      req->all_blocks.push_back(b);
    }
    src.landed.assign(s.blocks.size(), 0);
    src.sums.assign(s.blocks.size(), 0);
    src.summed.assign(s.blocks.size(), 0);
    src.blocks = std::move(s.blocks);
    req->sources.push_back(std::move(src));
  }
  {
    std::set<BlockId> unique(req->all_blocks.begin(), req->all_blocks.end());
    if (unique.size() != req->all_blocks.size()) {
      return Status::InvalidArgument("a destination block appears twice in one request");
    }
  }
  std::lock_guard lock(mu_);
  if (requests_.count(request_id)) {
    return Status::AlreadyExists(StrCat("request ", request_id, " is already receiving"));
  }
  // DESTINATION CONTRACT: two live receives never write one block (both reported done, one
  // block holding one of them).
  for (BlockId b : req->all_blocks) {
    if (auto it = receiving_.find(b); it != receiving_.end()) {
      return Status::InvalidArgument(StrCat("destination block ", b,
                                            " is already being received by request ", it->second,
                                            " (wait for its end, or abandon it)"));
    }
  }
  // Borrow: the destination memory stays valid until the receive ends, even if freed meanwhile.
  TPUSYNC_RETURN_IF_ERROR(pool_->AcquireBorrow(req->all_blocks));
  req->borrowed = true;
  for (BlockId b : req->all_blocks) receiving_[b] = request_id;
  req->running = req->sources.size();
  requests_[request_id] = req;
  for (size_t i = first_queued; i < req->sources.size(); ++i) jobs_.push_back({req, i});
  if (jobs_.empty()) return req;
  while (jobs_.size() > idle_workers_ + spawning_) {
    workers_.emplace_back([this] { WorkerLoop(); });
    ++spawning_;
  }
  work_cv_.notify_all();
  return req;
}

void PdConsumer::Update(Request& req) {
  uint32_t total = 0, ready = UINT32_MAX;
  bool known = true;
  for (const Source& s : req.sources) {
    if (s.groups == 0) known = false;
    total = std::max(total, s.groups);
    ready = std::min(ready, s.ready);
  }
  req.status.groups_total = known ? total : 0;
  req.status.groups_ready = known ? ready : 0;
  cv_.notify_all();
}

void PdConsumer::RunSource(std::shared_ptr<Request> req, size_t index) {
  Source& src = req->sources[index];
  Status result;
  LinkPool& links =
      small_pull_bytes_ > 0 && src.blocks.size() * pool_->block_bytes() <= small_pull_bytes_
          ? small_links_
          : links_;
  // A queued source of an abandoned request does not even connect (ABANDON CONTRACT).
  auto link = req->stop.load() ? Result<std::unique_ptr<Link>>(Status::Cancelled("stopped"))
                               : links.Acquire(src.peer, req->deadline);
  if (!link.ok()) {
    result = link.status();
  } else {
    Link* raw = link->get();
    bool go = false;
    {
      // Under mu_: either Abandon sees this link (and shuts it) or we see the abandon.
      std::lock_guard lock(mu_);
      go = !req->stop.load();
      if (go) {
        req->links.insert(raw);
        ++req->pulling;
      }
    }
    if (go) {
      result = PullFrom(*req, src, *raw);
      if (raw->healthy()) {
        // Tell the producer: OK lets it free the blocks; a failure keeps them for a retry.
        const Status ack =
            raw->streams[0]->SendMeta(Op::kPdAck, req->id, EncodeStatus(result), req->deadline);
        if (result.ok() && !ack.ok()) result = ack;
      }
      std::lock_guard lock(mu_);
      req->links.erase(raw);
      --req->pulling;  // Update below wakes Abandon
    } else {
      result = Status::Cancelled("stopped");
    }
    links.Release(std::move(*link));
  }
  std::lock_guard lock(mu_);
  if (!result.ok() && req->status.state == PdState::kPending && req->first_failure.ok()) {
    // FAIL-FAST CONTRACT: the request has failed, so its other sources stop writing now (they
    // wrote on into blocks a caller may already reuse, until their own end or the deadline).
    req->first_failure =
        Status(result.code(), StrCat("source ", src.peer.ToString(), ": ", result.message()));
    req->stop.store(true);
    for (Link* l : req->links) l->Close();
  }
  if (--req->running == 0) {
    if (req->status.state == PdState::kPending && !req->first_failure.ok()) {
      // Reported only now, when no source writes any more, and so reported once.
      req->status.state = PdState::kFailed;
      req->status.reason = req->first_failure;
    } else if (req->status.state == PdState::kPending) {
      req->status.state = PdState::kDone;
      bool all = true;
      for (const Source& s : req->sources) {
        all = all && std::all_of(s.summed.begin(), s.summed.end(), [](uint8_t x) { return x; });
      }
      for (const Source& s : req->sources) {
        if (all)
          req->status.checksums.insert(req->status.checksums.end(), s.sums.begin(), s.sums.end());
      }
    }
    ReleaseDestinations(*req);
  }
  Update(*req);
}

void PdConsumer::ReleaseDestinations(Request& req) {
  if (!req.borrowed) return;
  req.borrowed = false;
  pool_->ReleaseBorrow(req.all_blocks);
  for (BlockId b : req.all_blocks) receiving_.erase(b);
}

Result<std::vector<PdRelease>> PdConsumer::Abandon(uint64_t request_id, Status reason) {
  if (reason.ok()) {
    return Status::InvalidArgument(
        StrCat("Abandon of request ", request_id, " needs a failure reason, not OK"));
  }
  std::shared_ptr<Request> req;
  std::vector<Address> peers;
  const Deadline bound = Clock::now() + abandon_timeout_;
  bool stopped = false;
  {
    std::unique_lock lock(mu_);
    auto it = requests_.find(request_id);
    if (it == requests_.end()) {
      return Status::NotFound(StrCat("cannot abandon request ", request_id,
                                     ": it is not receiving here (never started, or its end "
                                     "was already reported)"));
    }
    req = it->second;
    if (req->status.state == PdState::kDone) {
      return Status::FailedPrecondition(
          StrCat("request ", request_id, " already completed; nothing to abandon"));
    }
    if (req->abandoned.load()) {
      return Status::NotFound(StrCat("request ", request_id, " was already abandoned"));
    }
    req->abandoned.store(true);
    req->stop.store(true);
    if (req->status.state == PdState::kPending) {
      req->status.state = PdState::kFailed;
      req->status.reason = reason;
    }
    for (Link* l : req->links) l->Close();  // blocked reads return at once
    for (const Source& src : req->sources) {
      if (std::none_of(peers.begin(), peers.end(),
                       [&](const Address& a) { return a.ToString() == src.peer.ToString(); })) {
        peers.push_back(src.peer);
      }
    }
    // No write after we return: wait (bounded) until no source is inside PullFrom.
    stopped = cv_.wait_until(lock, bound, [&] { return req->pulling == 0; });
    if (stopped) ReleaseDestinations(*req);
    Update(*req);
  }
  // Best-effort, each producer in parallel, every wait bounded (ABANDON CONTRACT).
  const Deadline tell_by = Clock::now() + abandon_timeout_;
  std::vector<PdRelease> out(peers.size());
  std::vector<std::thread> tellers;
  for (size_t i = 0; i < peers.size(); ++i) {
    out[i].peer = peers[i].ToString();
    auto tell = [&, i] { out[i].status = TellProducer(peers[i], request_id, reason, tell_by); };
    if (i + 1 < peers.size()) {
      tellers.emplace_back(tell);
    } else {
      tell();
    }
  }
  for (auto& t : tellers) t.join();
  if (!stopped) {
    return Status::Timeout(StrCat("request ", request_id, ": a source was still writing ",
                                  abandon_timeout_.count(),
                                  " ms after Abandon shut its links; its destination blocks stay "
                                  "borrowed until Poll reports the request ended"));
  }
  return out;
}

Status PdConsumer::TellProducer(const Address& peer, uint64_t request_id, const Status& reason,
                                Deadline deadline) {
  TPUSYNC_ASSIGN_OR_RETURN(auto link, small_links_.Acquire(peer, deadline));
  Status told =
      link->streams[0]->SendMeta(Op::kPdRelease, request_id, EncodeStatus(reason), deadline);
  if (told.ok()) {
    auto reply = link->streams[0]->Expect(Op::kPdReleased, deadline);
    if (!reply.ok()) {
      told = reply.status();
      link->Close();  // a refusal or a stray frame: do not reuse a link that may be out of step
    } else if (reply->header.request_id != request_id) {
      told = Status::Corrupted(StrCat("release reply for request ", reply->header.request_id,
                                      " instead of ", request_id));
      link->Close();
    } else {
      told = DecodeStatus(reply->meta);
    }
  }
  small_links_.Release(std::move(link));  // kept only if healthy
  return told;
}

Result<std::shared_ptr<PdConsumer::Mapping>> PdConsumer::MapSegment(Fd fd) {
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return Status::FromErrno(errno, "fstat(shm segment)");
  const auto key =
      std::make_pair(static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino));
  {
    std::lock_guard lock(mu_);
    if (auto it = mappings_.find(key);
        it != mappings_.end() && it->second->size == size_t(st.st_size)) {
      return it->second;
    }
    // MAPPING CACHE: a segment that was removed (its producer exited) and that no receive uses
    // is unmapped here, at the next new one; before, every restarted producer's whole pool
    // stayed mapped (and its memory in use) for the consumer's lifetime.
    for (auto it = mappings_.begin(); it != mappings_.end();) {
      struct stat now {};
      const bool gone = ::fstat(it->second->fd.get(), &now) != 0 || now.st_nlink == 0;
      it = gone && it->second.use_count() == 1 ? mappings_.erase(it) : std::next(it);
    }
  }
  void* p = ::mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_SHARED | MAP_POPULATE,
                   fd.get(), 0);
  if (p == MAP_FAILED) return Status::FromErrno(errno, "mmap(shm segment)");
  auto m = std::make_shared<Mapping>();
  m->base = static_cast<const uint8_t*>(p);
  m->size = static_cast<size_t>(st.st_size);
  m->fd = std::move(fd);
  std::lock_guard lock(mu_);
  mappings_[key] = m;
  return m;
}

size_t PdConsumer::mapped_segments() const {
  std::lock_guard lock(mu_);
  return mappings_.size();
}

Status PdConsumer::PullFrom(Request& req, Source& src, Link& link) {
  const uint64_t bb = pool_->block_bytes();
  const size_t n = src.blocks.size();
  const auto left =
      std::chrono::duration_cast<std::chrono::milliseconds>(req.deadline - Clock::now());
  MetaWriter w;
  w.U32(static_cast<uint32_t>(n)).U64(bb);
  w.U32(static_cast<uint32_t>(std::clamp<int64_t>(left.count(), 0, INT32_MAX)));
  w.U8(link.peer.is_unix ? kPullShmOk : 0);
  if (src.readers > 1) w.U32(src.readers);  // SHARED-SEND CONTRACT
  TPUSYNC_RETURN_IF_ERROR(link.streams[0]->SendMeta(Op::kPdPull, req.id, w.bytes(), req.deadline));

  // Records that blocks [first, first + count) of group g landed; mu_ NOT held.
  auto land = [&](uint32_t g, uint32_t groups, uint32_t bpg, uint32_t first,
                  uint32_t count) -> Status {
    std::lock_guard lock(mu_);
    if (src.groups == 0) {
      if (bpg == 0 || groups != GroupsOf(n, bpg)) {
        return Status::Corrupted(
            StrCat("producer declares ", groups, " groups of ", bpg, " blocks for ", n, " blocks"));
      }
      src.groups = groups;
      src.bpg = bpg;
      src.landed_in_group.assign(groups, 0);
    }
    if (groups != src.groups || bpg != src.bpg || g >= groups) {
      return Status::Corrupted("producer changed the group layout mid-transfer");
    }
    const uint64_t gfirst = uint64_t{g} * bpg, glast = std::min<uint64_t>(gfirst + bpg, n);
    if (first < gfirst || uint64_t{first} + count > glast) {
      return Status::Corrupted(
          StrCat("blocks [", first, ", ", first + count, ") are outside group ", g));
    }
    for (uint32_t i = first; i < first + count; ++i) {
      if (src.landed[i]) return Status::Corrupted(StrCat("block ", i, " was sent twice"));
      src.landed[i] = 1;
    }
    src.landed_in_group[g] += count;
    while (src.ready < src.groups && src.landed_in_group[src.ready] ==
                                         std::min<uint64_t>(bpg, n - uint64_t{src.ready} * bpg)) {
      src.ready++;
    }
    req.status.bytes += uint64_t{count} * bb;
    Update(req);
    return Status::OK();
  };

  // RELAY CONTRACT: hands landed, verified blocks [first, first + count) of this source on. A
  // block that came without an origin checksum (same-host path without them) is hashed here.
  // Only this source's reading threads write these blocks' sums, each its own, before calling.
  auto hand_on = [&](uint32_t first, uint32_t count) {
    if (!req.on_landed) return;
    std::vector<uint64_t> sums(count);
    for (uint32_t i = 0; i < count; ++i) {
      sums[i] = src.summed[first + i] ? src.sums[first + i] : Checksum64(src.addrs[first + i], bb);
    }
    req.on_landed(src.offset + first, std::span<const BlockId>(src.blocks).subspan(first, count),
                  sums);
  };

  auto read_stream = [&](size_t si) -> Status {
    Stream& st = *link.streams[si];
    Status first_error;
    for (;;) {
      auto f = st.RecvHead(req.deadline);
      if (!f.ok()) return f.status();
      const FrameHeader& h = f->header;
      if (h.request_id != req.id) {
        return Status::Corrupted(StrCat("frame for request ", h.request_id, " during ", req.id));
      }
      switch (f->op()) {
        case Op::kError: {
          Status s = DecodeStatus(f->meta);
          return s.ok() ? Status::Internal("producer sent an Error frame carrying OK") : s;
        }
        case Op::kPdEnd: return first_error;
        case Op::kPdData: {
          MetaReader r(f->meta);
          auto g = r.U32(), groups = r.U32(), bpg = r.U32(), first = r.U32(), count = r.U32();
          if (!g.ok() || !groups.ok() || !bpg.ok() || !first.ok() || !count.ok() ||
              !r.ExpectEnd().ok() || *count != h.num_blocks || h.block_bytes != bb ||
              uint64_t{*first} + *count > n) {
            return Status::Corrupted(StrCat("malformed PdData frame from ", st.peer()));
          }
          std::vector<uint8_t*> dst(src.addrs.begin() + *first,
                                    src.addrs.begin() + *first + *count);
          Status s = st.RecvBlocks(*f, dst, req.deadline);
          if (s.code() == StatusCode::kCorrupted && !st.broken()) {
            if (first_error.ok()) first_error = s;  // in step: keep reading to the end
            continue;
          }
          TPUSYNC_RETURN_IF_ERROR(s);
          if (f->checksums.size() == *count) {  // verified by RecvBlocks
            for (uint32_t i = 0; i < *count; ++i) {
              src.sums[*first + i] = f->checksums[i];
              src.summed[*first + i] = 1;
            }
          }
          TPUSYNC_RETURN_IF_ERROR(land(*g, *groups, *bpg, *first, *count));
          hand_on(*first, *count);
          break;
        }
        case Op::kPdShmOffer: {
          if (si != 0 || !link.peer.is_unix) {
            return Status::Corrupted("shared-memory offer on a non-local stream");
          }
          TPUSYNC_ASSIGN_OR_RETURN(Fd fd, RecvFd(st.fd(), req.deadline));
          MetaReader r(f->meta);
          auto pool_bytes = r.U64(), obb = r.U64();
          auto bpg = r.U32(), count = r.U32();
          // Offsets, then (CHECKSUM CONTRACT) optionally one checksum per block.
          const bool with_sums = r.remaining() == uint64_t{n} * 16;
          if (!pool_bytes.ok() || !obb.ok() || !bpg.ok() || !count.ok() || *obb != bb ||
              *count != n || *bpg == 0 || (r.remaining() != uint64_t{n} * 8 && !with_sums)) {
            return Status::Corrupted("malformed PdShmOffer frame");
          }
          TPUSYNC_ASSIGN_OR_RETURN(auto map, MapSegment(std::move(fd)));
          std::vector<uint64_t> offsets(n);
          for (size_t i = 0; i < n; ++i) {
            offsets[i] = *r.U64();
            if (offsets[i] > map->size || map->size - offsets[i] < bb) {
              return Status::Corrupted(
                  StrCat("shm offset ", offsets[i], " is outside the segment"));
            }
          }
          std::vector<uint64_t> sums(with_sums ? n : 0);
          for (auto& c : sums) c = *r.U64();
          const uint32_t groups = GroupsOf(n, *bpg);
          Status damaged;
          for (uint32_t g = 0; g < groups && damaged.ok(); ++g) {
            const size_t gfirst = size_t{g} * *bpg, glast = std::min<size_t>(gfirst + *bpg, n);
            for (size_t i = gfirst; i < glast; ++i) {
              if (req.stop.load()) return Status::Cancelled("stopped mid-copy");
              if (!with_sums) {
                // Non-temporal stores: a per-block memcpy would first read every destination
                // line (base/stream_copy.h); measured 0.53x of one bulk copy of the same bytes.
                StreamCopy(src.addrs[i], map->base + offsets[i], bb);
              } else if (CopyWithChecksum64(src.addrs[i], map->base + offsets[i], bb) != sums[i]) {
                // Copy and hash in one pass; a mismatch fails the request, the stream stays in
                // step (the producer's PdEnd is still read below, so the link can be reused).
                damaged = Status::Corrupted(
                    StrCat("block ", i, " failed its checksum on the same-host path"));
                break;
              } else {
                std::lock_guard lock(mu_);
                src.sums[i] = sums[i];
                src.summed[i] = 1;
              }
            }
            if (damaged.ok()) {
              TPUSYNC_RETURN_IF_ERROR(land(g, groups, *bpg, static_cast<uint32_t>(gfirst),
                                           static_cast<uint32_t>(glast - gfirst)));
              hand_on(static_cast<uint32_t>(gfirst), static_cast<uint32_t>(glast - gfirst));
            }
          }
          if (!damaged.ok()) {
            if (first_error.ok()) first_error = damaged;
            break;
          }
          std::lock_guard lock(mu_);
          src.shm = true;
          req.status.shm = true;
          break;
        }
        default:
          return Status::Corrupted(
              StrCat("unexpected ", OpName(f->op()), " frame from ", st.peer()));
      }
    }
  };

  // The first reader to fail names the cause (a timeout, say); it closes the link so the other
  // readers stop at once, and their "connection closed" errors are only consequences.
  std::mutex first_mu;
  Status first_failure;
  auto run_reader = [&](size_t i) {
    Status s = read_stream(i);
    if (s.ok()) return;
    {
      std::lock_guard lock(first_mu);
      if (first_failure.ok()) first_failure = s;
    }
    if (link.streams[i]->broken()) link.Close();
  };
  std::vector<std::thread> readers;
  for (size_t i = 1; i < link.streams.size(); ++i) readers.emplace_back(run_reader, i);
  run_reader(0);
  for (auto& t : readers) t.join();
  TPUSYNC_RETURN_IF_ERROR(first_failure);
  std::lock_guard lock(mu_);
  if (std::count(src.landed.begin(), src.landed.end(), 1) != static_cast<ptrdiff_t>(n)) {
    return Status::Corrupted("producer ended the transfer before sending every block");
  }
  return Status::OK();
}

std::vector<PdStatus> PdConsumer::Poll() {
  std::lock_guard lock(mu_);
  std::vector<PdStatus> out;
  for (auto it = requests_.begin(); it != requests_.end();) {
    out.push_back(it->second->status);
    const Request& r = *it->second;
    if (r.status.state != PdState::kPending && (r.running == 0 || r.abandoned.load())) {
      it = requests_.erase(it);
    } else {
      ++it;
    }
  }
  return out;
}

Result<PdStatus> PdConsumer::Wait(uint64_t request_id, uint32_t groups, Deadline deadline) {
  std::unique_lock lock(mu_);
  auto it = requests_.find(request_id);
  if (it == requests_.end()) {
    return Status::NotFound(StrCat("request ", request_id, " is not receiving (or was polled)"));
  }
  auto req = it->second;
  const bool ended = cv_.wait_until(lock, deadline, [&] {
    return req->running == 0 || (req->abandoned.load() && req->pulling == 0) ||
           (req->status.groups_total > 0 && req->status.groups_ready >= groups);
  });
  if (!ended) {
    if (groups == UINT32_MAX) {  // the whole request
      return Status::Timeout(StrCat("request ", request_id, " did not end by the deadline (",
                                    req->status.groups_ready, " of ", req->status.groups_total,
                                    " groups ready)"));
    }
    return Status::Timeout(StrCat("request ", request_id, ": ", req->status.groups_ready, " of ",
                                  groups, " groups ready at the deadline"));
  }
  return req->status;
}

}  // namespace tpusync::transport
