// Float32 -> bfloat16 conversion for the weight-sync staging path (an fp32 trainer feeding a bf16
// sampler).
//
// ROUNDING CONTRACT: round to nearest, ties to even, on the float's bits (the upper 16 bits after
// adding 0x7FFF plus the lowest kept bit), which is what torch's scalar c10::BFloat16 conversion
// does, so every non-NaN value (infinities, subnormals, values that round up to infinity
// included) gives the same bits as `tensor.to(torch.bfloat16)`. Every NaN becomes the canonical
// quiet NaN 0x7FC0 (torch's vectorized paths give other NaN bits depending on the CPU; a NaN stays
// a NaN either way). Rejected: truncation (biased, and not what torch does), hardware VCVTNEPS2BF16
// (AVX512-BF16 only, and its NaN bits differ again).
// Compiled for baseline x86-64 and for AVX2 (picked at run time, like the checksum).
#pragma once

#include <cstddef>
#include <cstdint>

namespace tpusync {

inline uint16_t F32BitsToBf16(uint32_t u) {
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// dst[i] = bf16(src[i]) for i < n, by the ROUNDING CONTRACT. src is read as float32 bits (any
// alignment); dst and src must not overlap.
void F32ToBf16(uint16_t* dst, const void* src, size_t n);

}  // namespace tpusync
