#include "tpusync/memory/block_allocator.h"

#include <set>
#include <thread>

#include <gtest/gtest.h>

namespace tpusync::memory {
namespace {

std::unique_ptr<BlockAllocator> Make(size_t block_bytes, size_t blocks) {
  auto pool = HostPool::Create({.size_bytes = BlockAllocator::StrideFor(block_bytes) * blocks});
  EXPECT_TRUE(pool.ok());
  auto a = BlockAllocator::Create(std::move(*pool), block_bytes);
  EXPECT_TRUE(a.ok());
  return std::move(*a);
}

TEST(BlockAllocator, StrideAlignsForDirectIo) {
  EXPECT_EQ(BlockAllocator::StrideFor(100), 128u);
  EXPECT_EQ(BlockAllocator::StrideFor(4096), 4096u);
  EXPECT_EQ(BlockAllocator::StrideFor(5000), 8192u);
}

TEST(BlockAllocator, PoolBytesForRefusesSizesThatWrapAround) {
  EXPECT_EQ(*BlockAllocator::PoolBytesFor(100, 3), 384u);
  EXPECT_EQ(BlockAllocator::PoolBytesFor(4096, 0).status().code(), StatusCode::kInvalidArgument);
  // 2^52 + 1 blocks of 4 KiB used to wrap to a one-block pool.
  EXPECT_EQ(BlockAllocator::PoolBytesFor(4096, (size_t{1} << 52) + 1).status().code(),
            StatusCode::kInvalidArgument);
  auto wrap = BlockAllocator::PoolBytesFor(size_t{1} << 62, 8);
  EXPECT_EQ(wrap.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(wrap.status().message().find("do not fit in one address space"), std::string::npos);
  EXPECT_EQ(BlockAllocator::PoolBytesFor(~size_t{0} - 10, 1).status().code(),
            StatusCode::kInvalidArgument);  // the stride itself wraps
}

TEST(BlockAllocator, AllocatesDistinctAlignedBlocks) {
  auto a = Make(16384, 8);
  ASSERT_EQ(a->num_blocks(), 8u);
  auto ids = a->Alloc(8);
  ASSERT_TRUE(ids.ok());
  std::set<uint8_t*> addrs;
  for (BlockId id : *ids) {
    auto p = a->Address(id);
    ASSERT_TRUE(p.ok());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(*p) % 4096, 0u);
    addrs.insert(*p);
  }
  EXPECT_EQ(addrs.size(), 8u);
  EXPECT_EQ(a->num_free(), 0u);
}

TEST(BlockAllocator, ExhaustionNamesSizesAndChangesNothing) {
  auto a = Make(4096, 4);
  auto first = a->Alloc(3);
  ASSERT_TRUE(first.ok());
  auto r = a->Alloc(2);
  ASSERT_EQ(r.status().code(), StatusCode::kPoolExhausted);
  EXPECT_NE(r.status().message().find("requested 2 blocks of 4096 bytes"), std::string::npos);
  EXPECT_NE(r.status().message().find("pool size 16384"), std::string::npos);
  EXPECT_EQ(a->num_free(), 1u);
  EXPECT_EQ(a->stats().exhausted, 1u);
}

TEST(BlockAllocator, DoubleFreeAndUnknownIdsAreErrors) {
  auto a = Make(4096, 4);
  auto ids = *a->Alloc(2);
  ASSERT_TRUE(a->Free({&ids[0], 1}).ok());
  EXPECT_EQ(a->Free({&ids[0], 1}).code(), StatusCode::kFailedPrecondition);
  const BlockId unknown = 99;
  EXPECT_EQ(a->Free({&unknown, 1}).code(), StatusCode::kInvalidArgument);
  // A batch with one bad id frees nothing.
  std::vector<BlockId> batch = {ids[1], unknown};
  EXPECT_FALSE(a->Free(batch).ok());
  EXPECT_EQ(*a->RefCount(ids[1]), 1u);
  std::vector<BlockId> twice = {ids[1], ids[1]};
  EXPECT_EQ(a->Free(twice).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(*a->RefCount(ids[1]), 1u);
}

// OWNER COUNT RULE: a block of 2 owners freed three times in one batch was accepted: the slot was
// recycled at the second, the count wrapped at the third, and the next Alloc handed the same
// memory out while the stale id still passed as live.
TEST(BlockAllocator, ABatchNamingAnIdMoreOftenThanItsOwnersFreesNothing) {
  auto a = Make(4096, 2);
  BlockId id = (*a->Alloc(1))[0];
  ASSERT_TRUE(a->Retain({&id, 1}).ok());
  std::vector<BlockId> thrice = {id, id, id};
  const Status st = a->Free(thrice);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("appears 3 times in one free() call but has 2 owner(s)"),
            std::string::npos);
  EXPECT_EQ(*a->RefCount(id), 2u);
  EXPECT_EQ(a->num_free(), 1u);
  std::vector<BlockId> both = {id, id};  // exactly its owners: fine
  ASSERT_TRUE(a->Free(both).ok());
  EXPECT_EQ(a->num_free(), 2u);
}

TEST(BlockAllocator, StaleIdAfterReuseIsRefused) {
  auto a = Make(4096, 1);
  BlockId old = (*a->Alloc(1))[0];
  ASSERT_TRUE(a->Free({&old, 1}).ok());
  BlockId fresh = (*a->Alloc(1))[0];
  EXPECT_EQ(BlockAllocator::SlotOf(old), BlockAllocator::SlotOf(fresh));
  EXPECT_NE(old, fresh);
  EXPECT_EQ(a->Address(old).status().code(), StatusCode::kFailedPrecondition);
}

TEST(BlockAllocator, RefcountAndBorrowsDelayRecycling) {
  auto a = Make(4096, 1);
  BlockId id = (*a->Alloc(1))[0];
  ASSERT_TRUE(a->Retain({&id, 1}).ok());
  EXPECT_EQ(*a->RefCount(id), 2u);
  ASSERT_TRUE(a->AcquireBorrow({&id, 1}).ok());
  ASSERT_TRUE(a->Free({&id, 1}).ok());
  ASSERT_TRUE(a->Free({&id, 1}).ok());
  // Owners gone, a borrow remains: not reusable yet, and no new borrows.
  EXPECT_EQ(a->num_free(), 0u);
  EXPECT_EQ(a->AcquireBorrow({&id, 1}).code(), StatusCode::kFailedPrecondition);
  a->ReleaseBorrow({&id, 1});
  EXPECT_EQ(a->num_free(), 1u);
}

TEST(BlockAllocator, ClaimTakesASpecificSlot) {
  auto a = Make(4096, 4);
  auto id = a->Claim(2);
  ASSERT_TRUE(id.ok());
  EXPECT_EQ(BlockAllocator::SlotOf(*id), 2u);
  EXPECT_EQ(a->Claim(2).status().code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(a->num_free(), 3u);
  auto rest = a->Alloc(3);
  ASSERT_TRUE(rest.ok());
  for (BlockId r : *rest) EXPECT_NE(BlockAllocator::SlotOf(r), 2u);
}

TEST(BlockAllocator, ConcurrentAllocFreeKeepsCounts) {
  auto a = Make(4096, 64);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 2000; ++i) {
        auto ids = a->Alloc(4);
        if (ids.ok()) EXPECT_TRUE(a->Free(*ids).ok());
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(a->num_free(), 64u);
}

}  // namespace
}  // namespace tpusync::memory
