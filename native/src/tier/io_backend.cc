#include "tpusync/tier/io_backend.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>

#include "tpusync/concurrency/thread_pool.h"

namespace tpusync::tier {

void FinishIoSync(IoOp& op, size_t done) {
  const size_t total = op.expected();
  while (done < total) {
    // Rebuild the iovec tail from `done`.
    std::vector<iovec> rest;
    rest.reserve(op.iov.size());
    size_t skip = done;
    for (const iovec& v : op.iov) {
      if (skip >= v.iov_len) {
        skip -= v.iov_len;
        continue;
      }
      rest.push_back({static_cast<uint8_t*>(v.iov_base) + skip, v.iov_len - skip});
      skip = 0;
    }
    const off_t off = static_cast<off_t>(op.offset + done);
    const int cnt = static_cast<int>(rest.size());
    const ssize_t n =
        op.write ? pwritev(op.fd, rest.data(), cnt, off) : preadv(op.fd, rest.data(), cnt, off);
    if (n < 0) {
      if (errno == EINTR) continue;
      op.result = -errno;
      return;
    }
    if (n == 0) {
      // Reading past the end of a file (truncated segment), or a write that made no progress
      // (a full filesystem reports ENOSPC only on the next call).
      if (op.write) {
        op.result = -ENOSPC;
        return;
      }
      break;
    }
    done += static_cast<size_t>(n);
  }
  op.result = static_cast<int64_t>(done);
}

namespace {

class PreadBackend final : public IoBackend {
 public:
  explicit PreadBackend(size_t threads) : pool_(std::max<size_t>(1, threads)) {}
  std::string_view name() const override { return "pread"; }

  void Run(std::span<IoOp> ops) override {
    if (ops.size() <= 1) {
      for (IoOp& op : ops) FinishIoSync(op, 0);
      return;
    }
    const size_t parts = std::min(ops.size(), pool_.num_threads());
    std::vector<concurrency::ThreadPool::Task> tasks;
    for (size_t p = 0; p < parts; ++p) {
      tasks.push_back([ops, p, parts](const concurrency::FutureCore&) {
        for (size_t i = p; i < ops.size(); i += parts) FinishIoSync(ops[i], 0);
        return Status::OK();
      });
    }
    concurrency::Future f = pool_.SubmitBatch(std::move(tasks));
    // Parts only do bounded I/O calls; the wait ends when they do (no cancel path here).
    (void)f->Wait(std::nullopt);
  }

 private:
  concurrency::ThreadPool pool_;
};

}  // namespace

std::unique_ptr<IoBackend> MakePreadBackend(size_t threads) {
  return std::make_unique<PreadBackend>(threads);
}

Result<std::unique_ptr<IoBackend>> MakeIoBackend(std::string_view kind, size_t threads) {
  if (kind == "pread") return MakePreadBackend(threads);
  if (kind == "io_uring" || kind == "auto") {
    auto uring = MakeIoUringBackend(static_cast<unsigned>(std::max<size_t>(64, threads * 16)));
    if (uring.ok() || kind == "io_uring") return uring;
    return MakePreadBackend(threads);
  }
  return Status::InvalidArgument(
      StrCat("unknown io backend '", kind, "': use auto, io_uring or pread"));
}

}  // namespace tpusync::tier
