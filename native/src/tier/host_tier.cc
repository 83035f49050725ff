#include "tpusync/tier/host_tier.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>

#include "tpusync/base/checksum.h"
#include "tpusync/base/stream_copy.h"
#include "tpusync/memory/shm_reclaim.h"

namespace tpusync::tier {
namespace {

uint64_t NowNs() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

void FillRegion(HostRegionHeader* r, const HostTierOptions& o, size_t meta_bytes, uint64_t fp) {
  std::memset(r, 0, sizeof(*r));
  r->magic = kHostRegionMagic;
  r->version = kHostRegionVersion;
  r->block_bytes = o.block_bytes;
  r->num_blocks = o.num_blocks;
  r->meta_bytes = meta_bytes;
  r->fingerprint = fp;
  std::snprintf(r->fingerprint_text, sizeof(r->fingerprint_text), "%s", o.fingerprint.c_str());
  r->header_checksum = Checksum64(r, offsetof(HostRegionHeader, header_checksum));
}

// Why an existing region cannot be reused, or "" when it can.
std::string Mismatch(const HostRegionHeader& have, const HostRegionHeader& want) {
  if (have.magic != kHostRegionMagic ||
      have.header_checksum != Checksum64(&have, offsetof(HostRegionHeader, header_checksum))) {
    return "no valid tpusync region header";
  }
  if (have.version != want.version) return StrCat("region version ", have.version);
  if (have.block_bytes != want.block_bytes || have.num_blocks != want.num_blocks) {
    return StrCat("layout changed (", have.num_blocks, " x ", have.block_bytes, " bytes -> ",
                  want.num_blocks, " x ", want.block_bytes, ")");
  }
  if (have.fingerprint != want.fingerprint) {
    std::string old(have.fingerprint_text, strnlen(have.fingerprint_text, 96));
    return StrCat("model fingerprint changed ('", old, "' -> '", want.fingerprint_text, "')");
  }
  return "";
}

}  // namespace

size_t HostTier::MetaBytes(size_t num_blocks) {
  return 4096 + (num_blocks * sizeof(SlotHeader) + 4095) / 4096 * 4096;
}

Result<std::unique_ptr<HostTier>> HostTier::Open(const HostTierOptions& o) {
  if (o.block_bytes == 0 || o.num_blocks == 0) {
    return Status::InvalidArgument("host tier needs block_bytes > 0 and num_blocks > 0");
  }
  std::unique_ptr<HostTier> t(new HostTier());
  t->fingerprint_ = Checksum64(o.fingerprint.data(), o.fingerprint.size());
  const size_t meta = MetaBytes(o.num_blocks);
  memory::HostPoolOptions po;
  po.size_bytes = meta + memory::BlockAllocator::StrideFor(o.block_bytes) * o.num_blocks;
  po.shm_name = o.shm_name;
  po.persist = !o.shm_name.empty();
  po.prefault = o.prefault;
  po.huge_pages = o.huge_pages;
  if (!o.shm_name.empty() && !memory::ValidShmName(o.shm_name)) {
    // Checked before the lock file is made: a bad name leaves nothing behind in /dev/shm.
    return Status::InvalidArgument(StrCat("invalid host tier namespace: segment name '", o.shm_name,
                                          "': use letters, digits, '-', '_' and '.'"));
  }
  if (!o.shm_name.empty()) {
    // LOCK CONTRACT: one process per namespace. flock dies with the process (SIGKILL included),
    // so a replacement never has to clean up a stale lock.
    const std::string lock_path = "/dev/shm/" + o.shm_name + ".lock";
    t->lock_fd_ = open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (t->lock_fd_ < 0) return Status::FromErrno(errno, StrCat("open ", lock_path));
    if (flock(t->lock_fd_, LOCK_EX | LOCK_NB) != 0) {
      return Status::FailedPrecondition(StrCat("host tier namespace /dev/shm/", o.shm_name,
                                               " is in use by another process, or by another "
                                               "store of this one (",
                                               lock_path, " is locked)"));
    }
    struct stat st {};
    const std::string seg = "/dev/shm/" + o.shm_name;
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    const size_t want = (po.size_bytes + page - 1) / page * page;
    if (stat(seg.c_str(), &st) == 0 && static_cast<size_t>(st.st_size) != want) {
      t->cold_start_reason_ = StrCat("segment size changed (", st.st_size, " -> ", want, " bytes)");
      unlink(seg.c_str());
    }
  }
  TPUSYNC_ASSIGN_OR_RETURN(auto pool, memory::HostPool::Create(po));
  const bool attached = pool->attached();
  auto* region = reinterpret_cast<HostRegionHeader*>(pool->data());
  TPUSYNC_ASSIGN_OR_RETURN(auto alloc, memory::BlockAllocator::Create(
                                           std::move(pool), o.block_bytes, meta, o.num_blocks));
  t->blocks_ = std::move(alloc);
  t->shm_name_ = o.shm_name;
  t->headers_ = reinterpret_cast<SlotHeader*>(reinterpret_cast<uint8_t*>(region) + 4096);
  HostRegionHeader want;
  FillRegion(&want, o, meta, t->fingerprint_);
  if (attached) {
    const std::string why = Mismatch(*region, want);
    if (why.empty()) {
      t->Recover(want);
    } else {
      t->cold_start_reason_ = why;
    }
  }
  if (!t->cold_start_reason_.empty()) {
    std::fprintf(stderr,
                 "tpusync: host tier /dev/shm/%s: %s: cold start, cached blocks discarded\n",
                 o.shm_name.c_str(), t->cold_start_reason_.c_str());
  }
  if (!attached || !t->cold_start_reason_.empty()) {
    std::memset(t->headers_, 0, meta - 4096);
    std::memcpy(region, &want, sizeof(want));
  }
  return t;
}

void HostTier::Recover(const HostRegionHeader& want) {
  const size_t n = blocks_->num_blocks();
  const size_t bytes = blocks_->block_bytes();
  for (size_t i = 0; i < n; ++i) {
    SlotHeader& h = headers_[i];
    const Status s = CheckSlotHeader(h, bytes, fingerprint_);
    if (s.code() == StatusCode::kNotFound) continue;
    const uint8_t* payload = blocks_->SlotAddress(static_cast<uint32_t>(i));
    if (!s.ok() || Checksum64(payload, bytes) != h.checksum) {
      ++corrupted_;
      std::memset(&h, 0, sizeof(h));
      continue;
    }
    auto id = blocks_->Claim(static_cast<uint32_t>(i));
    if (!id.ok()) continue;
    recovered_.push_back({std::string(SlotKey(h)), *id, h.sequence});
  }
  recovered_count_ = recovered_.size();
}

HostTier::~HostTier() {
  if (lock_fd_ >= 0) close(lock_fd_);  // releases the flock
}

SlotHeader* HostTier::Header(uint64_t location) const {
  return headers_ + memory::BlockAllocator::SlotOf(location);
}

Result<uint64_t> HostTier::Reserve() {
  TPUSYNC_ASSIGN_OR_RETURN(auto ids, blocks_->Alloc(1));
  return ids[0];
}

void HostTier::Release(uint64_t location, bool forget) {
  if (!blocks_->RefCount(location).ok()) return;
  // Always invalidated: a freed DRAM slot must not be re-attached as a block after a restart.
  SlotHeader* h = Header(location);
  h->flags = 0;
  h->magic = 0;
  std::atomic_thread_fence(std::memory_order_release);
  (void)blocks_->Free({&location, 1});
}

Status HostTier::Hold(uint64_t location) { return blocks_->AcquireBorrow({&location, 1}); }
void HostTier::Unhold(uint64_t location) { blocks_->ReleaseBorrow({&location, 1}); }

const uint8_t* HostTier::Address(uint64_t location) const {
  return blocks_->SlotAddress(memory::BlockAllocator::SlotOf(location));
}

void HostTier::WriteBatch(std::span<BlockWrite> ops) {
  const uint64_t t0 = NowNs();
  const size_t bytes = blocks_->block_bytes();
  size_t ok = 0;
  for (BlockWrite& op : ops) {
    auto addr = blocks_->Address(op.location);
    if (!addr.ok()) {
      op.status = addr.status();
      continue;
    }
    SlotHeader* h = Header(op.location);
    // Invalidate first: a crash while the payload changes leaves an empty slot, not a stale one.
    h->flags = 0;
    h->magic = 0;
    std::atomic_thread_fence(std::memory_order_release);
    // CHECKSUM CONTRACT (base/checksum.h): only a slot that outlives the process (/dev/shm) needs
    // its payload hash, for the re-attach check. An anonymous slot is never read back from outside
    // this process, and a demotion to disk hashes the block itself, so it is copied unhashed
    // (its header carries checksum 0). Rejected: hashing every DRAM block (a third of put time).
    uint64_t sum = 0;
    if (shm_name_.empty() && !op.expect_checksum) {
      StreamCopy(*addr, op.data, bytes);
    } else {
      sum = CopyWithChecksum64(*addr, op.data, bytes);
    }
    if (op.expect_checksum && sum != *op.expect_checksum) {
      // The source changed after it was verified (BlockWrite::expect_checksum): the slot stays
      // invalidated, so nothing indexes or re-attaches these bytes.
      op.status = Status::Corrupted("block bytes changed between their verification and the copy");
      continue;
    }
    SlotHeader fresh;
    FillSlotHeader(&fresh, op.key, bytes, sum, op.sequence, fingerprint_);
    std::atomic_thread_fence(std::memory_order_release);
    std::memcpy(h, &fresh, sizeof(fresh));
    op.status = Status::OK();
    ++ok;
  }
  blocks_written_ += ok;
  write_ns_ += NowNs() - t0;
}

void HostTier::ReadBatch(std::span<BlockRead> ops) {
  const uint64_t t0 = NowNs();
  const size_t bytes = blocks_->block_bytes();
  size_t ok = 0;
  for (BlockRead& op : ops) {
    if (memory::BlockAllocator::SlotOf(op.location) >= blocks_->num_blocks()) {
      op.status = Status::InvalidArgument("host tier location out of range");
      continue;
    }
    StreamCopy(op.dst, Address(op.location), bytes);  // non-temporal for large blocks
    op.status = Status::OK();
    ++ok;
  }
  blocks_read_ += ok;
  read_ns_ += NowNs() - t0;
}

std::vector<RecoveredBlock> HostTier::TakeRecovered() { return std::move(recovered_); }

TierStats HostTier::stats() const {
  TierStats s;
  s.capacity_blocks = capacity();
  s.used_blocks = used();
  s.blocks_written = blocks_written_;
  s.blocks_read = blocks_read_;
  s.bytes_written = s.blocks_written * block_bytes();
  s.bytes_read = s.blocks_read * block_bytes();
  s.corrupted = corrupted_;
  s.recovered = recovered_count_;
  s.write_ns = write_ns_;
  s.read_ns = read_ns_;
  s.cold_start_reason = cold_start_reason_;
  const memory::HostPool& pool = blocks_->host_pool();
  s.huge_pages = pool.collapsing() ? "collapsing" : pool.huge_pages_active() ? "on" : "off";
  return s;
}

}  // namespace tpusync::tier
