// io_uring backend (compiled when liburing is found; io_uring_stub.cc otherwise).
#include <liburing.h>

#include <cstring>
#include <mutex>
#include <vector>

#include "tpusync/tier/io_backend.h"

namespace tpusync::tier {
namespace {

class IoUringBackend final : public IoBackend {
 public:
  explicit IoUringBackend(unsigned depth) : depth_(depth) {}
  ~IoUringBackend() override {
    for (io_uring* r : free_) {
      io_uring_queue_exit(r);
      delete r;
    }
  }
  std::string_view name() const override { return "io_uring"; }

  Status Probe() {
    auto ring = Acquire();
    if (!ring.ok()) return ring.status();
    Return(*ring);
    return Status::OK();
  }

  void Run(std::span<IoOp> ops) override {
    auto ring_or = Acquire();
    if (!ring_or.ok()) {  // cannot happen after a successful probe unless out of memory
      for (IoOp& op : ops) FinishIoSync(op, 0);
      return;
    }
    io_uring* ring = *ring_or;
    size_t next = 0, inflight = 0, done = 0;
    while (done < ops.size()) {
      while (next < ops.size() && inflight < depth_) {
        io_uring_sqe* sqe = io_uring_get_sqe(ring);
        if (sqe == nullptr) break;
        IoOp& op = ops[next];
        if (op.write) {
          io_uring_prep_writev(sqe, op.fd, op.iov.data(), static_cast<unsigned>(op.iov.size()),
                               op.offset);
        } else {
          io_uring_prep_readv(sqe, op.fd, op.iov.data(), static_cast<unsigned>(op.iov.size()),
                              op.offset);
        }
        io_uring_sqe_set_data(sqe, &op);
        ++next;
        ++inflight;
      }
      io_uring_submit_and_wait(ring, 1);
      io_uring_cqe* cqe = nullptr;
      while (io_uring_peek_cqe(ring, &cqe) == 0 && cqe != nullptr) {
        IoOp& op = *static_cast<IoOp*>(io_uring_cqe_get_data(cqe));
        const int res = cqe->res;
        io_uring_cqe_seen(ring, cqe);
        --inflight;
        ++done;
        if (res < 0) {
          op.result = res;
        } else if (static_cast<size_t>(res) < op.expected() && res > 0) {
          FinishIoSync(op, static_cast<size_t>(res));  // short transfer: finish synchronously
        } else if (res == 0 && op.write && op.expected() > 0) {
          op.result = -ENOSPC;
        } else {
          op.result = res;
        }
      }
    }
    Return(ring);
  }

 private:
  Result<io_uring*> Acquire() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!free_.empty()) {
        io_uring* r = free_.back();
        free_.pop_back();
        return r;
      }
    }
    auto* r = new io_uring;
    const int err = io_uring_queue_init(depth_, r, 0);
    if (err < 0) {
      delete r;
      return Status::Unavailable(StrCat("io_uring_queue_init: ", std::strerror(-err)));
    }
    return r;
  }
  void Return(io_uring* r) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(r);
  }

  unsigned depth_;
  std::mutex mu_;
  std::vector<io_uring*> free_;
};

}  // namespace

Result<std::unique_ptr<IoBackend>> MakeIoUringBackend(unsigned queue_depth) {
  auto b = std::make_unique<IoUringBackend>(queue_depth);
  TPUSYNC_RETURN_IF_ERROR(b->Probe());
  return std::unique_ptr<IoBackend>(std::move(b));
}

}  // namespace tpusync::tier
