#include "tpusync/memory/host_pool.h"

#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>

#include <gtest/gtest.h>

namespace tpusync::memory {
namespace {

std::string UniqueName(const char* tag) {
  return std::string("tpusync-test-") + tag + "-" + std::to_string(getpid());
}

bool Resident(uint8_t* data, size_t size) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> vec((size + page - 1) / page);
  if (mincore(data, size, vec.data()) != 0) return false;
  for (unsigned char v : vec) {
    if (!(v & 1)) return false;
  }
  return true;
}

TEST(HostPool, AnonymousIsPrefaultedAndRoundedToPages) {
  auto pool = HostPool::Create({.size_bytes = 1000000});
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  EXPECT_EQ((*pool)->size() % static_cast<size_t>(sysconf(_SC_PAGESIZE)), 0u);
  EXPECT_GE((*pool)->size(), 1000000u);
  EXPECT_TRUE(Resident((*pool)->data(), (*pool)->size()));
  EXPECT_FALSE((*pool)->attached());
}

TEST(HostPool, ZeroSizeIsRefused) {
  EXPECT_EQ(HostPool::Create({.size_bytes = 0}).status().code(), StatusCode::kInvalidArgument);
}

TEST(HostPool, BadShmNameIsRefused) {
  auto pool = HostPool::Create({.size_bytes = 4096, .shm_name = "../etc/passwd"});
  EXPECT_EQ(pool.status().code(), StatusCode::kInvalidArgument);
}

TEST(HostPool, ShmSegmentReattachesWithItsBytes) {
  const std::string name = UniqueName("reattach");
  {
    auto pool = HostPool::Create({.size_bytes = 1 << 20, .shm_name = name, .persist = true});
    ASSERT_TRUE(pool.ok()) << pool.status().ToString();
    std::memcpy((*pool)->data() + 4096, "warm", 4);
  }
  auto again = HostPool::Create({.size_bytes = 1 << 20, .shm_name = name});
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_TRUE((*again)->attached());
  EXPECT_EQ(std::memcmp((*again)->data() + 4096, "warm", 4), 0);
  EXPECT_TRUE(Resident((*again)->data(), (*again)->size()));
  again->reset();  // persist=false: unlinked now
  auto fresh = HostPool::Create({.size_bytes = 1 << 20, .shm_name = name});
  ASSERT_TRUE(fresh.ok());
  EXPECT_FALSE((*fresh)->attached());
}

TEST(HostPool, ShmSizeMismatchIsAnErrorNotAResize) {
  const std::string name = UniqueName("mismatch");
  auto a = HostPool::Create({.size_bytes = 1 << 20, .shm_name = name});
  ASSERT_TRUE(a.ok());
  auto b = HostPool::Create({.size_bytes = 2 << 20, .shm_name = name});
  EXPECT_EQ(b.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(b.status().message().find("1048576"), std::string::npos);
  auto c = HostPool::Create({.size_bytes = 1 << 20, .shm_name = name, .attach_existing = false});
  EXPECT_EQ(c.status().code(), StatusCode::kAlreadyExists);
}

// ONE POOL PER SEGMENT: a second pool on a live pool's segment was attached silently, and each
// handed out the same blocks (one's writes landed in the other's); a persist=false first pool
// then unlinked the name under the second.
TEST(HostPool, ASegmentALivePoolOwnsIsNotAttachedAgain) {
  const std::string name = UniqueName("owned");
  auto a = HostPool::Create({.size_bytes = 1 << 20, .shm_name = name, .persist = true});
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  auto b = HostPool::Create({.size_bytes = 1 << 20, .shm_name = name});
  EXPECT_EQ(b.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(b.status().message().find("is in use by a live pool"), std::string::npos);
  a->reset();  // its owner lock goes with it: a warm restart attaches
  auto c = HostPool::Create({.size_bytes = 1 << 20, .shm_name = name});
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_TRUE((*c)->attached());
}

TEST(HostPool, HugePagesAndMlockAreBestEffort) {
  auto pool = HostPool::Create({.size_bytes = 4 << 20, .huge_pages = true, .mlock = true});
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  std::memset((*pool)->data(), 1, (*pool)->size());
}

// HUGE-PAGE CONTRACT: a shared segment asked for huge pages is mapped 2 MiB-aligned and the
// collapse (where the kernel grants it) keeps every byte, so a warm re-attach still sees them.
TEST(HostPool, ShmHugePagesAreAlignedAndKeepTheBytes) {
  const std::string name = UniqueName("huge");
  const size_t size = 6 << 20;
  {
    auto a = HostPool::Create(
        {.size_bytes = size, .shm_name = name, .persist = true, .huge_pages = true});
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    EXPECT_EQ(reinterpret_cast<uintptr_t>((*a)->data()) % (2 << 20), 0u);
    // Written while the background collapse may still run: the bytes must survive it.
    for (size_t i = 0; i < size; i += 4096) (*a)->data()[i] = static_cast<uint8_t>(i / 4096);
    EXPECT_TRUE((*a)->WaitHugePages(std::chrono::seconds(60)));
    EXPECT_FALSE((*a)->collapsing());
  }
  auto b = HostPool::Create({.size_bytes = size, .shm_name = name, .huge_pages = true});
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_TRUE((*b)->attached());
  EXPECT_EQ(reinterpret_cast<uintptr_t>((*b)->data()) % (2 << 20), 0u);
  for (size_t i = 0; i < size; i += 4096) {
    ASSERT_EQ((*b)->data()[i], static_cast<uint8_t>(i / 4096)) << i;
  }
}

TEST(HostPool, ShmPoolIsUsableAtOnceAndDestroyedMidCollapse) {
  // HUGE-PAGE CONTRACT: Create does not wait for the collapse; destruction stops it between
  // steps. Repeated so that some destructions land while it runs (no crash, no hang).
  for (int round = 0; round < 3; ++round) {
    const std::string name = UniqueName("collapse");
    const size_t size = size_t{96} << 20;
    auto a = HostPool::Create({.size_bytes = size, .shm_name = name, .huge_pages = true});
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    std::memset((*a)->data(), 0x5a, size);  // usable right away
    for (size_t i = 0; i < size; i += size_t{1} << 20) ASSERT_EQ((*a)->data()[i], 0x5a) << i;
    if (round == 2) {
      ASSERT_TRUE((*a)->WaitHugePages(std::chrono::seconds(60)));
      for (size_t i = 0; i < size; i += 4096) ASSERT_EQ((*a)->data()[i], 0x5a) << i;
    }
  }
}

TEST(HostPool, AnonymousPoolsStartNoCollapse) {
  auto a = HostPool::Create({.size_bytes = size_t{4} << 20, .huge_pages = true});
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_FALSE((*a)->collapsing());
  EXPECT_TRUE((*a)->WaitHugePages(std::chrono::milliseconds(0)));
}

}  // namespace
}  // namespace tpusync::memory
