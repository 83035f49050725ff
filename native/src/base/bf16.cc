#include "tpusync/base/bf16.h"

#include <cstring>

namespace tpusync {

// A plain loop the compiler vectorizes (no intrinsics): on x86-64 an AVX2 clone does 8 floats per
// step and the baseline SSE2 one 4; target_clones resolves once, at load time (an ifunc).
#if defined(__x86_64__)
#define TPUSYNC_BF16_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define TPUSYNC_BF16_CLONES
#endif

TPUSYNC_BF16_CLONES __attribute__((optimize("tree-vectorize"))) void F32ToBf16(
    uint16_t* __restrict dst, const void* __restrict src, size_t n) {
  const auto* s = static_cast<const uint8_t*>(src);
  for (size_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, s + 4 * i, 4);
    dst[i] = F32BitsToBf16(u);
  }
}

}  // namespace tpusync
