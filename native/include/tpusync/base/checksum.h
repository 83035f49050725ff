// Block checksums: XXH3-64 from the xxHash library (Debian libxxhash-dev, used header-only so
// wheels carry no runtime dependency).
//
// CHECKSUM CONTRACT: every block that leaves process memory (disk slot, /dev/shm re-attach, wire
// frame) carries Checksum64 of its payload bytes; a reader recomputes it and treats a mismatch as
// kCorrupted, never as data. Rejected alternative: crc32c - needs SSE4.2 dispatch for speed and
// detects less in 32 bits; XXH3 runs at memory bandwidth on every x86-64 and aarch64 core.
#pragma once

#include <cstddef>
#include <cstdint>

#include "tpusync/base/stream_copy.h"

namespace tpusync {

uint64_t Checksum64(const void* data, size_t bytes, uint64_t seed = 0);

// Copies `bytes` from src to dst and returns Checksum64(dst, bytes, seed) in one pass over memory:
// each kFusedChunkBytes chunk is hashed (XXH3 streaming, the same digest as the one-shot call)
// right after it is copied, while it is still in L1. Rejected: memcpy then Checksum64, which
// reads every block a second time from L2/DRAM (a quarter of the put time at 256 KiB blocks).
// It is Checksum64Stream::CopyUpdate (below) over a fresh state: one fused loop in the project,
// whose hash updates take the AVX2 build of XXH3 from 1 KiB up on CPUs with AVX2 (DISPATCH in
// checksum.cc); same digest.
inline constexpr size_t kFusedChunkBytes = 16 << 10;
uint64_t CopyWithChecksum64(void* dst, const void* src, size_t bytes, uint64_t seed = 0);

// Checksum64 of bytes that arrive in pieces: Update with consecutive pieces, then Digest.
// DIGEST CONTRACT: for any split of the input into pieces (empty ones included), Digest() equals
// Checksum64(whole, seed) (xxHash's streaming XXH3 state; checksum_test.cc proves it). Used to
// verify a block received in pieces while each piece is still in cache (transport/stream.h,
// VERIFY-WHILE-WARM). Same DISPATCH as Checksum64: Update runs the AVX2 build where the CPU has it.
// Not copyable (the state is large and may point into itself); one per thread.
class Checksum64Stream {
 public:
  explicit Checksum64Stream(uint64_t seed = 0);
  Checksum64Stream(const Checksum64Stream&) = delete;
  Checksum64Stream& operator=(const Checksum64Stream&) = delete;
  // Starts over (a new digest with this seed).
  void Reset(uint64_t seed = 0);
  void Update(const void* data, size_t bytes);
  // Copies `bytes` from src to dst and Updates with them in the same pass, like
  // CopyWithChecksum64 (kFusedChunkBytes chunks hashed while in L1; from kStreamMinBytes up the
  // stores are non-temporal and fenced before return). Used to verify a block that is scattered
  // into several destinations piece by piece (tpusync-rl's staging copy, its trainer's fill):
  // the digest covers the whole block while each piece is read from memory once.
  // Rejected: copy then Update (two passes), and a one-shot fused copy per piece (the block's
  // digest is one XXH3 over all its pieces, padding and trailer, not a digest per piece).
  // KEEP-IN-CACHE: `keep_in_cache` uses ordinary stores at every size, for a destination that
  // is read again right away (a trainer's pool block that same-host readers or the transport
  // read next): it stays in the cache hierarchy instead of going to DRAM. Measured on the 2-vCPU
  // VM (32 MiB blocks, one fill then two fused reads of each): fill 0.11-0.13 s vs 0.13-0.15 s
  // non-temporal, the two reads 0.13-0.15 s vs 0.22 s.
  void CopyUpdate(void* dst, const void* src, size_t bytes, bool keep_in_cache = false);
  // CopyUpdate of each run in turn: a gather of a strided tensor box (contiguous rows) into one
  // packed range, or a scatter of a packed range into such a box. The digest covers the runs'
  // bytes in the order given, i.e. the packed bytes. Rejected: a torch gather / scatter copy plus
  // an Update of the packed range (a second pass; tpusync-rl's resharded pieces are such boxes).
  void CopyUpdateRuns(const StreamRun* runs, size_t n, bool keep_in_cache = false);
  // A narrowing cast of n 4-byte source values (read at any alignment) into n 2-byte values:
  // F32ToBf16 (base/bf16.h) or F32ToF16 (base/f16.h).
  using NarrowFn = void (*)(uint16_t* dst, const void* src, size_t n);
  // CopyUpdateRuns with a cast: each run's `bytes` counts SOURCE bytes of float32 values (a
  // multiple of 4) and its dst receives their `narrow` cast (bytes / 2: bfloat16 by the ROUNDING
  // CONTRACT of base/bf16.h, float16 by that of base/f16.h). The digest covers the source bytes
  // in the order given. Each window of up to kFusedChunkBytes of contiguous source (one long run
  // cut into chunks, or consecutive short runs of a packed source: a scatter into a strided box)
  // is hashed, then converted while it is in L1. Rejected: hash, then a framework cast
  // (tensor.copy_) - a second read of the source, which made the cast path of a sampler's
  // staging ~1.6x slower.
  void CastUpdateRuns(const StreamRun* runs, size_t n, NarrowFn narrow);
  uint64_t Digest() const;

  static constexpr size_t kStateBytes = 640;  // >= sizeof(XXH3_state_t), static_asserted

 private:
  alignas(64) unsigned char state_[kStateBytes];
};

}  // namespace tpusync
