// ThreadPool: the engine's worker threads. Python submits copies here and keeps computing; the
// bindings release the GIL for every submit and wait.
//
// SHUTDOWN CONTRACT: destruction completes every task still queued with kCancelled (their
// callbacks run) and joins the workers after their current task; nothing is left pending forever.
//
// A task receives its Future's core so it can poll cancel_requested() between chunks.
#pragma once

#include <sys/types.h>
#include <unistd.h>

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tpusync/base/status.h"
#include "tpusync/concurrency/future.h"

namespace tpusync::concurrency {

// FORK RULE: a counter bumped in every child forked from this process (pthread_atfork, armed on
// the first call). An object that keeps the value it saw at creation tells a forked child from
// its own process by one relaxed load, where getpid() was a system call on every submit.
uint64_t ForkGeneration();

class ThreadPool {
 public:
  using Task = std::function<Status(const FutureCore& self)>;

  // threads == 0: one per online CPU. Throws std::system_error when a thread cannot be started
  // (the ones already started are stopped and joined first; Python sees a RuntimeError).
  explicit ThreadPool(size_t threads = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Runs `task` on a worker; the returned future completes with its Status.
  Future Submit(Task task);
  // Runs every part on the workers in parallel; one future completes when all have, with the
  // first error. Cancelling it skips parts not yet started and flags running ones.
  Future SubmitBatch(std::vector<Task> parts);

  size_t num_threads() const { return workers_.size(); }
  size_t queue_depth() const;

 private:
  struct Item {
    Future future;
    Task task;
    std::function<void(const Status&)> done;  // for batch parts
  };
  void Enqueue(std::vector<Item> items);
  void WorkerLoop();

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> queue_;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
  const pid_t pid_ = getpid();  // FORK RULE (Enqueue): named in the error
  const uint64_t fork_generation_ = ForkGeneration();
};

}  // namespace tpusync::concurrency
