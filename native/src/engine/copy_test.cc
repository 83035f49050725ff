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
