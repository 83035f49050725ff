// IoBackend: batched positional file I/O for the disk tier.
//
// IO CONTRACT: Run(ops) returns only when every op has completed; each op's `result` is the byte
// count transferred (always the full expected() length unless an error or end of file stopped it)
// or -errno. Short transfers are continued until complete, EOF (a truncated file: result <
// expected) or an error. Safe to call from several threads at once.
//
// Two implementations behind one interface: io_uring (liburing, one ring per concurrent caller,
// the whole batch submitted with one syscall) and a pread/pwrite thread pool. MakeIoBackend("auto")
// picks io_uring when it was compiled in and the kernel lets us create a ring (containers often
// forbid it via seccomp), else the thread pool. Rejected alternative: libaio - needs O_DIRECT to be
// asynchronous at all, so it would silently serialise on filesystems that refuse O_DIRECT (tmpfs,
// some NFS mounts).
#pragma once

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tpusync/base/status.h"

namespace tpusync::tier {

struct IoOp {
  int fd = -1;
  uint64_t offset = 0;
  bool write = false;
  std::vector<iovec> iov;  // at most IOV_MAX entries (adjacent slots are coalesced into one op)
  int64_t result = 0;      // out: bytes transferred or -errno

  size_t expected() const {
    size_t n = 0;
    for (const iovec& v : iov) n += v.iov_len;
    return n;
  }
};

class IoBackend {
 public:
  virtual ~IoBackend() = default;
  virtual std::string_view name() const = 0;
  virtual void Run(std::span<IoOp> ops) = 0;
};

// "auto", "io_uring" or "pread". io_uring requested but unavailable is kUnavailable.
Result<std::unique_ptr<IoBackend>> MakeIoBackend(std::string_view kind, size_t threads);
std::unique_ptr<IoBackend> MakePreadBackend(size_t threads);
Result<std::unique_ptr<IoBackend>> MakeIoUringBackend(unsigned queue_depth);
// Completes one op synchronously from `done` bytes on (used by both backends for short I/O).
void FinishIoSync(IoOp& op, size_t done);

}  // namespace tpusync::tier
