#include "tpusync/engine/block_transfer.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <numeric>

#include <gtest/gtest.h>

namespace tpusync::engine {
namespace {

using namespace std::chrono_literals;

std::shared_ptr<memory::BlockAllocator> MakeBlocks(size_t block_bytes, size_t n) {
  auto host =
      memory::HostPool::Create({.size_bytes = memory::BlockAllocator::StrideFor(block_bytes) * n});
  EXPECT_TRUE(host.ok());
  return std::shared_ptr<memory::BlockAllocator>(
      std::move(*memory::BlockAllocator::Create(std::move(*host), block_bytes)));
}

// K/V split on an outer axis: [2, num_blocks, 256] bytes; host block b = K row then V row.
TEST(SegmentTransfer, GathersSplitKVAndScattersBack) {
  ThreadPool pool(2);
  auto blocks = MakeBlocks(512, 4);
  auto ids = *blocks->Alloc(2);
  std::vector<uint8_t> cache(2 * 5 * 256);
  std::iota(cache.begin(), cache.end(), 0);
  const uint64_t device_blocks[2] = {4, 1};
  SegmentList list{{{cache.data(), cache.size()}}, {}};
  for (uint64_t i = 0; i < 2; ++i) {
    for (uint64_t kv = 0; kv < 2; ++kv) {
      list.segments.push_back({i, kv * 256, 0, (kv * 5 + device_blocks[i]) * 256, 256});
    }
  }
  ASSERT_TRUE(PutSegments(pool, blocks, ids, list)->Wait(5s).ok());
  const uint8_t* b0 = blocks->SlotAddress(memory::BlockAllocator::SlotOf(ids[0]));
  EXPECT_EQ(std::memcmp(b0, cache.data() + 4 * 256, 256), 0);
  EXPECT_EQ(std::memcmp(b0 + 256, cache.data() + (5 + 4) * 256, 256), 0);

  std::vector<uint8_t> out(cache.size(), 0);
  list.regions = {{out.data(), out.size()}};
  ASSERT_TRUE(GetSegments(pool, blocks, ids, list)->Wait(5s).ok());
  for (uint64_t kv = 0; kv < 2; ++kv) {
    for (uint64_t b : device_blocks) {
      const size_t off = (kv * 5 + b) * 256;
      EXPECT_EQ(std::memcmp(out.data() + off, cache.data() + off, 256), 0);
    }
  }
  EXPECT_EQ(out[0], 0);  // block 0 was not part of the batch
  EXPECT_EQ(blocks->stats().num_borrowed, 0u);
}

TEST(SegmentTransfer, EveryBoundIsCheckedBeforeAnyByteMoves) {
  ThreadPool pool(2);
  auto blocks = MakeBlocks(4096, 2);
  auto ids = *blocks->Alloc(1);
  std::memset(blocks->SlotAddress(memory::BlockAllocator::SlotOf(ids[0])), 7, 4096);
  std::vector<uint8_t> region(8192, 9);
  auto run = [&](Segment bad) {
    // A good segment first: it must not run either.
    SegmentList list{{{region.data(), region.size()}}, {{0, 0, 0, 0, 100}, bad}};
    return GetSegments(pool, blocks, ids, list)->Wait(5s).code();
  };
  EXPECT_EQ(run({1, 0, 0, 0, 1}), StatusCode::kInvalidArgument);             // block index
  EXPECT_EQ(run({0, 4000, 0, 0, 97}), StatusCode::kInvalidArgument);         // past block end
  EXPECT_EQ(run({0, 0, 1, 0, 1}), StatusCode::kInvalidArgument);             // region index
  EXPECT_EQ(run({0, 0, 0, 8190, 3}), StatusCode::kInvalidArgument);          // past region end
  EXPECT_EQ(run({0, 1, 0, ~uint64_t{0}, 2}), StatusCode::kInvalidArgument);  // overflow
  EXPECT_TRUE(std::all_of(region.begin(), region.end(), [](uint8_t b) { return b == 9; }));
  std::vector<memory::BlockId> stale = {ids[0] + (uint64_t{1} << 32)};
  SegmentList ok{{{region.data(), region.size()}}, {{0, 0, 0, 0, 10}}};
  EXPECT_NE(GetSegments(pool, blocks, stale, ok)->Wait(5s).code(), StatusCode::kOk);
  EXPECT_TRUE(std::all_of(region.begin(), region.end(), [](uint8_t b) { return b == 9; }));
  EXPECT_TRUE(GetSegments(pool, blocks, ids, ok)->Wait(5s).ok());
  EXPECT_EQ(region[0], 7);
  EXPECT_EQ(region[10], 9);
  EXPECT_EQ(blocks->stats().num_borrowed, 0u);
}

TEST(SegmentTransfer, ManySmallSegmentsAcrossWorkers) {
  ThreadPool pool(3);
  constexpr size_t kBlock = 64 << 10, kSeg = 1000;
  auto blocks = MakeBlocks(kBlock, 8);
  auto ids = *blocks->Alloc(8);
  std::vector<uint8_t> src(8 * kBlock), back(8 * kBlock, 0);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 31 + 3);
  SegmentList list{{{src.data(), src.size()}}, {}};
  for (uint64_t b = 0; b < 8; ++b) {
    for (uint64_t off = 0; off < kBlock; off += kSeg) {
      // Host block b takes source block 7 - b.
      list.segments.push_back(
          {b, off, 0, (7 - b) * kBlock + off, std::min<uint64_t>(kSeg, kBlock - off)});
    }
  }
  ASSERT_TRUE(PutSegments(pool, blocks, ids, list)->Wait(5s).ok());
  list.regions = {{back.data(), back.size()}};
  ASSERT_TRUE(GetSegments(pool, blocks, ids, list)->Wait(5s).ok());
  EXPECT_EQ(std::memcmp(src.data(), back.data(), src.size()), 0);
}

// Runs that coalesce (consecutive rows into consecutive pool slots) next to runs that must not
// (a repeated source row, a reversed pair): every byte lands where its own segment says.
TEST(SegmentTransfer, CoalescedAndUnmergeableRunsMoveTheRightBytes) {
  ThreadPool pool(2);
  constexpr size_t kBlock = 8192;
  auto blocks = MakeBlocks(kBlock, 6);
  auto ids = *blocks->Alloc(6);
  std::vector<uint8_t> src(6 * kBlock), back(6 * kBlock, 0);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 13 + 5);
  // Host blocks 0..2 <- rows 0..2 (mergeable when the slots are back to back), block 3 <- row 0
  // again, blocks 4 and 5 <- rows 5 and 4; each block copied as two half-block segments.
  const uint64_t rows[6] = {0, 1, 2, 0, 5, 4};
  SegmentList list{{{src.data(), src.size()}}, {}};
  for (uint64_t b = 0; b < 6; ++b) {
    for (uint64_t half = 0; half < 2; ++half) {
      list.segments.push_back(
          {b, half * kBlock / 2, 0, rows[b] * kBlock + half * kBlock / 2, kBlock / 2});
    }
  }
  ASSERT_TRUE(PutSegments(pool, blocks, ids, list)->Wait(5s).ok());
  SegmentList out{{{back.data(), back.size()}}, {}};
  for (uint64_t b = 0; b < 6; ++b) out.segments.push_back({b, 0, 0, b * kBlock, kBlock});
  ASSERT_TRUE(GetSegments(pool, blocks, ids, out)->Wait(5s).ok());
  for (uint64_t b = 0; b < 6; ++b) {
    EXPECT_EQ(std::memcmp(back.data() + b * kBlock, src.data() + rows[b] * kBlock, kBlock), 0)
        << "host block " << b;
  }
}

// A batch whose valid segments would all coalesce still moves nothing when one segment is out of
// range: the bounds are checked before any span is built.
TEST(SegmentTransfer, OutOfRangeSegmentAmongMergeableOnesMovesNothing) {
  ThreadPool pool(2);
  constexpr size_t kBlock = 4096;
  auto blocks = MakeBlocks(kBlock, 4);
  auto ids = *blocks->Alloc(4);
  std::vector<uint8_t> src(4 * kBlock, 7), back(4 * kBlock, 1);
  SegmentList zero{{{back.data(), back.size()}}, {}};
  std::vector<uint8_t> zeros(4 * kBlock, 0);
  SegmentList clear{{{zeros.data(), zeros.size()}}, {}};
  for (uint64_t b = 0; b < 4; ++b) clear.segments.push_back({b, 0, 0, b * kBlock, kBlock});
  ASSERT_TRUE(PutSegments(pool, blocks, ids, clear)->Wait(5s).ok());
  SegmentList list{{{src.data(), src.size()}}, {}};
  for (uint64_t b = 0; b < 4; ++b) list.segments.push_back({b, 0, 0, b * kBlock, kBlock});
  list.segments.push_back({4, 0, 0, 0, 16});  // block 4 of a batch of 4
  EXPECT_EQ(PutSegments(pool, blocks, ids, list)->Wait(5s).code(), StatusCode::kInvalidArgument);
  list.segments.back() = {3, 0, 0, 4 * kBlock - 8, 16};  // past the region's end
  EXPECT_EQ(PutSegments(pool, blocks, ids, list)->Wait(5s).code(), StatusCode::kInvalidArgument);
  zero.segments = clear.segments;
  ASSERT_TRUE(GetSegments(pool, blocks, ids, zero)->Wait(5s).ok());
  EXPECT_TRUE(std::all_of(back.begin(), back.end(), [](uint8_t v) { return v == 0; }));
  EXPECT_EQ(blocks->stats().num_borrowed, 0u);
}

}  // namespace
}  // namespace tpusync::engine
