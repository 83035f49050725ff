#include "tpusync/base/checksum.h"

#include "tpusync/base/stream_copy.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <algorithm>
#include <cstring>

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

uint64_t CopyWithChecksum64(void* dst, const void* src, size_t bytes, uint64_t seed) {
  XXH3_state_t state;
  XXH3_INITSTATE(&state);  // stack-allocated state: the documented initialisation
  XXH3_64bits_reset_withSeed(&state, seed);
  auto* d = static_cast<uint8_t*>(dst);
  const auto* s = static_cast<const uint8_t*>(src);
  // Large copies: hash the source chunk (which brings it into L1), then stream it out from there
  // with non-temporal stores (base/stream_copy.h), so DRAM sees one read and one write per byte.
  const bool stream = bytes >= kStreamMinBytes;
  for (size_t off = 0; off < bytes; off += kFusedChunkBytes) {
    const size_t n = std::min(kFusedChunkBytes, bytes - off);
    if (stream) {
      XXH3_64bits_update(&state, s + off, n);
      StreamStore(d + off, s + off, n);
    } else {
      std::memcpy(d + off, s + off, n);
      XXH3_64bits_update(&state, d + off, n);
    }
  }
  if (stream) StreamFence();
  return XXH3_64bits_digest(&state);
}

}  // namespace tpusync
