#include "tpusync/concurrency/future.h"

namespace tpusync::concurrency {

bool FutureCore::TryStart() {
  std::lock_guard<std::mutex> lock(mu_);
  if (state_ != FutureState::kPending) return false;
  state_ = FutureState::kRunning;
  return true;
}

bool FutureCore::EnsureRunning() {
  std::lock_guard<std::mutex> lock(mu_);
  if (state_ == FutureState::kDone) return false;
  state_ = FutureState::kRunning;
  return true;
}

bool FutureCore::Complete(Status status) {
  std::vector<Callback> cleanups;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (completing_) return false;
    completing_ = true;
    cleanups.swap(cleanups_);
  }
  for (auto& cb : cleanups) cb(status);
  std::vector<Callback> callbacks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    state_ = FutureState::kDone;
    status_ = std::move(status);
    callbacks.swap(callbacks_);
  }
  cv_.notify_all();
  for (auto& cb : callbacks) cb(status_);  // status_ is immutable once done
  return true;
}

bool FutureCore::Cancel() {
  cancel_requested_.store(true, std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (state_ != FutureState::kPending) return false;
  }
  return Complete(Status::Cancelled("operation cancelled before it started"));
}

bool FutureCore::done() const {
  std::lock_guard<std::mutex> lock(mu_);
  return state_ == FutureState::kDone;
}

FutureState FutureCore::state() const {
  std::lock_guard<std::mutex> lock(mu_);
  return state_;
}

Status FutureCore::Wait(std::optional<std::chrono::nanoseconds> timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  auto is_done = [this] { return state_ == FutureState::kDone; };
  if (!timeout) {
    cv_.wait(lock, is_done);
  } else if (!cv_.wait_for(lock, *timeout, is_done)) {
    return Status::Timeout(StrCat("operation not complete after ",
                                  std::chrono::duration<double>(*timeout).count(), " s"));
  }
  return status_;
}

void FutureCore::OnCleanup(Callback cb) {
  Status now;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!completing_) {
      cleanups_.push_back(std::move(cb));
      return;
    }
    now = state_ == FutureState::kDone ? status_ : Status::OK();
  }
  cb(now);  // completion has begun: the operation no longer uses what cb releases
}

void FutureCore::OnComplete(Callback cb) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (state_ != FutureState::kDone) {
      callbacks_.push_back(std::move(cb));
      return;
    }
  }
  cb(status_);
}

CompletionCounter::CompletionCounter(Future parent, size_t n)
    : parent_(std::move(parent)), remaining_(n) {
  if (n == 0) parent_->Complete(Status::OK());
}

void CompletionCounter::PartDone(const Status& status) {
  if (!status.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    if (first_error_.ok()) first_error_ = status;
  }
  if (remaining_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
    Status final_status;
    {
      std::lock_guard<std::mutex> lock(mu_);
      final_status = first_error_;
    }
    parent_->Complete(std::move(final_status));
  }
}

}  // namespace tpusync::concurrency
