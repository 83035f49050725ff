#include "tpusync/base/checksum.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace tpusync {

#if defined(__x86_64__) && defined(TPUSYNC_HAVE_AVX2_CHECKSUM)
namespace internal {
uint64_t Checksum64Avx2(const void* data, size_t bytes, uint64_t seed);
}
namespace {
// DISPATCH: the wheel targets baseline x86-64 (SSE2); XXH3 runs about twice as fast with AVX2,
// and checksums are on every transferred and stored byte, so pick the AVX2 build at run time.
const bool kAvx2 = __builtin_cpu_supports("avx2");
}  // namespace
#endif

uint64_t Checksum64(const void* data, size_t bytes, uint64_t seed) {
#if defined(__x86_64__) && defined(TPUSYNC_HAVE_AVX2_CHECKSUM)
  // Small inputs gain nothing from the wider unit.
  if (kAvx2 && bytes >= 1024) return internal::Checksum64Avx2(data, bytes, seed);
#endif
  return XXH3_64bits_withSeed(data, bytes, seed);
}

}  // namespace tpusync
