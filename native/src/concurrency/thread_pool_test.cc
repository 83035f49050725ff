#include "tpusync/concurrency/thread_pool.h"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <numeric>
#include <thread>

#include <gtest/gtest.h>

namespace tpusync::concurrency {
namespace {

using namespace std::chrono_literals;

TEST(Future, WaitTimesOutThenCompletes) {
  ThreadPool pool(1);
  std::atomic<bool> release{false};
  Future f = pool.Submit([&](const FutureCore&) {
    while (!release) std::this_thread::sleep_for(1ms);
    return Status::OK();
  });
  EXPECT_EQ(f->Wait(10ms).code(), StatusCode::kTimeout);
  EXPECT_FALSE(f->done());
  release = true;
  EXPECT_TRUE(f->Wait(5s).ok());
}

// FORK RULE: a child forked after the workers started has none of them; its work failed to run
// silently (every wait timed out). It now fails at once, naming the fork.
TEST(ThreadPool, WorkSubmittedInAForkedChildFailsAtOnceNamingTheFork) {
  ThreadPool pool(2);
  ASSERT_TRUE(pool.Submit([](const FutureCore&) { return Status::OK(); })->Wait(5s).ok());
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    Future f = pool.Submit([](const FutureCore&) { return Status::OK(); });
    const Status s = f->Wait(2s);
    const bool named = s.code() == StatusCode::kFailedPrecondition &&
                       s.message().find("forked this one") != std::string::npos;
    _exit(named ? 0 : 1);  // never destroys the pool: its threads are the parent's
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  EXPECT_TRUE(pool.Submit([](const FutureCore&) { return Status::OK(); })->Wait(5s).ok());
}

TEST(Future, ErrorsPropagate) {
  ThreadPool pool(2);
  Future f = pool.Submit([](const FutureCore&) { return Status::IOError("disk"); });
  EXPECT_EQ(f->Wait(5s).code(), StatusCode::kIOError);
}

TEST(Future, CancelPendingNeverRuns) {
  ThreadPool pool(1);
  std::atomic<bool> release{false};
  std::atomic<int> ran{0};
  Future blocker = pool.Submit([&](const FutureCore&) {
    while (!release) std::this_thread::sleep_for(1ms);
    return Status::OK();
  });
  Future victim = pool.Submit([&](const FutureCore&) {
    ++ran;
    return Status::OK();
  });
  EXPECT_TRUE(victim->Cancel());
  EXPECT_EQ(victim->Wait(0ns).code(), StatusCode::kCancelled);
  release = true;
  EXPECT_TRUE(blocker->Wait(5s).ok());
  EXPECT_TRUE(pool.Submit([](const FutureCore&) { return Status::OK(); })->Wait(5s).ok());
  EXPECT_EQ(ran.load(), 0);
}

TEST(Future, CancelRunningIsCooperative) {
  ThreadPool pool(1);
  std::atomic<bool> started{false};
  Future f = pool.Submit([&](const FutureCore& self) {
    started = true;
    while (!self.cancel_requested()) std::this_thread::sleep_for(1ms);
    return Status::Cancelled("stopped between chunks");
  });
  while (!started) std::this_thread::sleep_for(1ms);
  EXPECT_FALSE(f->Cancel());
  EXPECT_EQ(f->Wait(5s).code(), StatusCode::kCancelled);
}

TEST(Future, CallbacksRunOnceEvenWhenAddedLate) {
  ThreadPool pool(2);
  std::atomic<int> calls{0};
  Future f = pool.Submit([](const FutureCore&) { return Status::OK(); });
  f->OnComplete([&](const Status& s) { calls += s.ok(); });
  ASSERT_TRUE(f->Wait(5s).ok());
  f->OnComplete([&](const Status& s) { calls += s.ok(); });
  for (int i = 0; i < 100 && calls < 2; ++i) std::this_thread::sleep_for(1ms);
  EXPECT_EQ(calls.load(), 2);
}

TEST(Future, CleanupsRunBeforeAnyWaiterSeesCompletion) {
  ThreadPool pool(2);
  for (int round = 0; round < 200; ++round) {
    std::atomic<bool> released{false};
    std::atomic<bool> go{false};
    Future f = pool.Submit([&](const FutureCore&) {
      while (!go.load()) std::this_thread::yield();
      return Status::OK();
    });
    f->OnCleanup([&](const Status&) { released = true; });
    go = true;
    ASSERT_TRUE(f->Wait(5s).ok());
    EXPECT_TRUE(released.load()) << "round " << round;  // not merely eventually
    // Registered after completion: runs inline, at once.
    bool late = false;
    f->OnCleanup([&](const Status&) { late = true; });
    EXPECT_TRUE(late);
  }
}

TEST(ThreadPool, BatchReportsFirstError) {
  ThreadPool pool(2);
  std::vector<ThreadPool::Task> parts;
  std::atomic<int> ran{0};
  for (int i = 0; i < 10; ++i) {
    parts.push_back([&, i](const FutureCore&) {
      ++ran;
      return i == 3 ? Status::Corrupted("part 3") : Status::OK();
    });
  }
  Future f = pool.SubmitBatch(std::move(parts));
  EXPECT_EQ(f->Wait(5s).code(), StatusCode::kCorrupted);
  EXPECT_EQ(ran.load(), 10);
  EXPECT_TRUE(pool.SubmitBatch({})->Wait(0ns).ok());
}

TEST(ThreadPool, CancelQueuedBatchCompletesAtOnceAndSkipsParts) {
  ThreadPool pool(1);
  std::atomic<bool> release{false};
  Future blocker = pool.Submit([&](const FutureCore&) {
    while (!release) std::this_thread::sleep_for(1ms);
    return Status::OK();
  });
  std::atomic<int> ran{0};
  std::vector<ThreadPool::Task> parts(3, [&](const FutureCore&) {
    ++ran;
    return Status::OK();
  });
  Future batch = pool.SubmitBatch(std::move(parts));
  EXPECT_TRUE(batch->Cancel());
  EXPECT_EQ(batch->Wait(0ns).code(), StatusCode::kCancelled);
  release = true;
  ASSERT_TRUE(blocker->Wait(5s).ok());
  ASSERT_TRUE(pool.Submit([](const FutureCore&) { return Status::OK(); })->Wait(5s).ok());
  EXPECT_EQ(ran.load(), 0);
}

TEST(ThreadPool, ShutdownCancelsQueuedWork) {
  Future queued;
  {
    ThreadPool pool(1);
    pool.Submit([](const FutureCore&) {
      std::this_thread::sleep_for(50ms);
      return Status::OK();
    });
    queued = pool.Submit([](const FutureCore&) { return Status::OK(); });
  }
  EXPECT_TRUE(queued->done());
  EXPECT_EQ(queued->Wait(0ns).code(), StatusCode::kCancelled);
}

}  // namespace
}  // namespace tpusync::concurrency
