#include "tpusync/memory/shm_reclaim.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <memory>

namespace tpusync::memory {
namespace {

constexpr size_t kMinPrefix = 8;

// True when /dev/shm/<name> is the inode `fd` has open.
bool NameIsFd(int fd, const std::string& name) {
  struct stat by_fd {};
  struct stat by_name {};
  if (fstat(fd, &by_fd) != 0) return false;
  if (stat(("/dev/shm/" + name).c_str(), &by_name) != 0) return false;
  return by_fd.st_dev == by_name.st_dev && by_fd.st_ino == by_name.st_ino;
}

// Looks at every /dev/shm/<prefix>* segment, in name order: `visit(segment, fd)` runs with the
// segment open read-only (`fd`) and returns whether the segment goes into the result.
template <typename Visit>
Result<std::vector<ShmSegment>> Scan(std::string_view prefix, Visit visit) {
  if (prefix.size() < kMinPrefix || !ValidShmName(prefix)) {
    return Status::InvalidArgument(
        StrCat("shm segment prefix '", prefix, "' must be ", kMinPrefix,
               "-200 characters of letters, digits, '-', '_' and '.' (a short prefix could "
               "sweep other programs' segments)"));
  }
  std::unique_ptr<DIR, int (*)(DIR*)> dir(opendir("/dev/shm"), closedir);
  if (!dir) return Status::FromErrno(errno, "opendir /dev/shm");
  std::vector<std::string> names;
  while (const dirent* e = readdir(dir.get())) {
    const std::string_view n(e->d_name);
    if (n.substr(0, prefix.size()) == prefix && (e->d_type == DT_REG || e->d_type == DT_UNKNOWN)) {
      names.emplace_back(n);
    }
  }
  dir.reset();
  std::sort(names.begin(), names.end());
  std::vector<ShmSegment> out;
  for (const std::string& name : names) {
    const int fd = shm_open(("/" + name).c_str(), O_RDONLY | O_NOFOLLOW, 0);
    if (fd < 0) continue;  // vanished, or not ours to open
    struct stat st {};
    if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode)) {
      ShmSegment seg{name, static_cast<uint64_t>(st.st_size), false};
      if (visit(seg, fd)) out.push_back(std::move(seg));
    }
    close(fd);
  }
  return out;
}

}  // namespace

bool ValidShmName(std::string_view name) {
  if (name.empty() || name.size() > 200) return false;
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '-' || c == '_' || c == '.';
    if (!ok) return false;
  }
  return name != "." && name != "..";
}

Result<bool> LockSegmentOwner(int fd, const std::string& name) {
  while (flock(fd, LOCK_SH) != 0) {
    if (errno != EINTR) {
      return Status::FromErrno(errno, StrCat("flock of /dev/shm/", name, " (owner lock)"));
    }
  }
  return NameIsFd(fd, name);
}

Result<std::vector<ShmSegment>> ReclaimStaleSegments(std::string_view prefix) {
  // An exclusive lock is only granted when no live pool holds its shared owner lock.
  return Scan(prefix, [](const ShmSegment& seg, int fd) {
    return flock(fd, LOCK_EX | LOCK_NB) == 0 && NameIsFd(fd, seg.name) &&
           shm_unlink(("/" + seg.name).c_str()) == 0;
  });
}

Result<std::vector<ShmSegment>> ListSegments(std::string_view prefix) {
  return Scan(prefix, [](ShmSegment& seg, int fd) {
    seg.owned = flock(fd, LOCK_EX | LOCK_NB) != 0;
    if (!seg.owned) (void)flock(fd, LOCK_UN);
    return true;
  });
}

}  // namespace tpusync::memory
