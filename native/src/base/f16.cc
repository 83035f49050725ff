#include "tpusync/base/f16.h"

#include <cstring>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace tpusync {
namespace {

void F32ToF16Scalar(uint16_t* dst, const uint8_t* s, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, s + 4 * i, 4);
    dst[i] = F32BitsToF16(u);
  }
}

#if defined(__x86_64__)
// 8 values per step: VCVTPS2PH rounds to nearest even (the immediate, not MXCSR), then every NaN
// lane (exponent all ones, mantissa not zero) is replaced by its sign | 0x7E00.
__attribute__((target("avx2,f16c"))) void F32ToF16F16c(uint16_t* dst, const uint8_t* s, size_t n) {
  const __m128i abs_mask = _mm_set1_epi16(0x7fff);
  const __m128i inf = _mm_set1_epi16(0x7c00);
  const __m128i sign_mask = _mm_set1_epi16(static_cast<short>(0x8000));
  const __m128i qnan = _mm_set1_epi16(0x7e00);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(reinterpret_cast<const float*>(s + 4 * i));
    __m128i h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m128i nan = _mm_cmpgt_epi16(_mm_and_si128(h, abs_mask), inf);
    const __m128i fixed = _mm_or_si128(_mm_and_si128(h, sign_mask), qnan);
    h = _mm_or_si128(_mm_andnot_si128(nan, h), _mm_and_si128(nan, fixed));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
  F32ToF16Scalar(dst + i, s + 4 * i, n - i);
}

// F16C from CPUID leaf 1 (ECX bit 29): clang's __builtin_cpu_supports does not know "f16c".
bool HasF16c() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C) != 0;
}

const bool kF16c = HasF16c() && __builtin_cpu_supports("avx2");
#endif

}  // namespace

void F32ToF16(uint16_t* dst, const void* src, size_t n) {
  const auto* s = static_cast<const uint8_t*>(src);
#if defined(__x86_64__)
  if (kF16c) return F32ToF16F16c(dst, s, n);
#endif
  F32ToF16Scalar(dst, s, n);
}

}  // namespace tpusync
