#include "tpusync/tier/file_write.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>

namespace tpusync::tier {

Status WriteAll(int fd, const void* data, size_t bytes, const std::string& what) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (bytes > 0) {
    const ssize_t n = write(fd, p, bytes);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Status::FromErrno(errno, StrCat("writing ", what));
    if (n == 0) return Status::NoSpace(StrCat("writing ", what, ": no space left"));
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return Status::OK();
}

Result<ReadOnlyFile> ReadOnlyFile::Open(const std::string& path, const std::string& what) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0 && errno == ENOENT) return Status::NotFound(StrCat("no ", what, " ", path));
  if (fd < 0) return Status::FromErrno(errno, StrCat("opening ", what, " ", path));
  ReadOnlyFile f(fd, 0);  // closes fd on the error below
  struct stat st {};
  if (fstat(fd, &st) != 0) return Status::FromErrno(errno, StrCat("fstat of ", what, " ", path));
  f.size_ = static_cast<uint64_t>(st.st_size);
  return f;
}

ReadOnlyFile::~ReadOnlyFile() {
  if (fd_ >= 0) close(fd_);
}

ssize_t ReadOnlyFile::ReadAll(void* data, size_t bytes) const {
  auto* p = static_cast<uint8_t*>(data);
  size_t done = 0;
  while (done < bytes) {
    const ssize_t n = read(fd_, p + done, bytes - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return -errno;
    if (n == 0) break;
    done += static_cast<size_t>(n);
  }
  return static_cast<ssize_t>(done);
}

}  // namespace tpusync::tier
