#include "tpusync/memory/host_pool.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <map>
#include <mutex>
#include <thread>

#include "tpusync/memory/shm_reclaim.h"

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25  // Linux 6.1 (uapi asm-generic/mman-common.h); older glibc headers lack it
#endif

namespace tpusync::memory {
namespace {

size_t PageSize() { return static_cast<size_t>(sysconf(_SC_PAGESIZE)); }

// Touches one byte per page so the kernel backs every page now. Reading keeps the contents (an
// attached warm segment must not be zeroed); a volatile read of a never-touched private page maps
// the shared zero page, so anonymous pools are written instead.
void TouchPages(uint8_t* data, size_t size, bool write) {
  const size_t page = PageSize();
  if (write) {
    for (size_t off = 0; off < size; off += page) data[off] = 0;
  } else {
    uint8_t sink = 0;
    for (size_t off = 0; off < size; off += page)
      sink ^= *static_cast<volatile uint8_t*>(data + off);
    asm volatile("" : : "r"(sink));
  }
}

// EXIT CONTRACT: a non-persistent segment disappears at a normal exit of the process that
// created or attached it, even when its pool was never destroyed (a Python interpreter that ends
// with live native objects skips their destructors: every such exit left a /dev/shm file behind).
// Live non-persistent names are kept here with the pid that owns them; an atexit handler unlinks
// the ones this pid owns (a forked child that exits normally must not unlink its parent's).
// Existing mappings, this process's and its peers', stay valid after the unlink. A killed process
// (SIGKILL, _exit) runs nothing and still leaves its segment; a later pool of the same name
// attaches to it or refuses it (attach_existing). Rejected: unlinking right after creation (peers
// on the same host open the segment by name).
std::mutex& ExitMu() {
  static auto* mu = new std::mutex;  // never destroyed: used from the atexit handler
  return *mu;
}
std::map<std::string, pid_t>& ExitNames() {
  static auto* names = new std::map<std::string, pid_t>;
  return *names;
}
void UnlinkLeftSegments() {
  std::lock_guard lock(ExitMu());
  const pid_t me = getpid();
  for (const auto& [name, owner] : ExitNames()) {
    if (owner == me) shm_unlink(("/" + name).c_str());
  }
  ExitNames().clear();
}
void UnlinkAtExit(const std::string& name) {
  static std::once_flag once;
  std::call_once(once, [] { std::atexit(UnlinkLeftSegments); });
  std::lock_guard lock(ExitMu());
  ExitNames()[name] = getpid();
}
void ForgetAtExit(const std::string& name) {
  std::lock_guard lock(ExitMu());
  ExitNames().erase(name);
}

}  // namespace

Result<std::unique_ptr<HostPool>> HostPool::Create(const HostPoolOptions& options) {
  if (options.size_bytes == 0) return Status::InvalidArgument("host pool size must be > 0 bytes");
  const size_t page = PageSize();
  const size_t size = (options.size_bytes + page - 1) / page * page;
  std::unique_ptr<HostPool> pool(new HostPool());
  pool->size_ = size;
  pool->persist_ = options.persist;
  const int populate = options.prefault ? MAP_POPULATE : 0;
  void* addr = MAP_FAILED;

  if (options.shm_name.empty()) {
    if (options.huge_pages) {
      addr = mmap(nullptr, size, PROT_READ | PROT_WRITE,
                  MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB | populate, -1, 0);
      pool->huge_pages_active_ = addr != MAP_FAILED;
    }
    if (addr == MAP_FAILED) {
      addr = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (addr == MAP_FAILED) {
        return Status::FromErrno(errno, StrCat("mmap of a ", size, "-byte anonymous host pool"));
      }
      if (options.huge_pages) {
        pool->huge_pages_active_ = madvise(addr, size, MADV_HUGEPAGE) == 0;
      }
    }
  } else {
    if (!ValidShmName(options.shm_name)) {
      return Status::InvalidArgument(StrCat("invalid shm segment name '", options.shm_name,
                                            "': use letters, digits, '-', '_' and '.'"));
    }
    const std::string path = "/" + options.shm_name;
    int fd = -1;
    // OWNER LOCK CONTRACT (shm_reclaim.h): the pool holds a shared flock on its segment for its
    // whole life. A sweeper may unlink a stale name between our open and our lock; then the name
    // no longer refers to our inode and the segment is opened (created) again.
    for (int attempt = 0;; ++attempt) {
      pool->attached_ = false;
      fd = shm_open(path.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
      if (fd < 0 && errno == EEXIST) {
        if (!options.attach_existing) {
          return Status::AlreadyExists(
              StrCat("/dev/shm/", options.shm_name, " exists and attach_existing is false"));
        }
        fd = shm_open(path.c_str(), O_RDWR, 0600);
        if (fd < 0 && errno == ENOENT && attempt < 3) continue;  // reclaimed meanwhile
        if (fd < 0) {
          return Status::FromErrno(errno, StrCat("shm_open /dev/shm/", options.shm_name));
        }
        struct stat st {};
        if (fstat(fd, &st) != 0) {
          const int err = errno;
          close(fd);
          return Status::FromErrno(err, "fstat of shm segment");
        }
        if (static_cast<size_t>(st.st_size) != size) {
          close(fd);
          return Status::InvalidArgument(StrCat("/dev/shm/", options.shm_name, " holds ",
                                                st.st_size, " bytes but the pool asks for ", size,
                                                "; remove the segment or use the same size"));
        }
        // ONE POOL PER SEGMENT: a live pool holds its shared owner lock, so an exclusive one is
        // refused while it lives. Two pools on one segment each hand out the same blocks (each
        // has its own allocator): attaching is only for a segment nobody owns (warm restart).
        // Retried briefly: `tpusync shm list` probes take the exclusive lock for a moment.
        bool free_to_attach = false;
        for (int probe = 0; probe < 20 && !free_to_attach; ++probe) {
          free_to_attach = flock(fd, LOCK_EX | LOCK_NB) == 0;
          if (!free_to_attach && errno != EWOULDBLOCK && errno != EINTR) break;
          if (!free_to_attach) usleep(1000);
        }
        if (!free_to_attach) {
          close(fd);
          return Status::FailedPrecondition(
              StrCat("/dev/shm/", options.shm_name,
                     " is in use by a live pool (in this or another process): two pools on one "
                     "segment would hand out the same blocks; use another name, or close that "
                     "pool first"));
        }
        pool->attached_ = true;
      } else if (fd < 0) {
        return Status::FromErrno(errno, StrCat("shm_open /dev/shm/", options.shm_name));
      } else {
        // posix_fallocate reserves the tmpfs pages now, so a full /dev/shm fails here with
        // ENOSPC instead of a SIGBUS on first write.
        if (ftruncate(fd, static_cast<off_t>(size)) != 0 ||
            (errno = posix_fallocate(fd, 0, static_cast<off_t>(size))) != 0) {
          const int err = errno;
          close(fd);
          shm_unlink(path.c_str());
          return Status::FromErrno(
              err, StrCat("sizing /dev/shm/", options.shm_name, " to ", size, " bytes"));
        }
      }
      Result<bool> owned = LockSegmentOwner(fd, options.shm_name);
      if (owned.ok() && *owned) break;
      close(fd);
      if (!owned.ok()) {
        if (!pool->attached_) shm_unlink(path.c_str());
        return owned.status();
      }
      if (attempt >= 3) {
        return Status::IOError(StrCat("/dev/shm/", options.shm_name,
                                      " was unlinked by another process each time it was opened"));
      }
    }
    pool->owner_fd_ = fd;
    // With huge pages asked for, the segment is mapped without MAP_POPULATE (the prefault touch
    // below maps it); the background collapse then rebuilds it from 2 MiB pages (HUGE-PAGE
    // CONTRACT in host_pool.h).
    // A 2 MiB-aligned address, so file offset 0 (and every 2 MiB after it) can be mapped by one
    // page-table entry: reserve 2 MiB more, then map the segment over the aligned part of it.
    void* at = nullptr;
    void* reserved = MAP_FAILED;
    size_t reserved_bytes = 0;
    if (options.huge_pages) {
      constexpr size_t kHuge = size_t{2} << 20;
      reserved_bytes = size + kHuge;
      reserved = mmap(nullptr, reserved_bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (reserved != MAP_FAILED) {
        at = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(reserved) + kHuge - 1) &
                                     ~uintptr_t{kHuge - 1});
      }
    }
    addr = mmap(at, size, PROT_READ | PROT_WRITE,
                MAP_SHARED | (at ? MAP_FIXED : 0) | (options.huge_pages ? 0 : populate), fd, 0);
    const int err = errno;
    if (reserved != MAP_FAILED) {  // give back the parts of the reservation around the segment
      const auto r = reinterpret_cast<uintptr_t>(reserved);
      const auto a = reinterpret_cast<uintptr_t>(at);
      if (addr == MAP_FAILED) {
        munmap(reserved, reserved_bytes);
      } else {
        if (a > r) munmap(reserved, a - r);
        if (r + reserved_bytes > a + size) {
          munmap(reinterpret_cast<void*>(a + size), r + reserved_bytes - (a + size));
        }
      }
    }
    if (addr == MAP_FAILED) {
      if (!pool->attached_) shm_unlink(path.c_str());
      return Status::FromErrno(err, StrCat("mmap of /dev/shm/", options.shm_name));
    }
    if (options.huge_pages) {
      (void)madvise(addr, size, MADV_HUGEPAGE);  // lets later faults use huge pages where allowed
    }
  }

  pool->data_ = static_cast<uint8_t*>(addr);
  // Only a fully mapped pool owns the segment name: a failed attach must never unlink a segment
  // that another process (or the previous incarnation) still relies on.
  pool->shm_name_ = options.shm_name;
  if (!pool->persist_ && !pool->shm_name_.empty()) UnlinkAtExit(pool->shm_name_);
  if (options.prefault) TouchPages(pool->data_, size, /*write=*/!pool->attached_);
  if (options.mlock) pool->locked_ = mlock(addr, size) == 0;
  if (options.huge_pages && !options.shm_name.empty()) pool->StartCollapse();
  return pool;
}

void HostPool::StartCollapse() {
  collapsing_.store(true, std::memory_order_release);
  collapser_ = std::thread([this] {
    constexpr size_t kStep = size_t{32} << 20;  // a multiple of 2 MiB; data_ is 2 MiB-aligned
    for (size_t off = 0; off < size_ && !stop_collapse_.load(std::memory_order_acquire);
         off += kStep) {
      const size_t n = std::min(kStep, size_ - off);
      const bool ok = madvise(data_ + off, n, MADV_COLLAPSE) == 0;
      if (off == 0) huge_pages_active_.store(ok, std::memory_order_release);
      if (!ok && off == 0) break;  // refused (old kernel, "deny"): no point in trying further
    }
    collapsing_.store(false, std::memory_order_release);
  });
}

bool HostPool::WaitHugePages(std::chrono::milliseconds timeout) const {
  const auto until = std::chrono::steady_clock::now() + timeout;
  while (collapsing_.load(std::memory_order_acquire)) {
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return true;
}

Status HostPool::Unlink() {
  if (shm_name_.empty() || unlinked_) return Status::OK();
  unlinked_ = true;
  ForgetAtExit(shm_name_);
  if (shm_unlink(("/" + shm_name_).c_str()) != 0 && errno != ENOENT) {
    return Status::FromErrno(errno, StrCat("shm_unlink /dev/shm/", shm_name_));
  }
  return Status::OK();
}

HostPool::~HostPool() {
  stop_collapse_.store(true, std::memory_order_release);
  if (collapser_.joinable()) collapser_.join();  // at most one 32 MiB step
  if (data_ != nullptr) {
    if (locked_) munlock(data_, size_);
    munmap(data_, size_);
  }
  if (!persist_) (void)Unlink();
  if (owner_fd_ >= 0) close(owner_fd_);  // drops the owner lock (OWNER LOCK CONTRACT)
}

}  // namespace tpusync::memory
