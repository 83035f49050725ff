#include "tpusync/engine/copy.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <numeric>

#include <gtest/gtest.h>

#include "tpusync/engine/block_transfer.h"

namespace tpusync::engine {
namespace {

using namespace std::chrono_literals;

TEST(Copy, PartitionBalancesBytesAndCoversEverything) {
  std::vector<uint8_t> src(10 << 20), dst(10 << 20);
  std::vector<CopySpan> spans = {{dst.data(), src.data(), 9 << 20},
                                 {dst.data() + (9 << 20), src.data() + (9 << 20), 1 << 20}};
  auto parts = PartitionCopies(spans, 4, 1 << 20);
  ASSERT_EQ(parts.size(), 4u);
  size_t total = 0;
  for (auto& p : parts) {
    size_t bytes = 0;
    for (auto& s : p) bytes += s.bytes;
    EXPECT_LE(bytes, (10u << 20) / 4 + (1u << 20));
    total += bytes;
  }
  EXPECT_EQ(total, 10u << 20);
}

TEST(Copy, CoalesceMergesOnlyRunsAdjacentOnBothSides) {
  std::vector<uint8_t> src(1 << 16), dst(1 << 16);
  uint8_t* d = dst.data();
  const uint8_t* s = src.data();
  auto merged = CoalesceSpans({{d, s, 100},
                               {d + 100, s + 100, 50},    // both sides back to back: merges
                               {d + 150, s + 150, 0},     // empty: dropped, no break
                               {d + 150, s + 150, 10},    // merges across the empty one
                               {d + 160, s + 300, 20},    // destination adjacent only
                               {d + 400, s + 320, 20},    // source adjacent only
                               {d + 380, s + 300, 20}});  // adjacent, but before: order is kept
  ASSERT_EQ(merged.size(), 4u);
  EXPECT_EQ(merged[0].dst, d);
  EXPECT_EQ(merged[0].src, s);
  EXPECT_EQ(merged[0].bytes, 160u);
  EXPECT_EQ(merged[1].dst, d + 160);
  EXPECT_EQ(merged[1].bytes, 20u);
  EXPECT_EQ(merged[2].dst, d + 400);
  EXPECT_EQ(merged[3].dst, d + 380);
  EXPECT_TRUE(CoalesceSpans({}).empty());
  EXPECT_TRUE(CoalesceSpans({{d, s, 0}}).empty());
}

TEST(Copy, CoalesceKeepsStridedRunsApart) {
  // A [heads, blocks, run] source gathered block-major into contiguous host rows: the
  // destination is back to back, the source jumps a head plane, so nothing merges.
  constexpr size_t kHeads = 4, kBlocks = 8, kRun = 256;
  std::vector<uint8_t> src(kHeads * kBlocks * kRun), dst(kHeads * kBlocks * kRun);
  std::vector<CopySpan> spans;
  for (size_t b = 0; b < kBlocks; ++b) {
    for (size_t h = 0; h < kHeads; ++h) {
      spans.push_back(
          {dst.data() + (b * kHeads + h) * kRun, src.data() + (h * kBlocks + b) * kRun, kRun});
    }
  }
  EXPECT_EQ(CoalesceSpans(spans).size(), spans.size());
  // The same runs with one head: consecutive blocks are consecutive on both sides.
  std::vector<CopySpan> one;
  for (size_t b = 0; b < kBlocks; ++b) {
    one.push_back({dst.data() + b * kRun, src.data() + b * kRun, kRun});
  }
  auto merged = CoalesceSpans(one);
  ASSERT_EQ(merged.size(), 1u);
  EXPECT_EQ(merged[0].bytes, kBlocks * kRun);
}

TEST(Copy, CopyAsyncCopiesEveryByte) {
  ThreadPool pool(3);
  std::vector<uint8_t> src(3 << 20), dst(3 << 20, 0);
  std::iota(src.begin(), src.end(), 0);
  std::vector<CopySpan> spans;
  for (size_t off = 0; off < src.size(); off += 100000) {
    spans.push_back(
        {dst.data() + off, src.data() + off, std::min<size_t>(100000, src.size() - off)});
  }
  ASSERT_TRUE(CopyAsync(pool, spans)->Wait(5s).ok());
  EXPECT_EQ(std::memcmp(src.data(), dst.data(), src.size()), 0);
}

TEST(BlockTransfer, PutGetRoundTripAndBadIdMovesNothing) {
  ThreadPool pool(2);
  auto host = memory::HostPool::Create({.size_bytes = 8 * 65536});
  ASSERT_TRUE(host.ok());
  std::shared_ptr<memory::BlockAllocator> blocks(
      std::move(*memory::BlockAllocator::Create(std::move(*host), 65536)));
  auto ids = *blocks->Alloc(4);
  std::vector<uint8_t> src(4 * 65536), back(4 * 65536, 0);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 7 + 1);
  ASSERT_TRUE(PutBlocks(pool, blocks, ids, {src.data(), 65536, 4, {}})->Wait(5s).ok());
  std::vector<memory::BlockId> reversed(ids.rbegin(), ids.rend());
  ASSERT_TRUE(GetBlocks(pool, blocks, reversed, {back.data(), 65536, 4, {}})->Wait(5s).ok());
  for (size_t b = 0; b < 4; ++b) {
    EXPECT_EQ(std::memcmp(back.data() + b * 65536, src.data() + (3 - b) * 65536, 65536), 0);
  }
  std::vector<memory::BlockId> bad = {ids[0], 12345};
  std::vector<uint8_t> zeros(2 * 65536, 0);
  EXPECT_EQ(PutBlocks(pool, blocks, bad, {zeros.data(), 65536, 2, {}})->Wait(5s).code(),
            StatusCode::kInvalidArgument);
  ASSERT_TRUE(GetBlocks(pool, blocks, {ids[0]}, {back.data(), 65536, 1, {}})->Wait(5s).ok());
  EXPECT_EQ(std::memcmp(back.data(), src.data(), 65536), 0);
  EXPECT_EQ(blocks->stats().num_borrowed, 0u);
}

TEST(BlockTransfer, RowGatherScatterAndRangeCheckBeforeAnyByteMoves) {
  ThreadPool pool(2);
  auto host = memory::HostPool::Create({.size_bytes = 4 * 4096});
  ASSERT_TRUE(host.ok());
  std::shared_ptr<memory::BlockAllocator> blocks(
      std::move(*memory::BlockAllocator::Create(std::move(*host), 4096)));
  auto ids = *blocks->Alloc(2);
  std::vector<uint8_t> cache(5 * 4096);
  for (size_t r = 0; r < 5; ++r) std::fill_n(cache.data() + r * 4096, 4096, uint8_t(r + 1));
  ASSERT_TRUE(PutBlocks(pool, blocks, ids, {cache.data(), 4096, 5, {4, 1}})->Wait(5s).ok());
  EXPECT_EQ(blocks->SlotAddress(memory::BlockAllocator::SlotOf(ids[0]))[7], 5);
  EXPECT_EQ(blocks->SlotAddress(memory::BlockAllocator::SlotOf(ids[1]))[7], 2);
  std::vector<uint8_t> out(5 * 4096, 0);
  ASSERT_TRUE(GetBlocks(pool, blocks, ids, {out.data(), 4096, 5, {0, 3}})->Wait(5s).ok());
  EXPECT_EQ(out[0], 5);
  EXPECT_EQ(out[3 * 4096], 2);
  EXPECT_EQ(out[4096], 0);
  std::vector<uint8_t> untouched(5 * 4096, 9);
  EXPECT_EQ(GetBlocks(pool, blocks, ids, {untouched.data(), 4096, 5, {0, 5}})->Wait(5s).code(),
            StatusCode::kInvalidArgument);
  EXPECT_TRUE(std::all_of(untouched.begin(), untouched.end(), [](uint8_t b) { return b == 9; }));
  EXPECT_EQ(GetBlocks(pool, blocks, ids, {untouched.data(), 4096, 5, {0}})->Wait(5s).code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tpusync::engine
