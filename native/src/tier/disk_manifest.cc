#include "tpusync/tier/disk_manifest.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "tpusync/tier/file_write.h"

namespace tpusync::tier {
namespace {

constexpr size_t kBufBytes = size_t{1} << 20;

std::string PathIn(const std::string& dir, const char* name) { return dir + "/" + name; }

// OLD-MANIFEST CONTRACT: frees `path` 1 MiB at a time (ftruncate down), then unlinks it.
// ENOENT: nothing to do. A file with another link is only unlinked, never truncated: a crash
// between Commit's link and its rename leaves manifest.old as a second name of the LIVE manifest.
Status ShrinkAndRemove(const std::string& path) {
  const int fd = open(path.c_str(), O_WRONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return Status::OK();
    return Status::FromErrno(errno, StrCat("opening old manifest ", path));
  }
  struct stat st {};
  Status s = Status::OK();
  if (fstat(fd, &st) != 0) s = Status::FromErrno(errno, StrCat("sizing old manifest ", path));
  for (off_t size = s.ok() && st.st_nlink == 1 ? st.st_size : 0; size > 0 && s.ok();) {
    size = size > static_cast<off_t>(kBufBytes) ? size - static_cast<off_t>(kBufBytes) : 0;
    if (ftruncate(fd, size) != 0) {
      s = Status::FromErrno(errno, StrCat("truncating old manifest ", path));
    }
  }
  close(fd);
  if (unlink(path.c_str()) != 0 && errno != ENOENT && s.ok()) {
    s = Status::FromErrno(errno, StrCat("removing old manifest ", path));
  }
  return s;
}

Status SyncDir(const std::string& dir) {
  const int fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return Status::FromErrno(errno, StrCat("opening directory ", dir, " to fsync it"));
  const int rc = fsync(fd);
  const int err = errno;
  close(fd);
  // Some filesystems refuse fsync on a directory (EINVAL): the rename itself is still atomic.
  if (rc != 0 && err != EINVAL) return Status::FromErrno(err, StrCat("fsync of directory ", dir));
  return Status::OK();
}

}  // namespace

Result<SegmentStamp> StampSegment(int fd, const std::string& path) {
  struct stat st {};
  if (fstat(fd, &st) != 0) return Status::FromErrno(errno, StrCat("fstat ", path));
  return SegmentStamp{static_cast<uint64_t>(st.st_size), static_cast<uint64_t>(st.st_ino),
                      static_cast<int64_t>(st.st_mtim.tv_sec),
                      static_cast<int64_t>(st.st_mtim.tv_nsec)};
}

Result<std::unique_ptr<ManifestWriter>> ManifestWriter::Begin(
    const std::string& dir, const DiskMeta& meta, std::vector<SegmentStamp> stamps,
    ManifestKind kind, uint64_t generation, ManifestWriteBack write_back) {
  std::unique_ptr<ManifestWriter> w(new ManifestWriter());
  w->progressive_ = write_back == ManifestWriteBack::kProgressive;
  w->dir_ = dir;
  w->tmp_ = PathIn(dir, "manifest.tmp");
  w->fd_ = open(w->tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (w->fd_ < 0) return Status::FromErrno(errno, StrCat("creating manifest ", w->tmp_));
  std::memset(&w->header_, 0, sizeof(w->header_));
  w->header_.magic = kManifestMagic;
  w->header_.version = kManifestVersion;
  w->header_.kind = static_cast<uint16_t>(kind);
  w->header_.generation = generation;
  w->header_.meta = meta;
  w->header_.num_segments = stamps.size();
  w->sum_ = std::make_unique<Checksum64Stream>();
  w->buf_.reserve(kBufBytes);
  // The header goes last (pwrite at 0, once the counts and the body checksum are known).
  w->buf_.resize(sizeof(ManifestHeader), 0);
  const auto* s = reinterpret_cast<const uint8_t*>(stamps.data());
  w->buf_.insert(w->buf_.end(), s, s + stamps.size() * sizeof(SegmentStamp));
  w->sum_->Update(s, stamps.size() * sizeof(SegmentStamp));
  return w;
}

ManifestWriter::~ManifestWriter() {
  if (fd_ >= 0) close(fd_);
  if (!committed_ && !tmp_.empty()) unlink(tmp_.c_str());
}

Status ManifestWriter::Drain() {
  if (buf_.empty()) return Status::OK();
  Status s = WriteAll(fd_, buf_.data(), buf_.size(), StrCat("manifest ", tmp_));
  written_ += buf_.size();
  buf_.clear();
  TPUSYNC_RETURN_IF_ERROR(s);
  if (!progressive_) return Status::OK();
  // WRITE-BACK CONTRACT: start this buffer's write-out, then wait for the one before.
  return WriteBack(pushed_, written_ - pushed_);
}

Status ManifestWriter::WriteBack(uint64_t offset, uint64_t bytes) {
  const auto range = [&](uint64_t off, uint64_t len, unsigned flags) -> Status {
    if (sync_file_range(fd_, static_cast<off_t>(off), static_cast<off_t>(len), flags) == 0) {
      return Status::OK();
    }
    const int err = errno;
    if (err == EINVAL || err == ENOSYS || err == EOPNOTSUPP || err == ESPIPE) {
      progressive_ = false;  // this filesystem does not do it: the fsync alone, as kAtSync
      return Status::OK();
    }
    return Status::FromErrno(err, StrCat("write-back of manifest ", tmp_));
  };
  TPUSYNC_RETURN_IF_ERROR(range(offset, bytes, SYNC_FILE_RANGE_WRITE));
  pushed_ = offset + bytes;
  if (progressive_ && offset > waited_) {
    TPUSYNC_RETURN_IF_ERROR(
        range(waited_, offset - waited_,
              SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER));
    waited_ = offset;
  }
  return Status::OK();
}

Status ManifestWriter::Add(uint64_t slot, uint64_t sequence, std::string_view key) {
  if (key.empty() || key.size() > block::kMaxKeyBytes || slot > 0xffffffffu) {
    return Status::InvalidArgument(StrCat("manifest entry for slot ", slot, " with a ", key.size(),
                                          "-byte key is not representable"));
  }
  ManifestEntry e;
  std::memset(&e, 0, sizeof(e));
  e.sequence = sequence;
  e.slot = static_cast<uint32_t>(slot);
  e.key_len = static_cast<uint8_t>(key.size());
  std::memcpy(e.key, key.data(), key.size());
  const auto* p = reinterpret_cast<const uint8_t*>(&e);
  buf_.insert(buf_.end(), p, p + sizeof(e));
  sum_->Update(&e, sizeof(e));
  ++num_entries_;
  if (buf_.size() + sizeof(e) > kBufBytes) return Drain();
  return Status::OK();
}

Status ManifestWriter::Sync() {
  if (synced_) return Status::OK();
  TPUSYNC_RETURN_IF_ERROR(Drain());
  header_.num_entries = num_entries_;
  header_.body_checksum = sum_->Digest();
  header_.header_checksum = Checksum64(&header_, offsetof(ManifestHeader, header_checksum));
  const ssize_t n = pwrite(fd_, &header_, sizeof(header_), 0);
  if (n < 0) return Status::FromErrno(errno, StrCat("writing manifest header ", tmp_));
  if (n != static_cast<ssize_t>(sizeof(header_))) {
    return Status::NoSpace(StrCat("writing manifest header ", tmp_, ": short write"));
  }
  if (fsync(fd_) != 0) return Status::FromErrno(errno, StrCat("fsync of manifest ", tmp_));
  synced_ = true;
  return Status::OK();
}

Status ManifestWriter::Commit() {
  TPUSYNC_RETURN_IF_ERROR(Sync());
  close(fd_);
  fd_ = -1;
  const std::string path = PathIn(dir_, kManifestFile);
  // OLD-MANIFEST CONTRACT: the manifest being replaced stays linked as manifest.old, so the rename
  // frees nothing; RemoveOldManifest frees it in steps. Where link fails (no previous manifest, a
  // leftover manifest.old, a filesystem without hard links) the rename frees it, as before.
  const std::string old = PathIn(dir_, kOldManifestFile);
  const bool kept = link(path.c_str(), old.c_str()) == 0;
  if (rename(tmp_.c_str(), path.c_str()) != 0) {
    const int err = errno;
    if (kept) unlink(old.c_str());  // still linked as manifest: frees nothing
    return Status::FromErrno(err, StrCat("renaming manifest ", tmp_));
  }
  committed_ = true;
  return Status::OK();
}

Status SyncManifestDir(const std::string& dir) { return SyncDir(dir); }

Status RemoveOldManifest(const std::string& dir) {
  return ShrinkAndRemove(PathIn(dir, kOldManifestFile));
}

Status ReadManifest(const std::string& dir, const DiskMeta& want, size_t num_segments,
                    uint64_t num_blocks, ManifestContents* contents) {
  std::vector<RecoveredBlock>* out = &contents->blocks;
  out->clear();
  const std::string path = PathIn(dir, kManifestFile);
  TPUSYNC_ASSIGN_OR_RETURN(const ReadOnlyFile file, ReadOnlyFile::Open(path, "manifest"));
  ManifestHeader h{};
  const ssize_t got = file.ReadAll(&h, sizeof(h));
  if (got < 0) return Status::FromErrno(static_cast<int>(-got), StrCat("reading manifest ", path));
  if (got != static_cast<ssize_t>(sizeof(h))) {
    return Status::Corrupted(
        StrCat("manifest is truncated (", got, " bytes, less than its header)"));
  }
  if (h.magic != kManifestMagic) return Status::Corrupted("manifest magic mismatch");
  if (h.version != kManifestVersion) {
    return Status::Corrupted(StrCat("manifest format version ", h.version, " (this build reads ",
                                    kManifestVersion, ")"));
  }
  if (h.header_checksum != Checksum64(&h, offsetof(ManifestHeader, header_checksum))) {
    return Status::Corrupted("manifest header checksum mismatch");
  }
  if (std::memcmp(&h.meta, &want, sizeof(DiskMeta)) != 0) {
    return Status::Corrupted("manifest was written under another tier.meta");
  }
  if (h.kind != static_cast<uint16_t>(ManifestKind::kCleanClose) &&
      h.kind != static_cast<uint16_t>(ManifestKind::kCheckpoint)) {
    return Status::Corrupted(StrCat("manifest kind ", h.kind, " is unknown"));
  }
  if (h.num_segments != num_segments || h.num_entries > num_blocks) {
    return Status::Corrupted(StrCat("manifest lists ", h.num_entries, " blocks in ", h.num_segments,
                                    " segments; the tier has ", num_blocks, " slots in ",
                                    num_segments));
  }
  const uint64_t expect = sizeof(ManifestHeader) + h.num_segments * sizeof(SegmentStamp) +
                          h.num_entries * sizeof(ManifestEntry);
  if (file.size() != expect) {
    return Status::Corrupted(
        StrCat("manifest is truncated or padded (", file.size(), " bytes, expected ", expect, ")"));
  }
  Checksum64Stream sum;
  std::vector<SegmentStamp> have(num_segments);
  const size_t stamp_bytes = have.size() * sizeof(SegmentStamp);
  if (file.ReadAll(have.data(), stamp_bytes) != static_cast<ssize_t>(stamp_bytes)) {
    return Status::Corrupted("manifest is truncated (segment stamps)");
  }
  sum.Update(have.data(), stamp_bytes);
  std::vector<uint8_t> seen(num_blocks, 0);
  std::vector<ManifestEntry> chunk(kBufBytes / sizeof(ManifestEntry));
  out->reserve(h.num_entries);
  for (uint64_t done = 0; done < h.num_entries;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(chunk.size(), h.num_entries - done));
    const size_t bytes = n * sizeof(ManifestEntry);
    if (file.ReadAll(chunk.data(), bytes) != static_cast<ssize_t>(bytes)) {
      out->clear();
      return Status::Corrupted("manifest is truncated (entries)");
    }
    sum.Update(chunk.data(), bytes);
    for (size_t i = 0; i < n; ++i) {
      const ManifestEntry& e = chunk[i];
      if (e.slot >= num_blocks || seen[e.slot] || e.key_len == 0 ||
          e.key_len > block::kMaxKeyBytes) {
        out->clear();
        return Status::Corrupted(StrCat("manifest entry ", done + i, " is invalid (slot ", e.slot,
                                        ", key length ", int{e.key_len}, ")"));
      }
      seen[e.slot] = 1;
      out->push_back({std::string(e.key, e.key_len), e.slot, e.sequence});
    }
    done += n;
  }
  if (sum.Digest() != h.body_checksum) {
    out->clear();
    return Status::Corrupted("manifest checksum mismatch");
  }
  contents->kind = static_cast<ManifestKind>(h.kind);
  contents->generation = h.generation;
  contents->stamps = std::move(have);
  return Status::OK();
}

Status CheckStamps(std::span<const SegmentStamp> written, std::span<const SegmentStamp> now,
                   bool with_mtime) {
  for (size_t s = 0; s < written.size() && s < now.size(); ++s) {
    const SegmentStamp& a = written[s];
    const SegmentStamp& b = now[s];
    if (a.size != b.size || a.inode != b.inode ||
        (with_mtime && (a.mtime_s != b.mtime_s || a.mtime_ns != b.mtime_ns))) {
      return Status::Corrupted(StrCat("segment ", s, " changed after the manifest was written (",
                                      with_mtime ? "size, inode or mtime" : "size or inode", ")"));
    }
  }
  return Status::OK();
}

Status RemoveManifest(const std::string& dir) {
  bool removed = false;
  TPUSYNC_RETURN_IF_ERROR(RemoveOldManifest(dir));
  for (const char* name : {kManifestFile, "manifest.tmp"}) {
    const std::string path = PathIn(dir, name);
    if (unlink(path.c_str()) == 0) {
      removed = true;
    } else if (errno != ENOENT) {
      return Status::FromErrno(errno, StrCat("removing manifest ", path));
    }
  }
  return removed ? SyncDir(dir) : Status::OK();
}

}  // namespace tpusync::tier
