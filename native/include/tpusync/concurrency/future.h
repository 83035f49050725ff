// Future: completion of an asynchronous native operation, carrying a Status.
//
// WAIT CONTRACT: every wait takes a timeout; Wait returns kTimeout when the deadline passes and the
// operation keeps running (wait again, or Cancel). There is deliberately no untimed wait in the
// Python face.
//
// CANCEL CONTRACT: Cancel on a pending operation completes it at once with kCancelled and its work
// never starts. On a running operation it raises cancel_requested(); work checks it between chunks
// and completes with kCancelled at the next check, so cancel never tears a half-copied chunk.
//
// CALLBACK CONTRACT: OnComplete callbacks run exactly once, on the thread that completes the
// future (or inline when already complete), after waiters can observe the final Status. They must
// not block for long: they run on an engine worker.
//
// CLEANUP CONTRACT: OnCleanup callbacks run exactly once, BEFORE waiters can observe completion
// (on the completing thread; inline when registered once completion has begun). They release what
// the operation held (block borrows), so a caller returning from Wait sees it released. They must
// not wait on this future. Rejected alternative: running every OnComplete callback before the
// notify, which would deadlock callbacks that read the final Status through Wait.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "tpusync/base/status.h"

namespace tpusync::concurrency {

enum class FutureState : uint8_t { kPending, kRunning, kDone };

class FutureCore {
 public:
  using Callback = std::function<void(const Status&)>;

  // Pending -> running. False when the future was already cancelled or completed.
  bool TryStart();
  // Pending -> running, or already running: true. False when already complete (e.g. cancelled).
  // Batch parts call this so the first part to start decides the race with Cancel.
  bool EnsureRunning();
  // Completes with `status` unless already complete. Returns whether this call completed it.
  bool Complete(Status status);
  bool Cancel();
  bool cancel_requested() const { return cancel_requested_.load(std::memory_order_relaxed); }
  bool done() const;
  FutureState state() const;
  // Final status, or kTimeout if not complete within `timeout` (nullopt: wait forever - native
  // callers only).
  Status Wait(std::optional<std::chrono::nanoseconds> timeout);
  void OnComplete(Callback cb);
  void OnCleanup(Callback cb);

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  FutureState state_ = FutureState::kPending;
  Status status_;
  std::vector<Callback> callbacks_;
  std::vector<Callback> cleanups_;
  bool completing_ = false;  // Complete has begun (cleanups running or done)
  std::atomic<bool> cancel_requested_{false};
};

// A cheap, copyable handle to a FutureCore.
class Future {
 public:
  Future() : core_(std::make_shared<FutureCore>()) {}
  static Future Completed(Status status) {
    Future f;
    f.core_->Complete(std::move(status));
    return f;
  }
  FutureCore* operator->() const { return core_.get(); }
  const std::shared_ptr<FutureCore>& core() const { return core_; }

 private:
  std::shared_ptr<FutureCore> core_;
};

// Completes `parent` when `n` parts have finished: with the first non-OK status, else OK.
class CompletionCounter {
 public:
  CompletionCounter(Future parent, size_t n);
  void PartDone(const Status& status);

 private:
  Future parent_;
  std::atomic<size_t> remaining_;
  std::mutex mu_;
  Status first_error_;
};

}  // namespace tpusync::concurrency
