#include "tpusync/tier/file_write.h"

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

}  // namespace tpusync::tier
