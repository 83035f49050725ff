#include "tpusync/base/checksum.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace tpusync {

uint64_t Checksum64(const void* data, size_t bytes, uint64_t seed) {
  return XXH3_64bits_withSeed(data, bytes, seed);
}

}  // namespace tpusync
