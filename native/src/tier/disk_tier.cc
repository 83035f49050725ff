#include "tpusync/tier/disk_tier.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <unordered_map>

#include "tpusync/base/checksum.h"
#include "tpusync/tier/disk_journal.h"
#include "tpusync/tier/disk_manifest.h"

namespace tpusync::tier {
namespace {

namespace fs = std::filesystem;

constexpr size_t kAlign = 4096;
size_t RoundUp(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

uint64_t NowNs() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

struct FreeDeleter {
  void operator()(uint8_t* p) const { std::free(p); }
};
using AlignedBuf = std::unique_ptr<uint8_t, FreeDeleter>;
AlignedBuf Aligned(size_t bytes) {
  return AlignedBuf(static_cast<uint8_t*>(std::aligned_alloc(kAlign, RoundUp(bytes))));
}

bool IsAligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % kAlign == 0; }

void FillMeta(DiskMeta* m, const DiskTierOptions& o, size_t slot_bytes, size_t segment_blocks,
              uint64_t fp) {
  std::memset(m, 0, sizeof(*m));
  m->magic = kDiskMetaMagic;
  m->version = kDiskMetaVersion;
  m->block_bytes = o.block_bytes;
  m->slot_bytes = slot_bytes;
  m->segment_blocks = segment_blocks;
  m->num_blocks = o.num_blocks;
  m->fingerprint = fp;
  std::snprintf(m->fingerprint_text, sizeof(m->fingerprint_text), "%s", o.fingerprint.c_str());
  m->header_checksum = Checksum64(m, offsetof(DiskMeta, header_checksum));
}

std::string MetaMismatch(const DiskMeta& have, const DiskMeta& want) {
  if (have.magic != kDiskMetaMagic ||
      have.header_checksum != Checksum64(&have, offsetof(DiskMeta, header_checksum))) {
    return "tier.meta is not a valid tpusync disk tier header";
  }
  if (have.version != want.version) return StrCat("on-disk format version ", have.version);
  if (have.block_bytes != want.block_bytes || have.slot_bytes != want.slot_bytes ||
      have.segment_blocks != want.segment_blocks || have.num_blocks != want.num_blocks) {
    return StrCat("layout changed (", have.num_blocks, " x ", have.block_bytes, " bytes in ",
                  have.segment_blocks, "-slot segments -> ", want.num_blocks, " x ",
                  want.block_bytes, " in ", want.segment_blocks, ")");
  }
  if (have.fingerprint != want.fingerprint) {
    std::string old(have.fingerprint_text, strnlen(have.fingerprint_text, 96));
    return StrCat("model fingerprint changed ('", old, "' -> '", want.fingerprint_text, "')");
  }
  return "";
}

Status WriteFileAtomic(const fs::path& path, const void* data, size_t bytes) {
  const fs::path tmp = path.string() + ".tmp";
  const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Status::FromErrno(errno, StrCat("create ", tmp.string()));
  const ssize_t n = write(fd, data, bytes);
  const int err = errno;
  const bool synced = fsync(fd) == 0;
  close(fd);
  if (n != static_cast<ssize_t>(bytes) || !synced) {
    return Status::FromErrno(n < 0 || !synced ? err : ENOSPC, StrCat("write ", tmp.string()));
  }
  if (rename(tmp.c_str(), path.c_str()) != 0) {
    return Status::FromErrno(errno, StrCat("rename ", tmp.string()));
  }
  return Status::OK();
}

Status ErrnoStatus(int64_t result, size_t expected, bool write, const std::string& where) {
  if (result < 0) return Status::FromErrno(static_cast<int>(-result), where);
  if (write) return Status::NoSpace(StrCat(where, ": short write (filesystem full)"));
  return Status::Corrupted(
      StrCat(where, ": truncated slot (", result, " of ", expected, " bytes readable)"));
}

// Frees <dir>/manifest.old stepwise (OLD-MANIFEST CONTRACT); a failure is logged, never fatal:
// the file is left to the next checkpoint.
void FreeOldManifest(const std::string& dir) {
  if (const Status freed = RemoveOldManifest(dir); !freed.ok()) {
    std::fprintf(stderr, "tpusync: disk tier %s: %s\n", dir.c_str(), freed.ToString().c_str());
  }
}

}  // namespace

Result<std::unique_ptr<DiskTier>> DiskTier::Open(const DiskTierOptions& o) {
  if (o.directory.empty()) return Status::InvalidArgument("disk tier needs a directory");
  if (o.block_bytes == 0 || o.num_blocks == 0) {
    return Status::InvalidArgument("disk tier needs block_bytes > 0 and num_blocks > 0");
  }
  if (o.num_blocks > 0xffffffffu) return Status::InvalidArgument("more than 2^32 disk slots");
  // BOOKKEEPING BOUND: the slots live on disk, but the tier keeps per-slot state in RAM (and the
  // store an index entry per block); a count the machine cannot hold is refused by name instead
  // of ending in std::bad_alloc or the OOM killer.
  const uint64_t ram = static_cast<uint64_t>(sysconf(_SC_PHYS_PAGES)) *
                       static_cast<uint64_t>(sysconf(_SC_PAGE_SIZE));
  if (ram > 0 && o.num_blocks > ram / 2 / kRamPerSlot) {
    return Status::InvalidArgument(
        StrCat("disk_blocks ", o.num_blocks, " needs about ", o.num_blocks * kRamPerSlot >> 20,
               " MiB of RAM for the disk tier's per-slot state (", kRamPerSlot,
               " bytes a slot), more than half of this machine's ", ram >> 20,
               " MiB: use fewer, larger blocks"));
  }
  std::unique_ptr<DiskTier> t(new DiskTier());
  t->dir_ = o.directory;
  t->block_bytes_ = o.block_bytes;
  t->payload_bytes_ = RoundUp(o.block_bytes);
  t->slot_bytes_ = kSlotHeaderBytes + t->payload_bytes_;
  t->num_blocks_ = o.num_blocks;
  t->segment_blocks_ =
      o.segment_blocks ? o.segment_blocks : std::max<size_t>(1, (size_t{1} << 30) / t->slot_bytes_);
  t->segment_blocks_ = std::min(t->segment_blocks_, t->num_blocks_);
  t->fingerprint_ = Checksum64(o.fingerprint.data(), o.fingerprint.size());
  t->direct_ = o.direct_io;
  t->progressive_manifest_ = o.manifest_progressive_write_back;

  std::error_code ec;
  fs::create_directories(o.directory, ec);
  if (ec) {
    return Status::IOError(
        StrCat("disk tier directory ", o.directory, " cannot be created: ", ec.message()));
  }
  const fs::path dir(o.directory);
  const std::string lock_path = (dir / "LOCK").string();
  t->lock_fd_ = open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (t->lock_fd_ < 0) {
    return Status::FromErrno(errno, StrCat("disk tier directory ", o.directory,
                                           " is not writable (creating ", lock_path, ")"));
  }
  if (flock(t->lock_fd_, LOCK_EX | LOCK_NB) != 0) {
    return Status::FailedPrecondition(StrCat("disk tier directory ", o.directory,
                                             " is in use by another process (", lock_path,
                                             " is locked)"));
  }
  // Probe writability of the directory itself (a read-only mount lets us open an existing LOCK).
  {
    const std::string probe = (dir / ".write-probe").string();
    const int fd = open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
      return Status::FromErrno(errno,
                               StrCat("disk tier directory ", o.directory, " is not writable"));
    }
    close(fd);
    unlink(probe.c_str());
  }
  TPUSYNC_ASSIGN_OR_RETURN(t->io_, MakeIoBackend(o.io_backend, o.io_threads));
  if (o.wrap_io) t->io_ = o.wrap_io(std::move(t->io_));

  DiskMeta want;
  FillMeta(&want, o, t->slot_bytes_, t->segment_blocks_, t->fingerprint_);
  t->meta_ = want;
  const fs::path meta_path = dir / "tier.meta";
  bool cold = true;
  if (fs::exists(meta_path)) {
    DiskMeta have{};
    const int fd = open(meta_path.c_str(), O_RDONLY | O_CLOEXEC);
    const ssize_t n = fd >= 0 ? read(fd, &have, sizeof(have)) : -1;
    if (fd >= 0) close(fd);
    t->cold_start_reason_ = n == static_cast<ssize_t>(sizeof(have))
                                ? MetaMismatch(have, want)
                                : "tier.meta is truncated or unreadable";
    cold = !t->cold_start_reason_.empty();
  } else {
    for (const auto& entry : fs::directory_iterator(dir, ec)) {
      if (entry.path().extension() == ".tps") {
        t->cold_start_reason_ = "segment files without tier.meta";
        break;
      }
    }
  }
  if (!t->cold_start_reason_.empty()) {
    std::fprintf(stderr, "tpusync: disk tier %s: %s: cold start, cached blocks discarded\n",
                 o.directory.c_str(), t->cold_start_reason_.c_str());
  }
  if (cold) {
    for (const auto& entry : fs::directory_iterator(dir, ec)) {
      if (entry.path().extension() == ".tps") fs::remove(entry.path(), ec);
    }
    TPUSYNC_RETURN_IF_ERROR(WriteFileAtomic(meta_path, &want, sizeof(want)));
  }
  t->state_.assign(t->num_blocks_, kFree);
  t->holds_.assign(t->num_blocks_, 0);
  t->forget_on_free_.assign(t->num_blocks_, 0);
  t->sequence_ = std::make_unique<std::atomic<uint64_t>[]>(t->num_blocks_);
  for (size_t i = 0; i < t->num_blocks_; ++i) t->sequence_[i].store(kNoSequence);
  TPUSYNC_RETURN_IF_ERROR(t->OpenSegments(cold));
  if (cold) {
    // A manifest or journal left beside discarded segments must never describe the new ones.
    TPUSYNC_RETURN_IF_ERROR(RemoveManifest(o.directory));
    TPUSYNC_RETURN_IF_ERROR(RemoveJournals(o.directory, ~uint64_t{0}));
    t->recovery_ = "cold";
  } else {
    t->Recover();
  }
  for (size_t i = t->num_blocks_; i-- > 0;) {
    if (t->state_[i] == kFree) t->free_.push_back(static_cast<uint32_t>(i));
  }
  return t;
}

Status DiskTier::OpenSegments(bool cold) {
  // DIRECT I/O CONTRACT: every segment is opened the same way. direct_ starts as requested;
  // the first open the filesystem refuses with EINVAL (tmpfs before Linux 6.6, ramfs, some FUSE
  // filesystems) turns it off and reopens the earlier segments buffered, so the I/O path never
  // mixes O_DIRECT descriptors with unaligned buffers. stats().direct_io reports the outcome.
  // A filesystem can also accept O_DIRECT at open and refuse it per I/O (EINVAL from read /
  // write: some FUSE and network filesystems): RunIo then turns every segment buffered at once
  // (DropDirectIo) and runs the refused I/O again, so those blocks are written, not counted as
  // errors. Rejected: treating that EINVAL as a write error (the tier silently stores nothing on
  // such a filesystem) and reopening the segments (other threads may have I/O in flight on the
  // old descriptors; clearing O_DIRECT with fcntl keeps every descriptor valid).
  const size_t n = (num_blocks_ + segment_blocks_ - 1) / segment_blocks_;
  for (size_t s = 0; s < n; ++s) {
    char name[32];
    std::snprintf(name, sizeof(name), "seg-%06zu.tps", s);
    const size_t slots = std::min(segment_blocks_, num_blocks_ - s * segment_blocks_);
    TPUSYNC_ASSIGN_OR_RETURN(auto seg, SegmentFile::Open((fs::path(dir_) / name).string(),
                                                         slots * slot_bytes_, direct_));
    if (direct_ && !seg.direct()) {
      direct_ = false;
      segments_.clear();
      s = static_cast<size_t>(-1);  // start again, buffered
      continue;
    }
    segments_.push_back(std::move(seg));
  }
  opened_direct_ = direct_;
  (void)cold;
  return Status::OK();
}

void DiskTier::Recover() {
  // RESTART CONTRACT: the manifest plus its journals, else the scan.
  std::string why;
  const Status s = RecoverFromManifest(&why);
  if (s.ok()) return;
  recovered_.clear();
  for (size_t i = 0; i < num_blocks_; ++i) {
    state_[i] = kFree;
    sequence_[i].store(kNoSequence, std::memory_order_relaxed);
  }
  num_used_ = 0;
  std::fprintf(stderr, "tpusync: disk tier %s: %s: scanning %zu slot headers\n", dir_.c_str(),
               why.c_str(), num_blocks_);
  // Nothing of the old checkpoint may outlive the scan: the next one starts a new generation.
  const std::vector<uint64_t> gens = ListJournals(dir_);
  if (!gens.empty()) generation_ = std::max(generation_, gens.back());
  Status removed = RemoveManifest(dir_);
  const Status journals = RemoveJournals(dir_, ~uint64_t{0});
  if (removed.ok()) removed = journals;
  if (!removed.ok()) {
    std::fprintf(stderr, "tpusync: disk tier %s: stale manifest or journal not deleted: %s\n",
                 dir_.c_str(), removed.ToString().c_str());
  }
  Scan();
  recovery_ = "scan";
  recovery_slots_read_ = num_blocks_;
  changes_ = recovered_.size();  // no manifest: a first checkpoint is due
}

Status DiskTier::RecoverFromManifest(std::string* why) {
  // Open sized every segment; one that had another size (truncated since the manifest was
  // written) now matches the manifest's size stamp again, so it is caught here.
  for (const SegmentFile& seg : segments_) {
    if (auto was = seg.resized_from()) {
      const Status s = Status::Corrupted(StrCat("segment ", seg.path(), " was ", *was,
                                                " bytes at open (truncated or replaced since the "
                                                "last run)"));
      *why = StrCat("manifest not used: ", s.message());
      return s;
    }
  }
  std::vector<SegmentStamp> now;
  for (const SegmentFile& seg : segments_) {
    auto st = StampSegment(seg.fd(), seg.path());
    if (!st.ok()) {
      *why = StrCat("manifest not used: ", st.status().message());
      return st.status();
    }
    now.push_back(*st);
  }
  ManifestContents mc;
  Status s = ReadManifest(dir_, meta_, segments_.size(), num_blocks_, &mc);
  if (s.code() == StatusCode::kNotFound) {
    *why = "no clean-shutdown manifest or checkpoint (last close was not clean)";
    return s;
  }
  if (!s.ok()) {
    *why = StrCat("manifest not used: ", s.message());
    return s;
  }
  generation_ = std::max(generation_, mc.generation);
  JournalContents jc;
  s = ReadJournals(dir_, meta_, mc.generation, num_blocks_, &jc);
  if (!s.ok()) {
    *why = StrCat("checkpoint not used: ", s.message());
    return s;
  }
  generation_ = std::max(generation_, jc.last_generation);
  // The mtime only for a clean-close manifest with nothing journaled after it: a periodic
  // checkpoint's stamps are taken at its rotation, while the tier's own writes (in flight then,
  // journaled in the previous generation) may still move the mtime (CHECKPOINT CONTRACT).
  s = CheckStamps(mc.stamps, now,
                  /*with_mtime=*/jc.slots.empty() && mc.kind == ManifestKind::kCleanClose);
  if (!s.ok()) {
    *why = StrCat("manifest not used: ", s.message());
    return s;
  }
  // Continue the journal chain in a fresh generation (never append behind a record of a crashed
  // process): the manifest stays valid with journals mc.generation .. generation_.
  {
    auto w = JournalWriter::Create(dir_, generation_ + 1, meta_);
    if (!w.ok()) {
      *why = StrCat("checkpoint not used: ", w.status().message());
      return w.status();
    }
    journal_ = std::move(*w);
    generation_ += 1;
    manifest_generation_ = mc.generation;
  }
  std::vector<uint8_t> journaled(num_blocks_, 0);
  std::vector<uint64_t> reread;
  for (uint64_t slot : jc.slots) {
    if (!journaled[slot]) reread.push_back(slot);
    journaled[slot] = 1;
  }
  std::sort(reread.begin(), reread.end());
  for (RecoveredBlock& b : mc.blocks) {
    if (journaled[b.location]) continue;
    state_[b.location] = kUsed;
    sequence_[b.location].store(b.sequence, std::memory_order_relaxed);
    recovered_.push_back(std::move(b));
  }
  // The journaled slots: their headers decide (a valid block, else a free slot).
  std::vector<RecoveredBlock> fresh;
  ReadHeaders(
      reread.size(), [&](size_t i) { return reread[i]; },
      [&](uint64_t slot, const SlotHeader* h) {
        if (h == nullptr) return;
        fresh.push_back({std::string(SlotKey(*h)), slot, h->sequence});
      });
  if (!fresh.empty()) {
    // A key found in a journaled slot and elsewhere (a crash between writing a copy and freeing
    // the old slot, or an evicted slot re-put): keep the newest write, like the scan.
    std::unordered_map<std::string_view, size_t> by_key;
    by_key.reserve(fresh.size());
    std::vector<uint8_t> drop(fresh.size(), 0);
    for (size_t i = 0; i < fresh.size(); ++i) {
      auto [it, inserted] = by_key.emplace(fresh[i].key, i);
      if (inserted) continue;
      size_t& keep = it->second;
      const size_t lose = fresh[keep].sequence >= fresh[i].sequence ? i : keep;
      drop[lose] = 1;
      keep = lose == i ? keep : i;
    }
    std::vector<uint8_t> gone(recovered_.size(), 0);
    for (size_t r = 0; r < recovered_.size(); ++r) {
      auto it = by_key.find(recovered_[r].key);
      if (it == by_key.end()) continue;
      if (recovered_[r].sequence >= fresh[it->second].sequence) {
        drop[it->second] = 1;
      } else {
        gone[r] = 1;
      }
    }
    size_t w = 0;
    for (size_t r = 0; r < recovered_.size(); ++r) {
      if (gone[r]) {
        state_[recovered_[r].location] = kFree;
        sequence_[recovered_[r].location].store(kNoSequence, std::memory_order_relaxed);
      } else {
        if (w != r) recovered_[w] = std::move(recovered_[r]);
        ++w;
      }
    }
    recovered_.resize(w);
    for (size_t i = 0; i < fresh.size(); ++i) {
      if (drop[i]) continue;
      state_[fresh[i].location] = kUsed;
      sequence_[fresh[i].location].store(fresh[i].sequence, std::memory_order_relaxed);
      recovered_.push_back(std::move(fresh[i]));
    }
  }
  num_used_ = recovered_.size();
  recovered_count_ = recovered_.size();
  recovery_slots_read_ = reread.size();
  recovery_ = jc.slots.empty() && mc.kind == ManifestKind::kCleanClose ? "manifest" : "checkpoint";
  changes_ = reread.size();
  return Status::OK();
}

Status DiskTier::CheckpointOnClose(const BlockChunks& next_chunk) {
  Status s = WriteCheckpoint(next_chunk, /*clean_close=*/true);
  if (!s.ok()) {
    ++manifest_errors_;
    std::fprintf(stderr,
                 "tpusync: disk tier %s: no clean-shutdown manifest written (%s); the next open "
                 "scans every slot header\n",
                 dir_.c_str(), s.ToString().c_str());
  }
  return s;
}

Status DiskTier::Checkpoint(const BlockChunks& next_chunk) {
  Status s = WriteCheckpoint(next_chunk, /*clean_close=*/false);
  if (s.ok()) {
    ++checkpoints_;
  } else {
    ++manifest_errors_;
    std::fprintf(stderr,
                 "tpusync: disk tier %s: checkpoint not written (%s); a restart after a crash "
                 "uses the previous one or scans\n",
                 dir_.c_str(), s.ToString().c_str());
  }
  return s;
}

uint64_t DiskTier::ChangesSinceCheckpoint() const {
  const uint64_t c = changes_.load(std::memory_order_relaxed);
  return c;
}

bool DiskTier::CheckpointMissing() const {
  std::lock_guard<std::mutex> lock(jmu_);
  return manifest_generation_ == 0;
}

void DiskTier::Journal(std::span<const uint64_t> slots) {
  changes_.fetch_add(slots.size(), std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(jmu_);
  if (!journal_) return;
  const Status s = journal_->Append(slots);
  if (s.ok()) return;
  // The manifest no longer describes the disk together with its journals: it must go before
  // these bytes change. Journaling restarts with the next checkpoint.
  journal_.reset();
  manifest_generation_ = 0;
  ++manifest_errors_;
  const Status removed = RemoveManifest(dir_);
  std::fprintf(stderr,
               "tpusync: disk tier %s: slot journal not written (%s); manifest %s: the next "
               "restart after a crash scans every slot header\n",
               dir_.c_str(), s.ToString().c_str(),
               removed.ok() ? "deleted" : removed.ToString().c_str());
}

Status DiskTier::WriteCheckpoint(const BlockChunks& next_chunk, bool clean_close) {
  std::lock_guard<std::mutex> ckpt(ckpt_mu_);
  // 1. ROTATE (CHECKPOINT CONTRACT): changes from now on go to generation `gen`.
  uint64_t gen = 0;
  uint64_t changes_before = 0;
  {
    std::lock_guard<std::mutex> lock(jmu_);
    gen = generation_ + 1;
    TPUSYNC_ASSIGN_OR_RETURN(auto w, JournalWriter::Create(dir_, gen, meta_));
    journal_ = std::move(w);
    generation_ = gen;
    changes_before = changes_.load(std::memory_order_relaxed);
  }
  std::unique_ptr<ManifestWriter> writer;
  {
    std::vector<SegmentStamp> stamps;
    for (const SegmentFile& seg : segments_) {
      TPUSYNC_ASSIGN_OR_RETURN(auto st, StampSegment(seg.fd(), seg.path()));
      stamps.push_back(st);
    }
    TPUSYNC_ASSIGN_OR_RETURN(
        writer,
        ManifestWriter::Begin(
            dir_, meta_, std::move(stamps),
            clean_close ? ManifestKind::kCleanClose : ManifestKind::kCheckpoint, gen,
            progressive_manifest_ ? ManifestWriteBack::kProgressive : ManifestWriteBack::kAtSync));
  }
  // 2. WALK, one chunk at a time (tier.h CHUNKED WALK): the enumerator copies a chunk's (slot,
  // key) pairs under the index lock only; then, under this tier's lock, each gets its slot's
  // sequence (or is left out: a free slot, no completed write, a slot listed already); then the
  // chunk streams into manifest.tmp with no lock held. Memory: one chunk, one byte per slot.
  std::vector<uint8_t> listed(num_blocks_, 0);
  std::vector<ManifestEntry> chunk;
  uint64_t skipped = 0;
  for (bool more = true; more;) {
    chunk.clear();
    more = next_chunk([&](std::string_view key, uint64_t location) {
      if (key.empty() || key.size() > block::kMaxKeyBytes || location >= num_blocks_) {
        ++skipped;
        return;
      }
      ManifestEntry& e = chunk.emplace_back();
      e.slot = static_cast<uint32_t>(location);
      e.key_len = static_cast<uint8_t>(key.size());
      std::memcpy(e.key, key.data(), key.size());
    });
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (ManifestEntry& e : chunk) {
        const uint64_t seq = sequence_[e.slot].load(std::memory_order_relaxed);
        if (listed[e.slot] || state_[e.slot] == kFree || seq == kNoSequence) {
          e.key_len = 0;  // left out
          ++skipped;
          continue;
        }
        listed[e.slot] = 1;
        e.sequence = seq;
      }
    }
    for (const ManifestEntry& e : chunk) {
      if (e.key_len == 0) continue;
      TPUSYNC_RETURN_IF_ERROR(writer->Add(e.slot, e.sequence, std::string_view(e.key, e.key_len)));
    }
  }
  if (!clean_close) {
    // Held but not listed, AFTER the whole walk: a write or a forgetting release in flight, a
    // write not indexed yet, or a block indexed under an id the cursor had passed. Their headers
    // decide at a restart. Taken in slot ranges (this tier's lock per range): a slot reserved
    // after the rotation is journaled by its own write anyway.
    constexpr size_t kSlotsPerLock = size_t{1} << 16;
    std::vector<uint64_t> unsettled;
    for (size_t first = 0; first < num_blocks_; first += kSlotsPerLock) {
      std::lock_guard<std::mutex> lock(mu_);
      const size_t end = std::min(num_blocks_, first + kSlotsPerLock);
      for (size_t i = first; i < end; ++i) {
        if (state_[i] != kFree && !listed[i]) unsettled.push_back(i);
      }
    }
    if (!unsettled.empty()) {
      std::lock_guard<std::mutex> lock(jmu_);
      if (!journal_ || journal_->generation() != gen) {
        return Status::IOError("the slot journal failed during the checkpoint");
      }
      TPUSYNC_RETURN_IF_ERROR(journal_->Append(unsettled));
    }
  }
  // 3. WRITE: publish the manifest of generation `gen`. A manifest.old a crash left behind goes
  // first (stepwise, no lock held), so that Commit can keep the one it replaces there.
  FreeOldManifest(dir_);
  TPUSYNC_RETURN_IF_ERROR(writer->Sync());
  {
    std::lock_guard<std::mutex> lock(jmu_);
    if (!journal_ || journal_->generation() != gen) {
      return Status::IOError("the slot journal failed during the checkpoint");
    }
    TPUSYNC_RETURN_IF_ERROR(writer->Commit());
    manifest_generation_ = gen;
  }
  TPUSYNC_RETURN_IF_ERROR(SyncManifestDir(dir_));
  TPUSYNC_RETURN_IF_ERROR(RemoveJournals(dir_, gen));
  // The replaced manifest, freed 1 MiB at a time (OLD-MANIFEST CONTRACT). The checkpoint is
  // published already: a failure only leaves the file to the next checkpoint.
  FreeOldManifest(dir_);
  changes_.fetch_sub(std::min(changes_before, changes_.load()), std::memory_order_relaxed);
  if (clean_close && skipped > 0) {
    std::fprintf(stderr,
                 "tpusync: disk tier %s: %llu indexed blocks left out of the manifest (their slot "
                 "holds no completed write); they are dropped at the next open\n",
                 dir_.c_str(), static_cast<unsigned long long>(skipped));
  }
  return Status::OK();
}

void DiskTier::ReadHeaders(size_t n, const std::function<uint64_t(size_t)>& slot_at,
                           const std::function<void(uint64_t, const SlotHeader*)>& visit) {
  constexpr size_t kBatch = 256;
  AlignedBuf buf = Aligned(kBatch * kSlotHeaderBytes);
  std::vector<IoOp> ops;
  for (size_t first = 0; first < n; first += kBatch) {
    const size_t m = std::min(kBatch, n - first);
    ops.assign(m, IoOp{});
    for (size_t i = 0; i < m; ++i) {
      const uint64_t slot = slot_at(first + i);
      ops[i].fd = SegmentOf(slot).fd();
      ops[i].offset = SlotOffset(slot);
      ops[i].iov = {{buf.get() + i * kSlotHeaderBytes, kSlotHeaderBytes}};
    }
    RunIo(ops);
    for (size_t i = 0; i < m; ++i) {
      const uint64_t slot = slot_at(first + i);
      if (ops[i].result != static_cast<int64_t>(kSlotHeaderBytes)) {
        visit(slot, nullptr);
        continue;
      }
      const auto* h = reinterpret_cast<const SlotHeader*>(buf.get() + i * kSlotHeaderBytes);
      const Status s = CheckSlotHeader(*h, block_bytes_, fingerprint_);
      if (!s.ok() && s.code() != StatusCode::kNotFound) {
        ++corrupted_;  // reclaimed: the slot stays free and is overwritten by a later block
      }
      visit(slot, s.ok() ? h : nullptr);
    }
  }
}

void DiskTier::Scan() {
  std::unordered_map<std::string, size_t> by_key;  // key -> index in recovered_
  ReadHeaders(
      num_blocks_, [](size_t i) { return uint64_t{i}; },
      [&](uint64_t slot, const SlotHeader* h) {
        if (h == nullptr) return;
        const std::string key(SlotKey(*h));
        auto [it, fresh] = by_key.emplace(key, recovered_.size());
        if (!fresh) {
          // The same key twice (a crash between writing a copy and freeing the old one): keep
          // the newest; both hold the same content by the key contract.
          RecoveredBlock& prev = recovered_[it->second];
          if (prev.sequence >= h->sequence) return;
          state_[prev.location] = kFree;
          sequence_[prev.location].store(kNoSequence, std::memory_order_relaxed);
          --num_used_;
          prev.location = slot;
          prev.sequence = h->sequence;
        } else {
          recovered_.push_back({key, slot, h->sequence});
        }
        state_[slot] = kUsed;
        sequence_[slot].store(h->sequence, std::memory_order_relaxed);
        ++num_used_;
      });
  recovered_count_ = recovered_.size();
}

DiskTier::~DiskTier() {
  if (lock_fd_ >= 0) close(lock_fd_);
}

const SegmentFile& DiskTier::SegmentOf(uint64_t location) const {
  return segments_[location / segment_blocks_];
}
uint64_t DiskTier::SlotOffset(uint64_t location) const {
  return (location % segment_blocks_) * slot_bytes_;
}
std::string DiskTier::SegmentPath(uint64_t location) const { return SegmentOf(location).path(); }

size_t DiskTier::used() const {
  std::lock_guard<std::mutex> lock(mu_);
  return num_used_;
}

Result<uint64_t> DiskTier::Reserve() {
  std::lock_guard<std::mutex> lock(mu_);
  if (free_.empty()) {
    return Status::PoolExhausted(
        StrCat("disk tier ", dir_, " is full (", num_blocks_, " slots in use)"));
  }
  const uint32_t slot = free_.back();
  free_.pop_back();
  state_[slot] = kUsed;
  ++num_used_;
  return uint64_t{slot};
}

void DiskTier::Free(uint64_t slot) {
  state_[slot] = kFree;
  forget_on_free_[slot] = 0;
  --num_used_;
  free_.push_back(static_cast<uint32_t>(slot));
}

void DiskTier::ForgetHeader(uint64_t location) {
  const uint64_t slot[1] = {location};
  Journal(slot);  // JOURNAL CONTRACT: before the header is zeroed
  // One zeroed header page: a restart will not resurrect a removed or corrupted block.
  AlignedBuf zero = Aligned(kSlotHeaderBytes);
  std::memset(zero.get(), 0, kSlotHeaderBytes);
  IoOp op;
  op.fd = SegmentOf(location).fd();
  op.offset = SlotOffset(location);
  op.write = true;
  op.iov = {{zero.get(), kSlotHeaderBytes}};
  FinishIoSync(op, 0);  // best effort: a failure leaves a slot whose next write replaces it
}

void DiskTier::Release(uint64_t location, bool forget) {
  if (location >= num_blocks_) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (state_[location] != kUsed) return;
    state_[location] = kReleasing;  // no new hold from here on
    if (holds_[location] > 0) {
      forget_on_free_[location] = forget;  // HELD FORGET RULE: the last Unhold forgets and frees
      return;
    }
  }
  if (forget) ForgetHeader(location);
  std::lock_guard<std::mutex> lock(mu_);
  Free(location);
}

Status DiskTier::Hold(uint64_t location) {
  std::lock_guard<std::mutex> lock(mu_);
  if (location >= num_blocks_ || state_[location] != kUsed) {
    return Status::FailedPrecondition(StrCat("disk slot ", location, " is not in use"));
  }
  ++holds_[location];
  return Status::OK();
}

void DiskTier::Unhold(uint64_t location) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (location >= num_blocks_ || holds_[location] == 0) return;
    if (--holds_[location] != 0 || state_[location] != kReleasing) return;
    if (!forget_on_free_[location]) {
      Free(location);
      return;
    }
    forget_on_free_[location] = 0;  // still kReleasing: nobody holds or reuses it meanwhile
  }
  ForgetHeader(location);  // HELD FORGET RULE
  std::lock_guard<std::mutex> lock(mu_);
  Free(location);
}

void DiskTier::RunCoalesced(std::vector<IoOp>& ops) {
  // COALESCING: slots that are adjacent in one segment are moved by one vectored I/O (header,
  // payload, header, payload, ...) - small blocks then reach the disk's streaming bandwidth
  // instead of its IOPS limit. Only complete slots are merged (payload length == padded payload),
  // so the merged ranges are contiguous in the file. Each slot keeps its own result.
  constexpr size_t kMaxSlotsPerIo = 256;  // 512 iovecs, under IOV_MAX (1024)
  std::vector<size_t> order(ops.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return ops[a].fd != ops[b].fd ? ops[a].fd < ops[b].fd : ops[a].offset < ops[b].offset;
  });
  std::vector<IoOp> merged;
  std::vector<std::vector<size_t>> members;
  for (size_t i : order) {
    const IoOp& op = ops[i];
    const bool whole = op.iov.size() == 2 && op.iov[1].iov_len == payload_bytes_;
    if (!merged.empty() && whole && members.back().size() < kMaxSlotsPerIo) {
      IoOp& m = merged.back();
      const IoOp& prev = ops[members.back().back()];
      const bool prev_whole = prev.iov.size() == 2 && prev.iov[1].iov_len == payload_bytes_;
      if (prev_whole && m.fd == op.fd && m.write == op.write &&
          prev.offset + slot_bytes_ == op.offset) {
        m.iov.insert(m.iov.end(), op.iov.begin(), op.iov.end());
        members.back().push_back(i);
        continue;
      }
    }
    merged.push_back(op);
    members.push_back({i});
  }
  RunIo(merged);
  for (size_t m = 0; m < merged.size(); ++m) {
    int64_t left = merged[m].result;
    for (size_t i : members[m]) {
      const int64_t want = static_cast<int64_t>(ops[i].expected());
      if (left < 0) {
        ops[i].result = left;  // -errno for every slot of the failed I/O
      } else {
        ops[i].result = std::min(left, want);
        left -= ops[i].result;
      }
    }
  }
}

void DiskTier::RunIo(std::span<IoOp> ops) {
  io_->Run(ops);
  // Not direct_: a batch started while direct_ was set may see EINVAL after another thread
  // already dropped O_DIRECT; it must be run again all the same.
  if (!opened_direct_) return;
  std::vector<IoOp> again;
  std::vector<size_t> where;
  for (size_t i = 0; i < ops.size(); ++i) {
    if (ops[i].result == -EINVAL) {
      again.push_back(ops[i]);
      where.push_back(i);
    }
  }
  if (again.empty()) return;
  DropDirectIo();
  for (IoOp& op : again) op.result = 0;
  io_->Run(again);
  for (size_t j = 0; j < again.size(); ++j) ops[where[j]].result = again[j].result;
}

void DiskTier::DropDirectIo() {
  std::lock_guard<std::mutex> lock(direct_mu_);
  if (!direct_.load(std::memory_order_acquire)) return;
  for (SegmentFile& seg : segments_) {
    const Status s = seg.DropDirect();
    if (!s.ok()) {
      std::fprintf(stderr, "tpusync: disk tier %s: %s\n", dir_.c_str(), s.ToString().c_str());
    }
  }
  direct_.store(false, std::memory_order_release);
  std::fprintf(stderr,
               "tpusync: disk tier %s: the filesystem refuses O_DIRECT reads / writes (EINVAL); "
               "using buffered I/O from now on\n",
               dir_.c_str());
}

void DiskTier::WriteBatch(std::span<BlockWrite> ops) {
  const uint64_t t0 = NowNs();
  {
    std::vector<uint64_t> slots(ops.size());
    for (size_t i = 0; i < ops.size(); ++i) slots[i] = ops[i].location;
    Journal(slots);  // JOURNAL CONTRACT: before any of these slots changes
  }
  AlignedBuf headers = Aligned(ops.size() * kSlotHeaderBytes);
  std::vector<AlignedBuf> bounce(ops.size());
  std::vector<IoOp> io(ops.size());
  for (size_t i = 0; i < ops.size(); ++i) {
    BlockWrite& op = ops[i];
    uint8_t* hdr = headers.get() + i * kSlotHeaderBytes;
    std::memset(hdr, 0, kSlotHeaderBytes);
    const uint8_t* payload = op.data;
    size_t len = block_bytes_;
    uint64_t sum;
    if (direct_ && (!IsAligned(payload) || block_bytes_ % kAlign != 0)) {
      bounce[i] = Aligned(payload_bytes_);
      sum = CopyWithChecksum64(bounce[i].get(), payload, block_bytes_);  // one pass, not two
      std::memset(bounce[i].get() + block_bytes_, 0, payload_bytes_ - block_bytes_);
      payload = bounce[i].get();
      len = payload_bytes_;
    } else {
      sum = Checksum64(op.data, block_bytes_);
    }
    FillSlotHeader(reinterpret_cast<SlotHeader*>(hdr), op.key, block_bytes_, sum, op.sequence,
                   fingerprint_);
    io[i].fd = SegmentOf(op.location).fd();
    io[i].offset = SlotOffset(op.location);
    io[i].write = true;
    io[i].iov = {{hdr, kSlotHeaderBytes}, {const_cast<uint8_t*>(payload), len}};
  }
  RunCoalesced(io);
  size_t ok = 0;
  for (size_t i = 0; i < ops.size(); ++i) {
    if (io[i].result == static_cast<int64_t>(io[i].expected())) {
      ops[i].status = Status::OK();
      sequence_[ops[i].location] = ops[i].sequence;  // the slot's owner is this op (Reserve)
      ++ok;
      continue;
    }
    sequence_[ops[i].location] = kNoSequence;  // torn or unwritten: not manifest material
    ops[i].status = ErrnoStatus(io[i].result, io[i].expected(), true,
                                StrCat("write of disk slot ", ops[i].location, " in ", dir_));
    ++write_errors_;
    if (ops[i].status.code() == StatusCode::kNoSpace) ++no_space_;
  }
  blocks_written_ += ok;
  write_ns_ += NowNs() - t0;
}

void DiskTier::ReadBatch(std::span<BlockRead> ops) {
  const uint64_t t0 = NowNs();
  AlignedBuf headers = Aligned(ops.size() * kSlotHeaderBytes);
  std::vector<AlignedBuf> bounce(ops.size());
  std::vector<IoOp> io(ops.size());
  for (size_t i = 0; i < ops.size(); ++i) {
    BlockRead& op = ops[i];
    uint8_t* payload = op.dst;
    size_t len = block_bytes_;
    if (direct_ && (!IsAligned(payload) || block_bytes_ % kAlign != 0)) {
      bounce[i] = Aligned(payload_bytes_);
      payload = bounce[i].get();
      len = payload_bytes_;
    }
    io[i].fd = SegmentOf(op.location).fd();
    io[i].offset = SlotOffset(op.location);
    io[i].iov = {{headers.get() + i * kSlotHeaderBytes, kSlotHeaderBytes}, {payload, len}};
  }
  RunCoalesced(io);
  size_t ok = 0;
  for (size_t i = 0; i < ops.size(); ++i) {
    BlockRead& op = ops[i];
    const std::string where = StrCat("read of disk slot ", op.location, " in ", dir_);
    if (io[i].result != static_cast<int64_t>(io[i].expected())) {
      op.status = ErrnoStatus(io[i].result, io[i].expected(), false, where);
    } else {
      const auto* h = reinterpret_cast<const SlotHeader*>(headers.get() + i * kSlotHeaderBytes);
      const uint8_t* payload = bounce[i] ? bounce[i].get() : op.dst;
      op.status = VerifyBlock(*h, op.key, payload, block_bytes_, fingerprint_);
      if (!op.status.ok() && !bounce[i]) op.status = RereadPrivately(op);
      if (op.status.ok() && bounce[i]) std::memcpy(op.dst, payload, block_bytes_);
      if (op.status.ok()) op.checksum = h->checksum;
      if (!op.status.ok()) op.status = Status::Corrupted(StrCat(where, ": ", op.status.message()));
    }
    if (op.status.ok()) {
      ++ok;
    } else if (op.status.code() == StatusCode::kCorrupted) {
      ++corrupted_;
    } else {
      ++read_errors_;
    }
  }
  blocks_read_ += ok;
  read_ns_ += NowNs() - t0;
}

Status DiskTier::RereadPrivately(BlockRead& op) {
  AlignedBuf header = Aligned(kSlotHeaderBytes);
  AlignedBuf payload = Aligned(payload_bytes_);
  std::vector<IoOp> io(1);
  io[0].fd = SegmentOf(op.location).fd();
  io[0].offset = SlotOffset(op.location);
  io[0].iov = {{header.get(), kSlotHeaderBytes}, {payload.get(), payload_bytes_}};
  RunCoalesced(io);
  if (io[0].result != static_cast<int64_t>(io[0].expected())) {
    return Status::Corrupted("block payload checksum mismatch (the slot could not be read again)");
  }
  const auto* h = reinterpret_cast<const SlotHeader*>(header.get());
  Status s = VerifyBlock(*h, op.key, payload.get(), block_bytes_, fingerprint_);
  if (s.ok()) std::memcpy(op.dst, payload.get(), block_bytes_);
  return s;
}

std::vector<RecoveredBlock> DiskTier::TakeRecovered() { return std::move(recovered_); }

TierStats DiskTier::stats() const {
  TierStats s;
  s.capacity_blocks = num_blocks_;
  s.used_blocks = used();
  s.blocks_written = blocks_written_;
  s.blocks_read = blocks_read_;
  s.bytes_written = s.blocks_written * block_bytes_;
  s.bytes_read = s.blocks_read * block_bytes_;
  s.write_errors = write_errors_;
  s.no_space_errors = no_space_;
  s.read_errors = read_errors_;
  s.corrupted = corrupted_;
  s.recovered = recovered_count_;
  s.write_ns = write_ns_;
  s.read_ns = read_ns_;
  s.direct_io = direct_;
  s.io_backend = std::string(io_->name());
  s.cold_start_reason = cold_start_reason_;
  s.recovery = recovery_;
  s.manifest_errors = manifest_errors_;
  s.recovery_slots_read = recovery_slots_read_;
  s.checkpoints = checkpoints_;
  s.journaled = changes_;
  s.manifest_write_back = progressive_manifest_ ? "progressive" : "at_fsync";
  return s;
}

}  // namespace tpusync::tier
