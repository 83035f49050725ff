#include "tpusync/base/checksum.h"

#include "tpusync/base/stream_copy.h"

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
