#include "tpusync/base/checksum.h"

#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "tpusync/base/stream_copy.h"

namespace tpusync {
namespace {

// The fused copy must give byte-identical data and the one-shot digest at every size, including
// sizes below XXH3's short-input paths, at chunk boundaries and between them.
TEST(Checksum, FusedCopyMatchesCopyThenHash) {
  std::mt19937 rng(3);
  const size_t sizes[] = {0,
                          1,
                          16,
                          17,
                          128,
                          129,
                          240,
                          241,
                          1024,
                          4096,
                          kFusedChunkBytes - 1,
                          kFusedChunkBytes,
                          kFusedChunkBytes + 1,
                          3 * kFusedChunkBytes + 77,
                          256 << 10};
  for (size_t n : sizes) {
    std::vector<uint8_t> src(n + 1), dst(n + 1, 0xEE);
    for (auto& b : src) b = static_cast<uint8_t>(rng());
    for (uint64_t seed : {0ull, 42ull}) {
      const uint64_t sum = CopyWithChecksum64(dst.data(), src.data(), n, seed);
      EXPECT_EQ(sum, Checksum64(src.data(), n, seed)) << n;
      EXPECT_EQ(std::memcmp(dst.data(), src.data(), n), 0) << n;
      EXPECT_EQ(dst[n], 0xEE) << "wrote past the end at " << n;
    }
  }
}

// Non-temporal copies: every byte right for any size around the thresholds and every source /
// destination misalignment, nothing written past the end.
TEST(StreamCopy, CopiesExactlyAtAnySizeAndAlignment) {
  std::mt19937 rng(5);
  const size_t sizes[] = {0,
                          1,
                          15,
                          16,
                          63,
                          64,
                          65,
                          4095,
                          kStreamMinBytes - 1,
                          kStreamMinBytes,
                          kStreamMinBytes + 33,
                          (1 << 20) + 7};
  for (size_t n : sizes) {
    std::vector<uint8_t> src(n + 64), dst(n + 64);
    for (auto& b : src) b = static_cast<uint8_t>(rng());
    for (size_t so : {0, 3}) {
      for (size_t doff : {0, 5, 16}) {
        std::fill(dst.begin(), dst.end(), 0xEE);
        StreamCopy(dst.data() + doff, src.data() + so, n);
        ASSERT_EQ(std::memcmp(dst.data() + doff, src.data() + so, n), 0) << n;
        ASSERT_EQ(dst[doff + n], 0xEE) << n;
        if (doff > 0) ASSERT_EQ(dst[doff - 1], 0xEE) << n;
      }
    }
  }
}

}  // namespace
}  // namespace tpusync
