#include "tpusync/base/checksum.h"

#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>

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

}  // namespace
}  // namespace tpusync
