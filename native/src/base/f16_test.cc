#include "tpusync/base/f16.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "narrow_test.h"
#include "tpusync/base/checksum.h"

namespace tpusync {
namespace {

// The value of a finite float16 code, worked out from the IEEE definition (not by a conversion).
double F16Value(uint16_t h) {
  const int exp = (h >> 10) & 0x1f;
  const double frac = h & 0x3ff;
  const double mag = exp == 0 ? std::ldexp(frac, -24) : std::ldexp(1024.0 + frac, exp - 25);
  return (h & 0x8000) ? -mag : mag;
}

// Round to nearest, ties to even, on values: the two float16 neighbours of |f| among the 31744
// finite non-negative codes (and 65536 standing for infinity, IEEE overflow), the nearer one, the
// even code on a tie.
uint16_t ReferenceF16(uint32_t u) {
  static const std::vector<double> values = [] {
    std::vector<double> v;
    for (uint16_t h = 0; h < 0x7c00; ++h) v.push_back(F16Value(h));
    v.push_back(65536.0);  // the "next" value past 65504: infinity's place
    return v;
  }();
  const float f = FromBits(u);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  if (std::isnan(f)) return sign | 0x7e00u;
  if (std::isinf(f)) return sign | 0x7c00u;
  const double v = std::fabs(static_cast<double>(f));
  if (v >= 65536.0) return sign | 0x7c00u;
  const size_t hi = std::lower_bound(values.begin(), values.end(), v) - values.begin();
  if (values[hi] == v) return sign | static_cast<uint16_t>(hi);
  const size_t lo = hi - 1;
  const double dlo = v - values[lo], dhi = values[hi] - v;
  const size_t pick = dlo < dhi ? lo : dhi < dlo ? hi : ((lo & 1) ? hi : lo);
  return sign | static_cast<uint16_t>(pick);  // index 0x7c00 is infinity's code
}

// Inputs that decide float16 rounding: every sign / exponent / top-10-mantissa pattern with the
// low 13 bits exact, just above, at / around the tie and the largest; and below 2^-14 (float16
// subnormals and underflow, where the rounding point moves) the same around every tie point.
std::vector<uint32_t> DecidingInputs() {
  std::vector<uint32_t> in;
  const uint32_t lows[] = {0x0000, 0x0001, 0x0fff, 0x1000, 0x1001, 0x1fff, 0x0abc};
  for (uint32_t top = 0; top < (1u << 19); ++top) {
    for (uint32_t low : lows) in.push_back(top << 13 | low);
  }
  std::mt19937 rng(3);
  for (uint32_t e = 98; e <= 113; ++e) {
    const uint32_t shift = std::min<uint32_t>(126 - std::min<uint32_t>(e, 126), 24);
    const uint32_t half = 1u << (shift - 1);
    for (int k = 0; k < 512; ++k) {
      const uint32_t top = rng() << shift;
      for (uint32_t low : {0u, 1u, half - 1, half, half + 1, 2 * half - 1}) {
        const uint32_t mant = (top | low) & 0x7fffffu;
        for (uint32_t sign : {0u, 0x80000000u}) in.push_back(sign | e << 23 | mant);
      }
    }
  }
  return in;
}

TEST(F16, EveryDecidingPatternRoundsToNearestEvenLikeTheIeeeDefinition) {
  const std::vector<uint32_t> in = DecidingInputs();
  std::vector<uint16_t> out(in.size());
  F32ToF16(out.data(), in.data(), in.size());
  size_t bad = 0;
  for (size_t i = 0; i < in.size(); ++i) {
    const uint16_t want = ReferenceF16(in[i]);
    if ((out[i] != want || F32BitsToF16(in[i]) != want) && ++bad <= 5) {
      ADD_FAILURE() << std::hex << "f32 bits 0x" << in[i] << ": vector 0x" << out[i]
                    << ", scalar 0x" << F32BitsToF16(in[i]) << ", want 0x" << want;
    }
  }
  EXPECT_EQ(bad, 0u);
  // Spot checks anyone can do by hand.
  EXPECT_EQ(F32BitsToF16(0x3f800000u), 0x3c00);  // 1.0
  EXPECT_EQ(F32BitsToF16(0x3f801000u), 0x3c00);  // 1 + 2^-11: tie, stays even
  EXPECT_EQ(F32BitsToF16(0x3f803000u), 0x3c02);  // tie with an odd lower: rounds up
  EXPECT_EQ(F32BitsToF16(0x477fe000u), 0x7bff);  // 65504, the largest float16
  EXPECT_EQ(F32BitsToF16(0x477fefffu), 0x7bff);  // just below 65520: still 65504
  EXPECT_EQ(F32BitsToF16(0x477ff000u), 0x7c00);  // 65520: tie, to infinity (the even side)
  EXPECT_EQ(F32BitsToF16(0x33800000u), 0x0001);  // 2^-24, the smallest subnormal
  EXPECT_EQ(F32BitsToF16(0x33000000u), 0x0000);  // 2^-25: tie, to zero
  EXPECT_EQ(F32BitsToF16(0x33000001u), 0x0001);  // just above: rounds up
  EXPECT_EQ(F32BitsToF16(0x387fc000u), 0x03ff);  // the largest subnormal
  EXPECT_EQ(F32BitsToF16(0x387fe000u), 0x0400);  // its tie rounds up into the smallest normal
  EXPECT_EQ(F32BitsToF16(0x80000000u), 0x8000);  // -0 keeps its sign
  EXPECT_EQ(F32BitsToF16(0x7fa00000u), 0x7e00);  // a signalling NaN: quiet NaN
  EXPECT_EQ(F32BitsToF16(0xffffffffu), 0xfe00);  // a negative NaN keeps its sign
}

TEST(F16, RandomBitsAtEveryLengthAndAlignment) {
  ExpectCastAtEveryLengthAndAlignment(F32ToF16, ReferenceF16);
}

// The fused form with the float16 cast: digest of the source bytes, every destination the cast.
TEST(F16, CastUpdateRunsHashesTheSourceAndCastsEveryRun) {
  std::mt19937 rng(9);
  const size_t elems = 3 * kFusedChunkBytes / 4 + 123;
  std::vector<float> src(elems);
  for (auto& f : src)
    f = std::ldexp(static_cast<float>(rng()) / 4294967296.0f - 0.5f, rng() % 40 - 24);
  std::vector<uint16_t> dst(elems);
  StreamRun run{reinterpret_cast<uint8_t*>(dst.data()), reinterpret_cast<uint8_t*>(src.data()),
                elems * 4};
  Checksum64Stream h(7);
  h.CastUpdateRuns(&run, 1, F32ToF16);
  EXPECT_EQ(h.Digest(), Checksum64(src.data(), elems * 4, 7));
  for (size_t i = 0; i < elems; ++i) {
    uint32_t u;
    std::memcpy(&u, &src[i], 4);
    ASSERT_EQ(dst[i], ReferenceF16(u)) << i;
  }
}

}  // namespace
}  // namespace tpusync
