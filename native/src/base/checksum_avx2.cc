// XXH3 compiled for AVX2, called by Checksum64 and Checksum64Stream only on CPUs that have it
// (checksum.cc). XXH3's output does not depend on the vector unit, so both builds compute the
// same checksums.
// XXH_INLINE_ALL gives every xxhash function internal linkage, so this translation unit's AVX2
// copies never collide with the baseline ones.
#include <cstddef>
#include <cstdint>

#include "tpusync/base/checksum.h"

#if defined(__x86_64__) && defined(__AVX2__)
#define XXH_INLINE_ALL
#define XXH_VECTOR XXH_AVX2
#include <xxhash.h>

namespace tpusync::internal {
uint64_t Checksum64Avx2(const void* data, size_t bytes, uint64_t seed) {
  return XXH3_64bits_withSeed(data, bytes, seed);
}

void Checksum64UpdateAvx2(void* state, const void* data, size_t bytes) {
  XXH3_64bits_update(static_cast<XXH3_state_t*>(state), data, bytes);
}
}  // namespace tpusync::internal
#endif
