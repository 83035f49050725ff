#include "tpusync/base/checksum.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <algorithm>
#include <cstring>

namespace tpusync {

uint64_t Checksum64(const void* data, size_t bytes, uint64_t seed) {
  return XXH3_64bits_withSeed(data, bytes, seed);
}

uint64_t CopyWithChecksum64(void* dst, const void* src, size_t bytes, uint64_t seed) {
  XXH3_state_t state;
  XXH3_INITSTATE(&state);  // stack-allocated state: the documented initialisation
  XXH3_64bits_reset_withSeed(&state, seed);
  auto* d = static_cast<uint8_t*>(dst);
  const auto* s = static_cast<const uint8_t*>(src);
  for (size_t off = 0; off < bytes; off += kFusedChunkBytes) {
    const size_t n = std::min(kFusedChunkBytes, bytes - off);
    std::memcpy(d + off, s + off, n);
    XXH3_64bits_update(&state, d + off, n);
  }
  return XXH3_64bits_digest(&state);
}

}  // namespace tpusync
