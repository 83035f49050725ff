#include "tpusync/base/bf16.h"

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "narrow_test.h"
#include "tpusync/base/checksum.h"

namespace tpusync {
namespace {

// Round to nearest, ties to even, worked out on values (double arithmetic), not on bits: the two
// bf16 neighbours of f, the nearer one, the even one on a tie. Past the largest bf16 the upper
// neighbour is infinity, which stands for 2^128 when measuring the distance (IEEE overflow).
uint16_t ReferenceBf16(uint32_t u) {
  const float f = FromBits(u);
  if (std::isnan(f)) return 0x7fc0;
  if (std::isinf(f)) return static_cast<uint16_t>(u >> 16);
  const uint32_t lo = u & 0xffff0000u;
  const uint32_t hi = lo + 0x10000u;  // away from zero: same sign, next magnitude
  if (lo == u) return static_cast<uint16_t>(lo >> 16);
  const double v = std::fabs(static_cast<double>(f));
  const double vlo = std::fabs(static_cast<double>(FromBits(lo)));
  const double vhi = (hi & 0x7fffffffu) == 0x7f800000u
                         ? std::ldexp(1.0, 128)
                         : std::fabs(static_cast<double>(FromBits(hi)));
  const double dlo = v - vlo, dhi = vhi - v;
  if (dlo < dhi) return static_cast<uint16_t>(lo >> 16);
  if (dhi < dlo) return static_cast<uint16_t>(hi >> 16);
  return static_cast<uint16_t>(((lo >> 16) & 1u) ? hi >> 16 : lo >> 16);  // tie: even
}

TEST(Bf16, EveryExponentAndMantissaTopRoundsToNearestEven) {
  // Every upper half (sign, exponent, 7 mantissa bits) with the lower halves that decide the
  // rounding: exact, just above, just below / at / just above the tie, the largest.
  const uint32_t lows[] = {0x0000, 0x0001, 0x7fff, 0x8000, 0x8001, 0xffff, 0x1234, 0xc001};
  std::vector<uint32_t> in;
  for (uint32_t top = 0; top < 0x10000; ++top) {
    for (uint32_t low : lows) in.push_back(top << 16 | low);
  }
  std::vector<uint16_t> out(in.size());
  F32ToBf16(out.data(), in.data(), in.size());
  size_t bad = 0;
  for (size_t i = 0; i < in.size(); ++i) {
    const uint16_t want = ReferenceBf16(in[i]);
    if (out[i] != want && ++bad <= 5) {
      ADD_FAILURE() << std::hex << "f32 bits 0x" << in[i] << ": got 0x" << out[i] << ", want 0x"
                    << want;
    }
    EXPECT_EQ(F32BitsToBf16(in[i]), out[i]);  // the scalar form agrees with the vector loop
  }
  EXPECT_EQ(bad, 0u);
  // Spot checks anyone can do by hand.
  EXPECT_EQ(out[(0x3f800000u >> 16) * 8], 0x3f80);  // 1.0
  EXPECT_EQ(F32BitsToBf16(0x3f808000u), 0x3f80);    // 1 + 2^-8: tie, stays even
  EXPECT_EQ(F32BitsToBf16(0x3f818000u), 0x3f82);    // tie with an odd lower: rounds up
  EXPECT_EQ(F32BitsToBf16(0x7f7fffffu), 0x7f80);    // FLT_MAX overflows to infinity
  EXPECT_EQ(F32BitsToBf16(0xff800000u), 0xff80);    // -inf stays
  EXPECT_EQ(F32BitsToBf16(0x7fa00000u), 0x7fc0);    // a signalling NaN: canonical NaN
  EXPECT_EQ(F32BitsToBf16(0xffffffffu), 0x7fc0);    // a negative NaN too
}

TEST(Bf16, RandomBitsAtEveryLengthAndAlignment) {
  ExpectCastAtEveryLengthAndAlignment(F32ToBf16, ReferenceBf16);
}

// The fused form: digest of the source bytes in run order, every destination exactly the cast.
TEST(Bf16, CastUpdateRunsHashesTheSourceAndCastsEveryRun) {
  std::mt19937 rng(9);
  const size_t elems = 3 * kFusedChunkBytes / 4 + 123;  // one long run over several chunks
  std::vector<float> src(elems);
  for (auto& f : src) f = std::ldexp(static_cast<float>(rng()) / 4294967296.0f - 0.5f, rng() % 20);
  std::vector<uint16_t> want(elems);
  for (size_t i = 0; i < elems; ++i) {
    uint32_t u;
    std::memcpy(&u, &src[i], 4);
    want[i] = ReferenceBf16(u);
  }
  const auto* s = reinterpret_cast<const uint8_t*>(src.data());
  {  // dense: one run
    std::vector<uint16_t> dst(elems);
    StreamRun run{reinterpret_cast<uint8_t*>(dst.data()), s, elems * 4};
    Checksum64Stream h(7);
    h.CastUpdateRuns(&run, 1, F32ToBf16);
    EXPECT_EQ(h.Digest(), Checksum64(s, elems * 4, 7));
    EXPECT_EQ(dst, want);
  }
  {  // scatter: packed source rows of 37 floats into every other row of a strided destination
    const size_t row = 37, rows = elems / row;
    std::vector<uint16_t> dst(2 * rows * row, 0xabcd);
    std::vector<StreamRun> runs;
    for (size_t r = 0; r < rows; ++r) {
      runs.push_back(
          {reinterpret_cast<uint8_t*>(dst.data() + 2 * r * row), s + 4 * r * row, 4 * row});
    }
    Checksum64Stream h;
    h.CastUpdateRuns(runs.data(), runs.size(), F32ToBf16);
    EXPECT_EQ(h.Digest(), Checksum64(s, 4 * rows * row));
    for (size_t r = 0; r < rows; ++r) {
      for (size_t c = 0; c < row; ++c) {
        ASSERT_EQ(dst[2 * r * row + c], want[r * row + c]) << r << " " << c;
        ASSERT_EQ(dst[(2 * r + 1) * row + c], 0xabcd);
      }
    }
  }
  {  // gather: every other source row of 41 floats into a packed destination
    const size_t row = 41, rows = elems / (2 * row);
    std::vector<uint16_t> dst(rows * row);
    std::vector<StreamRun> runs;
    Checksum64Stream ref;
    for (size_t r = 0; r < rows; ++r) {
      runs.push_back({reinterpret_cast<uint8_t*>(dst.data() + r * row), s + 8 * r * row, 4 * row});
      ref.Update(s + 8 * r * row, 4 * row);
    }
    Checksum64Stream h;
    h.CastUpdateRuns(runs.data(), runs.size(), F32ToBf16);
    EXPECT_EQ(h.Digest(), ref.Digest());
    for (size_t r = 0; r < rows; ++r) {
      for (size_t c = 0; c < row; ++c) ASSERT_EQ(dst[r * row + c], want[2 * r * row + c]);
    }
  }
}

}  // namespace
}  // namespace tpusync
