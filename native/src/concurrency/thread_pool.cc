#include "tpusync/concurrency/thread_pool.h"

#include <pthread.h>

#include <atomic>
#include <string>
#include <system_error>

#include <memory>

namespace tpusync::concurrency {

namespace {
std::atomic<uint64_t> g_fork_generation{0};
void BumpForkGeneration() { g_fork_generation.fetch_add(1, std::memory_order_relaxed); }
}  // namespace

uint64_t ForkGeneration() {
  static const bool armed = pthread_atfork(nullptr, nullptr, &BumpForkGeneration) == 0;
  (void)armed;
  return g_fork_generation.load(std::memory_order_relaxed);
}

ThreadPool::ThreadPool(size_t threads) {
  if (threads == 0) threads = std::max<size_t>(1, std::thread::hardware_concurrency());
  workers_.reserve(threads);
  try {
    for (size_t i = 0; i < threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
  } catch (const std::system_error& e) {
    // No thread to spare (a pids or address-space limit): stop the workers already started and
    // throw, rather than std::terminate on their joinable std::threads.
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    for (auto& w : workers_) w.join();
    throw std::system_error(e.code(), "starting engine thread " +
                                          std::to_string(workers_.size() + 1) + " of " +
                                          std::to_string(threads));
  }
}

ThreadPool::~ThreadPool() {
  std::deque<Item> leftover;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    leftover.swap(queue_);
  }
  cv_.notify_all();
  for (auto& w : workers_) w.join();
  const Status cancelled = Status::Cancelled("engine shut down before the operation ran");
  for (auto& item : leftover) {
    item.future->Complete(cancelled);
    if (item.done) item.done(cancelled);
  }
}

void ThreadPool::Enqueue(std::vector<Item> items) {
  if (ForkGeneration() != fork_generation_) {
    // FORK RULE: a child forked from the process that started the workers has none of them;
    // queued work would never run (every wait timed out without saying why).
    const Status forked = Status::FailedPrecondition(
        StrCat("this engine's threads were started in process ", pid_, ", which forked this one (",
               getpid(),
               "); a forked child has none of them: create tpusync objects after the "
               "fork, or start workers with the 'spawn' method"));
    for (auto& it : items) {
      it.future->Complete(forked);
      if (it.done) it.done(forked);
    }
    return;
  }
  bool stopping;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping = stopping_;
    if (!stopping) {
      for (auto& it : items) queue_.push_back(std::move(it));
    }
  }
  if (stopping) {
    const Status cancelled = Status::Cancelled("engine is shutting down");
    for (auto& it : items) {
      it.future->Complete(cancelled);
      if (it.done) it.done(cancelled);
    }
    return;
  }
  cv_.notify_all();
}

Future ThreadPool::Submit(Task task) {
  Future f;
  std::vector<Item> items;
  items.push_back(Item{f, std::move(task), nullptr});
  Enqueue(std::move(items));
  return f;
}

Future ThreadPool::SubmitBatch(std::vector<Task> parts) {
  Future parent;
  auto counter = std::make_shared<CompletionCounter>(parent, parts.size());
  std::vector<Item> items;
  items.reserve(parts.size());
  for (auto& part : parts) {
    // Each part runs under its own core but observes the parent's cancellation.
    Future child;
    auto wrapped = [parent, task = std::move(part)](const FutureCore&) -> Status {
      if (!parent->EnsureRunning() || parent->cancel_requested()) {
        return Status::Cancelled("batch cancelled");
      }
      return task(*parent.core());
    };
    items.push_back(
        Item{child, std::move(wrapped), [counter](const Status& s) { counter->PartDone(s); }});
  }
  // The parent stays pending until its first part starts: Cancel() before that completes it at
  // once (no part will touch caller memory: each checks EnsureRunning first); after that Cancel()
  // only flags the running parts.
  Enqueue(std::move(items));
  return parent;
}

size_t ThreadPool::queue_depth() const {
  std::lock_guard<std::mutex> lock(mu_);
  return queue_.size();
}

void ThreadPool::WorkerLoop() {
  for (;;) {
    Item item;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping and drained
      item = std::move(queue_.front());
      queue_.pop_front();
    }
    Status status;
    if (item.future->TryStart()) {
      // A cancel that arrives after the work finished reports what happened: it completed.
      status = item.task(*item.future.core());
      item.future->Complete(status);
    } else {
      status = item.future->Wait(std::chrono::nanoseconds(0));  // cancelled earlier
    }
    if (item.done) item.done(status);
  }
}

}  // namespace tpusync::concurrency
