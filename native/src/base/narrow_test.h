// Shared checks of the float32 -> 16-bit narrowing casts (base/bf16.h, base/f16.h), for their
// tests only.
#pragma once

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>

namespace tpusync {

// The float whose bits are u.
inline float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// `cast` over random float bits at lengths around its vector width and every source alignment
// equals `reference` value by value, and writes nothing before or past its n outputs.
inline void ExpectCastAtEveryLengthAndAlignment(void (*cast)(uint16_t*, const void*, size_t),
                                                uint16_t (*reference)(uint32_t)) {
  std::mt19937 rng(5);
  std::vector<uint8_t> src(4 * 300 + 3);
  for (auto& b : src) b = static_cast<uint8_t>(rng());
  for (size_t n : {0, 1, 3, 7, 8, 9, 15, 16, 17, 31, 33, 64, 65, 299}) {
    for (size_t shift : {0, 1, 2, 3}) {
      std::vector<uint16_t> out(n + 2, 0xabcd);
      cast(out.data() + 1, src.data() + shift, n);
      for (size_t i = 0; i < n; ++i) {
        uint32_t u;
        std::memcpy(&u, src.data() + shift + 4 * i, 4);
        ASSERT_EQ(out[1 + i], reference(u)) << "n " << n << " shift " << shift << " i " << i;
      }
      EXPECT_EQ(out[0], 0xabcd);
      EXPECT_EQ(out[n + 1], 0xabcd);  // nothing written past the end
    }
  }
}

}  // namespace tpusync
