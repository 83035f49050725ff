// Float32 -> IEEE float16 conversion for the weight-sync staging path (an fp32 trainer feeding a
// float16 sampler), the sibling of base/bf16.h.
//
// ROUNDING CONTRACT: IEEE 754 round to nearest, ties to even, with gradual underflow (float16
// subnormals are produced, values below half the smallest one become a signed zero) and overflow
// to infinity from 65520 up; that is what torch's `tensor.to(torch.float16)` gives for every
// non-NaN value. Every NaN becomes the quiet NaN 0x7E00 with its sign kept (torch's scalar
// conversion; its vectorized F16C path keeps payload bits instead - a NaN stays a NaN either way).
// DISPATCH: 8 values per step with F16C (VCVTPS2PH, rounding given in the instruction, so the
// MXCSR rounding mode does not matter) on CPUs that have it and AVX2, checked once at load; the
// scalar F32BitsToF16 otherwise and for the tail. Both give the same bits for every input
// (f16_test.cc). Rejected: a plain `_Float16` loop for the compiler to vectorize (GCC 12 emits
// one scalar VCVTPS2PH per value, or a libgcc call per value without F16C).
#pragma once

#include <cstddef>
#include <cstdint>

namespace tpusync {

inline uint16_t F32BitsToF16(uint32_t u) {
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (a >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 (and inf): infinity
  if (a >= 0x38800000u) {                       // >= 2^-14: a normal float16
    // Rebias the exponent (127 -> 15), then round the 13 dropped mantissa bits to nearest even;
    // a carry out of the mantissa moves into the exponent, which is the right result.
    return sign | static_cast<uint16_t>((a - 0x38000000u + 0xfffu + ((a >> 13) & 1u)) >> 13);
  }
  const uint32_t e = a >> 23;
  if (e < 102) return sign;  // below 2^-25: rounds to zero (2^-25 itself is a tie, to zero too)
  // A float16 subnormal counts units of 2^-24: the value is m * 2^(e - 150) = m >> (126 - e).
  const uint32_t m = (a & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126 - e;  // 14 .. 24
  uint32_t q = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;  // may reach 0x400: the smallest normal
  return sign | static_cast<uint16_t>(q);
}

// dst[i] = float16(src[i]) for i < n, by the ROUNDING CONTRACT. src is read as float32 bits (any
// alignment); dst and src must not overlap.
void F32ToF16(uint16_t* dst, const void* src, size_t n);

}  // namespace tpusync
