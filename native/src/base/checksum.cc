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
void Checksum64UpdateAvx2(void* state, const void* data, size_t bytes);
}  // namespace internal
namespace {
// DISPATCH: the wheel targets baseline x86-64 (SSE2); XXH3 runs about twice as fast with AVX2,
// and checksums are on every transferred and stored byte, so pick the AVX2 build at run time:
// for the one-shot hash and for every streaming update (the fused copy + hash of a /dev/shm put,
// a disk bounce or a weight-sync staging copy updates 16 KiB at a time).
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
  Checksum64Stream h(seed);
  h.CopyUpdate(dst, src, bytes);
  return h.Digest();
}

static_assert(sizeof(XXH3_state_t) <= Checksum64Stream::kStateBytes && alignof(XXH3_state_t) <= 64);

namespace {
XXH3_state_t* StateOf(unsigned char* raw) { return reinterpret_cast<XXH3_state_t*>(raw); }
const XXH3_state_t* StateOf(const unsigned char* raw) {
  return reinterpret_cast<const XXH3_state_t*>(raw);
}
}  // namespace

Checksum64Stream::Checksum64Stream(uint64_t seed) {
  XXH3_INITSTATE(StateOf(state_));
  Reset(seed);
}

void Checksum64Stream::Reset(uint64_t seed) { XXH3_64bits_reset_withSeed(StateOf(state_), seed); }

void Checksum64Stream::Update(const void* data, size_t bytes) {
#if defined(__x86_64__) && defined(TPUSYNC_HAVE_AVX2_CHECKSUM)
  // Same state layout in both builds (one struct definition); only the stripe loop differs.
  if (kAvx2 && bytes >= 1024) return internal::Checksum64UpdateAvx2(state_, data, bytes);
#endif
  XXH3_64bits_update(StateOf(state_), data, bytes);
}

void Checksum64Stream::CopyUpdate(void* dst, const void* src, size_t bytes, bool keep_in_cache) {
  auto* d = static_cast<uint8_t*>(dst);
  const auto* s = static_cast<const uint8_t*>(src);
  // Large copies: hash the source chunk (which brings it into L1), then stream it out from there
  // with non-temporal stores (base/stream_copy.h), so DRAM sees one read and one write per byte.
  // Small ones, or keep_in_cache: copy, then hash the destination chunk while it is in L1.
  const bool stream = !keep_in_cache && bytes >= kStreamMinBytes;
  for (size_t off = 0; off < bytes; off += kFusedChunkBytes) {
    const size_t n = std::min(kFusedChunkBytes, bytes - off);
    if (stream) {
      Update(s + off, n);
      StreamStore(d + off, s + off, n);
    } else {
      std::memcpy(d + off, s + off, n);
      Update(d + off, n);
    }
  }
  if (stream) StreamFence();
}

void Checksum64Stream::CopyUpdateRuns(const StreamRun* runs, size_t n, bool keep_in_cache) {
  // Short runs (rows of a resharded box, a few KiB): one Update per run costs more than the copy,
  // so runs are copied in windows of up to kFusedChunkBytes of their packed side and each window
  // is hashed with one Update while it is in L1 - the destination window of a gather, the source
  // window of a scatter. Long runs, or runs packed on neither side, go one by one.
  size_t i = 0;
  while (i < n) {
    const bool gather = i + 1 < n && runs[i + 1].dst == runs[i].dst + runs[i].bytes;
    const bool scatter = i + 1 < n && runs[i + 1].src == runs[i].src + runs[i].bytes;
    if (runs[i].bytes >= kFusedChunkBytes || !(gather || scatter)) {
      CopyUpdate(runs[i].dst, runs[i].src, runs[i].bytes, keep_in_cache);
      ++i;
      continue;
    }
    const uint8_t* start = gather ? runs[i].dst : runs[i].src;
    size_t bytes = 0;
    size_t j = i;
    while (j < n && bytes + runs[j].bytes <= kFusedChunkBytes &&
           (gather ? runs[j].dst : runs[j].src) == start + bytes) {
      std::memcpy(runs[j].dst, runs[j].src, runs[j].bytes);
      bytes += runs[j].bytes;
      ++j;
    }
    Update(start, bytes);
    i = j;
  }
}

void Checksum64Stream::CastUpdateRuns(const StreamRun* runs, size_t n, NarrowFn narrow) {
  size_t i = 0;
  while (i < n) {
    const StreamRun& r = runs[i];
    if (r.bytes >= kFusedChunkBytes) {
      auto* d = reinterpret_cast<uint16_t*>(r.dst);
      for (size_t off = 0; off < r.bytes; off += kFusedChunkBytes) {
        const size_t c = std::min(kFusedChunkBytes, r.bytes - off);
        Update(r.src + off, c);
        narrow(d + off / 4, r.src + off, c / 4);
      }
      ++i;
      continue;
    }
    size_t bytes = 0;
    size_t j = i;
    while (j < n && runs[j].bytes < kFusedChunkBytes && bytes + runs[j].bytes <= kFusedChunkBytes &&
           runs[j].src == r.src + bytes) {
      bytes += runs[j].bytes;
      ++j;
    }
    Update(r.src, bytes);
    for (size_t k = i; k < j; ++k) {
      narrow(reinterpret_cast<uint16_t*>(runs[k].dst), runs[k].src, runs[k].bytes / 4);
    }
    i = j;
  }
}

uint64_t Checksum64Stream::Digest() const { return XXH3_64bits_digest(StateOf(state_)); }

}  // namespace tpusync
