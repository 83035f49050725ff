// SegmentFile: one big file of fixed-size block slots in a disk tier directory.
//
// DIRECT-IO CONTRACT: Open tries O_DIRECT first (no page-cache double buffering, predictable SSD
// throughput); a filesystem that refuses it (EINVAL: some tmpfs / FUSE / NFS setups) gets a
// buffered descriptor instead and direct() says so - never an error. A filesystem that accepts
// O_DIRECT at open but refuses it per I/O (EINVAL on read / write: some FUSE and network
// filesystems) is handled by the owner with DropDirect(), which clears O_DIRECT on the open
// descriptor (fcntl F_SETFL; no reopen, so I/O already in flight on other threads keeps a valid
// descriptor). Files are sized with
// ftruncate (sparse): space is consumed as slots are written, so a full filesystem shows up as
// ENOSPC on a block write (counted, the store keeps serving) rather than at start.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "tpusync/base/status.h"

namespace tpusync::tier {

class SegmentFile {
 public:
  static Result<SegmentFile> Open(const std::string& path, uint64_t size_bytes, bool try_direct);
  SegmentFile() = default;
  SegmentFile(SegmentFile&& o) noexcept { *this = std::move(o); }
  SegmentFile& operator=(SegmentFile&& o) noexcept;
  SegmentFile(const SegmentFile&) = delete;
  SegmentFile& operator=(const SegmentFile&) = delete;
  ~SegmentFile();

  int fd() const { return fd_; }
  bool direct() const { return direct_; }
  // Turns this descriptor buffered (clears O_DIRECT). Idempotent.
  Status DropDirect();
  const std::string& path() const { return path_; }
  // The file's size before Open sized it, when it had another one (a segment truncated or
  // deleted since the last run: a manifest must not vouch for its slots).
  std::optional<uint64_t> resized_from() const { return resized_from_; }

 private:
  int fd_ = -1;
  bool direct_ = false;
  std::string path_;
  std::optional<uint64_t> resized_from_;
};

}  // namespace tpusync::tier
