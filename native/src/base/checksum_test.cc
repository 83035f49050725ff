#include "tpusync/base/checksum.h"

#include <algorithm>
#include <cstring>
#include <iterator>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "tpusync/base/stream_copy.h"

// The reference digest: xxHash's own one-shot XXH3, compiled in this file (baseline vector unit),
// independent of the library's dispatch.
#define XXH_INLINE_ALL
#include <xxhash.h>

namespace tpusync {
#if defined(__x86_64__)
namespace internal {  // checksum_avx2.cc: the AVX2 build, linked on every x86-64 build
void Checksum64UpdateAvx2(void* state, const void* data, size_t bytes);
}  // namespace internal
#endif
namespace {

using FusedFn = uint64_t (*)(void*, const void*, size_t, uint64_t);

// Copies with `fused` at every size class (XXH3's short-input paths, the 1 KiB dispatch threshold,
// the 16 KiB chunk and 64 KiB streaming thresholds and between them) and every source /
// destination misalignment; the bytes, the digest (against xxHash's one-shot call, i.e. copy then
// hash) and the bytes around the destination must all be exact.
void ExpectFusedExact(FusedFn fused) {
  std::mt19937 rng(11);
  const size_t sizes[] = {0,
                          1,
                          3,
                          16,
                          17,
                          128,
                          129,
                          240,
                          241,
                          1023,
                          1024,
                          1025,
                          4096 + 3,
                          kFusedChunkBytes - 1,
                          kFusedChunkBytes,
                          kFusedChunkBytes + 1,
                          kStreamMinBytes - 1,
                          kStreamMinBytes,
                          kStreamMinBytes + 33,
                          (256 << 10) + 7,
                          (1 << 20) + 5};
  for (size_t n : sizes) {
    std::vector<uint8_t> src(n + 64), dst(n + 128);
    for (auto& b : src) b = static_cast<uint8_t>(rng());
    for (size_t so : {0, 1, 13, 32}) {
      for (size_t doff : {0, 5, 16, 64}) {
        for (uint64_t seed : {0ull, 0x9E3779B97F4A7C15ull}) {
          std::fill(dst.begin(), dst.end(), 0xEE);
          const uint64_t sum = fused(dst.data() + doff, src.data() + so, n, seed);
          ASSERT_EQ(sum, XXH3_64bits_withSeed(src.data() + so, n, seed))
              << n << " src+" << so << " dst+" << doff;
          ASSERT_EQ(std::memcmp(dst.data() + doff, src.data() + so, n), 0) << n;
          ASSERT_EQ(dst[doff + n], 0xEE) << "wrote past the end at " << n;
          if (doff > 0) ASSERT_EQ(dst[doff - 1], 0xEE) << "wrote before the start at " << n;
        }
      }
    }
  }
}

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

// The public entry point (AVX2 build on CPUs with AVX2 from 1 KiB, baseline below and elsewhere).
TEST(Checksum, FusedCopyExactAtAllSizesAndAlignments) { ExpectFusedExact(&CopyWithChecksum64); }

#if defined(__x86_64__)
// The fused loop with every hash update forced onto the AVX2 build (the dispatch picks it from
// 1 KiB up only): copy a chunk, then update this file's own XXH3 state through the AVX2 build.
uint64_t CopyWithAvx2Updates(void* dst, const void* src, size_t bytes, uint64_t seed) {
  XXH3_state_t state;
  XXH3_INITSTATE(&state);
  XXH3_64bits_reset_withSeed(&state, seed);
  for (size_t off = 0; off < bytes; off += kFusedChunkBytes) {
    const size_t n = std::min(kFusedChunkBytes, bytes - off);
    std::memcpy(static_cast<uint8_t*>(dst) + off, static_cast<const uint8_t*>(src) + off, n);
    internal::Checksum64UpdateAvx2(&state, static_cast<uint8_t*>(dst) + off, n);
  }
  return XXH3_64bits_digest(&state);
}
#endif

// The AVX2 build directly, so it is proven exact even where the dispatch would not pick it for a
// size; skipped on CPUs without AVX2 (running it there would fault).
TEST(Checksum, FusedCopyAvx2BuildExactAtAllSizesAndAlignments) {
#if defined(__x86_64__)
  if (!__builtin_cpu_supports("avx2")) GTEST_SKIP() << "no AVX2 on this CPU";
  ExpectFusedExact(&CopyWithAvx2Updates);
#else
  GTEST_SKIP() << "the AVX2 build exists on x86-64 only";
#endif
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

namespace tpusync {
namespace {

// DIGEST CONTRACT of Checksum64Stream: any split of the input (empty pieces, pieces that cut
// XXH3's 64-byte stripes and 1 KiB blocks, pieces around the 1 KiB dispatch threshold, one piece)
// gives xxHash's one-shot digest, for several seeds; Reset starts over.
TEST(Checksum, StreamMatchesOneShotForAnySplit) {
  std::mt19937 rng(5);
  std::vector<uint8_t> data((2 << 20) + 77);
  for (auto& b : data) b = static_cast<uint8_t>(rng());
  Checksum64Stream h;
  for (size_t total : {size_t{0}, size_t{1}, size_t{240}, size_t{241}, size_t{1023}, size_t{1024},
                       size_t{4097}, size_t{256 << 10}, data.size()}) {
    for (uint64_t seed : {uint64_t{0}, uint64_t{42}}) {
      const uint64_t want = XXH3_64bits_withSeed(data.data(), total, seed);
      EXPECT_EQ(Checksum64(data.data(), total, seed), want);
      for (size_t piece : {size_t{1}, size_t{63}, size_t{1000}, size_t{1024}, size_t{65536},
                           size_t{256 << 10}, total + 1}) {
        if (piece == 1 && total > 5000) continue;  // byte by byte only for the short inputs
        h.Reset(seed);
        h.Update(data.data(), 0);  // an empty piece changes nothing
        for (size_t off = 0; off < total; off += piece) {
          h.Update(data.data() + off, std::min(piece, total - off));
        }
        EXPECT_EQ(h.Digest(), want) << "total " << total << " piece " << piece << " seed " << seed;
      }
      // Random splits.
      h.Reset(seed);
      for (size_t off = 0; off < total;) {
        const size_t n = std::min<size_t>(total - off, rng() % 300000);
        h.Update(data.data() + off, n);
        off += n;
      }
      EXPECT_EQ(h.Digest(), want) << "random split of " << total;
    }
  }
}

// CopyUpdate: the pieces land byte for byte (nothing written outside them) and a block made of
// copied pieces and hashed-only gaps digests exactly like the one-shot hash of the whole block,
// at sizes around the fused chunk and the non-temporal threshold and at odd alignments.
TEST(Checksum, StreamCopyUpdateMatchesOneShotOverMixedPieces) {
  std::mt19937 rng(11);
  std::vector<uint8_t> block((1 << 20) + 123);
  for (auto& b : block) b = static_cast<uint8_t>(rng());
  const size_t cuts[] = {0,
                         1,
                         240,
                         kFusedChunkBytes - 3,
                         kFusedChunkBytes + 5,
                         kStreamMinBytes - 1,
                         kStreamMinBytes + 9,
                         (512 << 10) + 1,
                         block.size()};
  for (size_t doff : {size_t{0}, size_t{5}}) {
    for (uint64_t seed : {uint64_t{0}, uint64_t{7}}) {
      std::vector<uint8_t> out(block.size() + 16, 0xEE);
      Checksum64Stream h(seed);
      for (size_t i = 0; i + 1 < std::size(cuts); ++i) {
        const size_t lo = cuts[i], hi = cuts[i + 1];
        if (i % 2 == 0) {  // a piece copied out while hashed (both store kinds)
          h.CopyUpdate(out.data() + doff + lo, block.data() + lo, hi - lo, i % 4 == 2);
        } else {  // a gap (padding, trailer) hashed only
          h.Update(block.data() + lo, hi - lo);
        }
      }
      ASSERT_EQ(h.Digest(), XXH3_64bits_withSeed(block.data(), block.size(), seed));
      for (size_t i = 0; i + 1 < std::size(cuts); ++i) {
        const size_t lo = cuts[i], hi = cuts[i + 1];
        if (i % 2 == 0) {
          ASSERT_EQ(std::memcmp(out.data() + doff + lo, block.data() + lo, hi - lo), 0) << lo;
        } else {
          for (size_t k = lo; k < hi; ++k) ASSERT_EQ(out[doff + k], 0xEE) << "gap written " << k;
        }
      }
      if (doff > 0) ASSERT_EQ(out[doff - 1], 0xEE);
      ASSERT_EQ(out[doff + block.size()], 0xEE);
    }
  }
}

// CopyUpdateRuns: a gather of rows at a stride into one packed range digests like the packed
// bytes, for both store kinds, and copies exactly the rows.
TEST(Checksum, StreamCopyUpdateRunsGathersRowsInOrder) {
  std::mt19937 rng(13);
  const size_t rows = 37, row = 2052, stride = 4100;  // windows of 7 rows, and a short last one
  std::vector<uint8_t> src(rows * stride);
  for (auto& b : src) b = static_cast<uint8_t>(rng());
  std::vector<uint8_t> packed(rows * row);
  for (size_t r = 0; r < rows; ++r) std::memcpy(&packed[r * row], &src[r * stride], row);
  for (bool keep : {false, true}) {
    std::vector<uint8_t> out(rows * row + 1, 0xEE);
    std::vector<StreamRun> runs;
    for (size_t r = 0; r < rows; ++r) runs.push_back({&out[r * row], &src[r * stride], row});
    Checksum64Stream h(3);
    h.CopyUpdateRuns(runs.data(), runs.size(), keep);
    EXPECT_EQ(h.Digest(), XXH3_64bits_withSeed(packed.data(), packed.size(), 3));
    EXPECT_EQ(std::memcmp(out.data(), packed.data(), packed.size()), 0);
    EXPECT_EQ(out.back(), 0xEE);
  }
}

// The scatter direction: packed bytes out into rows at a stride (short rows in windows, and rows
// longer than a window one by one), the digest of the packed bytes, nothing written between rows.
TEST(Checksum, StreamCopyUpdateRunsScattersRowsInOrder) {
  std::mt19937 rng(17);
  for (size_t row : {size_t{100}, size_t{3000}, size_t{kFusedChunkBytes + 5}}) {
    const size_t rows = 19, stride = row + 77;
    std::vector<uint8_t> packed(rows * row);
    for (auto& b : packed) b = static_cast<uint8_t>(rng());
    std::vector<uint8_t> out(rows * stride, 0xEE);
    std::vector<StreamRun> runs;
    for (size_t r = 0; r < rows; ++r) runs.push_back({&out[r * stride], &packed[r * row], row});
    Checksum64Stream h;
    h.CopyUpdateRuns(runs.data(), runs.size());
    EXPECT_EQ(h.Digest(), XXH3_64bits(packed.data(), packed.size())) << row;
    for (size_t r = 0; r < rows; ++r) {
      ASSERT_EQ(std::memcmp(&out[r * stride], &packed[r * row], row), 0) << row << " row " << r;
      for (size_t k = row; k < stride; ++k) ASSERT_EQ(out[r * stride + k], 0xEE) << row;
    }
  }
}

}  // namespace
}  // namespace tpusync
