#include "tpusync/tier/segment_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

namespace tpusync::tier {

Result<SegmentFile> SegmentFile::Open(const std::string& path, uint64_t size_bytes,
                                      bool try_direct) {
  SegmentFile f;
  f.path_ = path;
  const int flags = O_RDWR | O_CREAT | O_CLOEXEC;
  if (try_direct) {
    f.fd_ = open(path.c_str(), flags | O_DIRECT, 0644);
    f.direct_ = f.fd_ >= 0;
    if (f.fd_ < 0 && errno != EINVAL) return Status::FromErrno(errno, StrCat("open ", path));
  }
  if (f.fd_ < 0) {
    f.fd_ = open(path.c_str(), flags, 0644);
    if (f.fd_ < 0) return Status::FromErrno(errno, StrCat("open ", path));
  }
  struct stat st {};
  if (fstat(f.fd_, &st) != 0) return Status::FromErrno(errno, StrCat("fstat ", path));
  if (static_cast<uint64_t>(st.st_size) != size_bytes) {
    f.resized_from_ = static_cast<uint64_t>(st.st_size);
    if (ftruncate(f.fd_, static_cast<off_t>(size_bytes)) != 0) {
      return Status::FromErrno(errno,
                               StrCat("sizing segment ", path, " to ", size_bytes, " bytes"));
    }
  }
  return f;
}

Status SegmentFile::DropDirect() {
  const int flags = fcntl(fd_, F_GETFL);
  if (flags < 0) return Status::FromErrno(errno, StrCat("fcntl F_GETFL ", path_));
  if ((flags & O_DIRECT) && fcntl(fd_, F_SETFL, flags & ~O_DIRECT) != 0) {
    return Status::FromErrno(errno, StrCat("clearing O_DIRECT on ", path_));
  }
  direct_ = false;
  return Status::OK();
}

SegmentFile& SegmentFile::operator=(SegmentFile&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) close(fd_);
    fd_ = o.fd_;
    direct_ = o.direct_;
    path_ = std::move(o.path_);
    resized_from_ = o.resized_from_;
    o.fd_ = -1;
  }
  return *this;
}

SegmentFile::~SegmentFile() {
  if (fd_ >= 0) close(fd_);
}

}  // namespace tpusync::tier
