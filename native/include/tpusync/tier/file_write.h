// The syscall loops of the disk tier's small metadata files (the checkpoint manifest,
// tier/disk_manifest.h, and the slot journal, tier/disk_journal.h): write(2) until every byte is
// stored, and a read-only open that knows its size and reads until done.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "tpusync/base/status.h"

namespace tpusync::tier {

// Writes `bytes` from `data` to fd, retrying short writes and EINTR. Errors name `what` (e.g.
// "journal <path>"): kNoSpace for ENOSPC / EDQUOT (Status::FromErrno) and for a write that
// stores 0 bytes; the errno's code otherwise. The file offset is wherever the failed write left it.
Status WriteAll(int fd, const void* data, size_t bytes, const std::string& what);

// A file opened O_RDONLY | O_CLOEXEC, closed when destroyed, with its size as fstat saw it at the
// open (the metadata readers compare it with what the file's header says before reading on).
class ReadOnlyFile {
 public:
  // kNotFound when `path` does not exist; an errno status naming `what` (e.g. "manifest") and the
  // path otherwise.
  static Result<ReadOnlyFile> Open(const std::string& path, const std::string& what);
  ReadOnlyFile(ReadOnlyFile&& o) noexcept : fd_(o.fd_), size_(o.size_) { o.fd_ = -1; }
  ReadOnlyFile& operator=(ReadOnlyFile&&) = delete;
  ReadOnlyFile(const ReadOnlyFile&) = delete;
  ~ReadOnlyFile();

  uint64_t size() const { return size_; }
  // read(2) from the file offset until `bytes` are read or the file ends, retrying short reads
  // and EINTR: the count read (less than `bytes` only at the end of the file), or -errno.
  ssize_t ReadAll(void* data, size_t bytes) const;

 private:
  ReadOnlyFile(int fd, uint64_t size) : fd_(fd), size_(size) {}
  int fd_;
  uint64_t size_;
};

}  // namespace tpusync::tier
