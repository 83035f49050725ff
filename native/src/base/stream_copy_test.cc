#include "tpusync/base/stream_copy.h"

#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>

namespace tpusync {
namespace {

using RunsFn = void (*)(const StreamRun*, size_t);

// Runs of every awkward length (empty, under a line, a line +- 1, a page +- 1, several pages)
// at every alignment of source and destination, scattered over a buffer in shuffled order (the
// lanes interleave runs and pieces of runs): each run lands exactly, bytes between runs are
// untouched.
void CheckScatteredRuns(RunsFn fn) {
  const size_t lengths[] = {0,    1,    63,   64,   65,    127,           4095,
                            4096, 4097, 8192, 8191, 12345, 3 * 4096 + 64, 100000};
  std::mt19937 rng(7);
  std::vector<uint8_t> src(1 << 20), dst(1 << 21, 0xEE), want(1 << 21, 0xEE);
  for (auto& b : src) b = static_cast<uint8_t>(rng());
  std::vector<StreamRun> runs;
  size_t d_off = 3, s_off = 0;
  for (int rep = 0; rep < 3; ++rep) {
    for (size_t len : lengths) {
      runs.push_back({dst.data() + d_off, src.data() + s_off, len});
      std::memcpy(want.data() + d_off, src.data() + s_off, len);
      d_off += len + 1 + (rng() % 97);  // a gap: bytes no run may touch
      s_off = (s_off + 4096 + (rng() % 61)) % (src.size() - 100000);
    }
  }
  ASSERT_LT(d_off, dst.size());
  std::shuffle(runs.begin(), runs.end(), rng);
  fn(runs.data(), runs.size());
  StreamFence();
  EXPECT_EQ(std::memcmp(dst.data(), want.data(), dst.size()), 0);
}

TEST(StreamStoreRuns, ScatteredRunsOfEveryLengthAndAlignment) {
  CheckScatteredRuns(&StreamStoreRuns);
}

TEST(StreamStoreRuns, Sse2LineCopyMatches) { CheckScatteredRuns(&StreamStoreRunsSse2); }

TEST(StreamStoreRuns, GatherOfStridedRunsIntoContiguousRows) {
  // [heads, blocks, run] source, blocks 0, 2, 4 gathered block-major into contiguous rows: the
  // layout the KV cache gather produces (runs adjacent on the destination side only).
  constexpr size_t kHeads = 8, kBlocks = 6, kRun = 8192;
  std::vector<uint8_t> src(kHeads * kBlocks * kRun), dst(kHeads * 3 * kRun, 0);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 2654435761u >> 13);
  std::vector<StreamRun> runs;
  for (size_t b = 0; b < 3; ++b) {
    for (size_t h = 0; h < kHeads; ++h) {
      runs.push_back(
          {dst.data() + (b * kHeads + h) * kRun, src.data() + (h * kBlocks + 2 * b) * kRun, kRun});
    }
  }
  StreamStoreRuns(runs.data(), runs.size());
  StreamFence();
  for (size_t b = 0; b < 3; ++b) {
    for (size_t h = 0; h < kHeads; ++h) {
      ASSERT_EQ(std::memcmp(dst.data() + (b * kHeads + h) * kRun,
                            src.data() + (h * kBlocks + 2 * b) * kRun, kRun),
                0)
          << "block " << b << " head " << h;
    }
  }
}

}  // namespace
}  // namespace tpusync
