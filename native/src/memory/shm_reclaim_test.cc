#include "tpusync/memory/shm_reclaim.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <string>

#include <gtest/gtest.h>

#include "tpusync/memory/host_pool.h"

namespace tpusync::memory {
namespace {

constexpr size_t kBytes = 1 << 20;

bool Exists(const std::string& name) {
  struct stat st {};
  return stat(("/dev/shm/" + name).c_str(), &st) == 0;
}

std::vector<std::string> Names(const std::vector<ShmSegment>& got) {
  std::vector<std::string> out;
  for (const auto& r : got) out.push_back(r.name);
  std::sort(out.begin(), out.end());
  return out;
}

// Forks a child that creates a non-persistent pool `name` holding `tag` at offset 0, then either
// dies by SIGKILL at once (no destructor, no exit handler) or, with the pipe `hold`, waits for
// the parent to close its write end before dying the same way. Returns the child's pid once
// the pool exists (the child reports on `ready`).
pid_t ForkOwner(const std::string& name, const char* tag, const int* hold) {
  int ready[2];
  if (pipe(ready) != 0) return -1;
  const pid_t pid = fork();
  if (pid == 0) {
    close(ready[0]);
    if (hold != nullptr) close(hold[1]);  // EOF on hold[0] once the parent closes its end
    auto pool = HostPool::Create({.size_bytes = kBytes, .shm_name = name});
    if (!pool.ok()) _exit(3);
    std::memcpy((*pool)->data(), tag, std::strlen(tag) + 1);
    char c = 1;
    (void)!write(ready[1], &c, 1);
    if (hold != nullptr) (void)!read(hold[0], &c, 1);
    kill(getpid(), SIGKILL);
  }
  close(ready[1]);
  char c = 0;
  const bool ok = read(ready[0], &c, 1) == 1;
  close(ready[0]);
  return ok ? pid : -1;
}

TEST(ShmReclaim, ShortOrBadPrefixIsRefused) {
  EXPECT_EQ(ReclaimStaleSegments("tpu").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ReclaimStaleSegments("").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ReclaimStaleSegments("tpusync-../x").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ListSegments("tpu").status().code(), StatusCode::kInvalidArgument);
}

TEST(ShmReclaim, OnlySegmentsOfDeadOwnersAreReclaimedAndPeerMappingsSurvive) {
  const std::string prefix = "tpusync-test-reclaim-" + std::to_string(getpid()) + "-";
  // A live pool of this process.
  auto live = HostPool::Create({.size_bytes = kBytes, .shm_name = prefix + "live"});
  ASSERT_TRUE(live.ok()) << live.status().ToString();
  // A live pool of another process, which dies only when told to.
  int hold[2];
  ASSERT_EQ(pipe(hold), 0);
  const pid_t alive = ForkOwner(prefix + "alive", "alive", hold);
  close(hold[0]);
  ASSERT_GT(alive, 0);
  // A pool whose process was killed: nothing ran, the segment stays in /dev/shm.
  const pid_t dead = ForkOwner(prefix + "dead", "dead", nullptr);
  ASSERT_GT(dead, 0);
  int status = 0;
  ASSERT_EQ(waitpid(dead, &status, 0), dead);
  ASSERT_TRUE(WIFSIGNALED(status));
  ASSERT_TRUE(Exists(prefix + "dead"));

  // A peer maps the dead owner's segment by name (as a P/D consumer does) before the reclaim.
  const int fd = shm_open(("/" + prefix + "dead").c_str(), O_RDONLY, 0);
  ASSERT_GE(fd, 0);
  void* peer = mmap(nullptr, kBytes, PROT_READ, MAP_SHARED, fd, 0);
  close(fd);
  ASSERT_NE(peer, MAP_FAILED);

  // The operator's view first: three segments, the dead owner's without a live owner; nothing
  // is removed by looking.
  auto seen = ListSegments(prefix);
  ASSERT_TRUE(seen.ok()) << seen.status().ToString();
  ASSERT_EQ(Names(*seen),
            (std::vector<std::string>{prefix + "alive", prefix + "dead", prefix + "live"}));
  EXPECT_TRUE((*seen)[0].owned);
  EXPECT_FALSE((*seen)[1].owned);
  EXPECT_TRUE((*seen)[2].owned);
  EXPECT_EQ((*seen)[1].bytes, kBytes);
  ASSERT_TRUE(Exists(prefix + "dead"));

  auto got = ReclaimStaleSegments(prefix);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(Names(*got), std::vector<std::string>{prefix + "dead"});
  EXPECT_EQ((*got)[0].bytes, kBytes);
  EXPECT_FALSE(Exists(prefix + "dead"));
  EXPECT_TRUE(Exists(prefix + "live"));
  EXPECT_TRUE(Exists(prefix + "alive"));
  EXPECT_STREQ(static_cast<const char*>(peer), "dead");  // the mapping outlives the name
  munmap(peer, kBytes);

  // The other owner dies too: now its segment goes, the live one of this process still stays.
  close(hold[1]);
  ASSERT_EQ(waitpid(alive, &status, 0), alive);
  got = ReclaimStaleSegments(prefix);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(Names(*got), std::vector<std::string>{prefix + "alive"});
  EXPECT_TRUE(Exists(prefix + "live"));
  live->reset();
  EXPECT_FALSE(Exists(prefix + "live"));
  got = ReclaimStaleSegments(prefix);
  ASSERT_TRUE(got.ok());
  EXPECT_TRUE(got->empty());
}

TEST(ShmReclaim, AnAttachingPoolBecomesTheOwner) {
  const std::string prefix = "tpusync-test-reattach-" + std::to_string(getpid()) + "-";
  const pid_t dead = ForkOwner(prefix + "seg", "warm", nullptr);
  ASSERT_GT(dead, 0);
  int status = 0;
  ASSERT_EQ(waitpid(dead, &status, 0), dead);
  // A new pool of the same name and size re-attaches the dead owner's segment (its bytes kept)
  // and from then on owns it: a sweep leaves it alone.
  auto again = HostPool::Create({.size_bytes = kBytes, .shm_name = prefix + "seg"});
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_TRUE((*again)->attached());
  EXPECT_STREQ(reinterpret_cast<const char*>((*again)->data()), "warm");
  auto got = ReclaimStaleSegments(prefix);
  ASSERT_TRUE(got.ok());
  EXPECT_TRUE(got->empty());
  again->reset();
  EXPECT_FALSE(Exists(prefix + "seg"));
}

}  // namespace
}  // namespace tpusync::memory
