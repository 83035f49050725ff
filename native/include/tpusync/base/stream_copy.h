// StreamCopy: a memcpy for large blocks whose destination is not read again soon (a DRAM tier
// slot on put, a staging buffer on get).
//
// STREAM CONTRACT: same bytes as memcpy; on return every byte is globally visible in order before
// any later store (an sfence ends the copy), so a caller may publish the block (write its header,
// complete a future) right after. Below kStreamMinBytes, or off x86-64, it is plain memcpy.
// Why: at block sizes glibc copies with ordinary stores, which first read every destination line
// (read-for-ownership): three memory transfers per byte instead of two. glibc switches to
// non-temporal stores only for copies larger than a share of the L3 (hundreds of MB on large
// servers), so a single 256 MB memcpy - the benchmark reference - is faster per byte than the same
// bytes copied block by block.
//
// LANE CONTRACT (StreamStore, StreamStoreRuns): the bytes are cut into pieces of at most one
// 4 KiB page and copied kLanes pieces at a time, one 64-byte line of each in turn, with full-line
// non-temporal stores to 64-byte aligned destinations (the unaligned head and tail of a run, under
// one line each, go through memcpy). Several independent page streams in flight keep more loads
// outstanding than one stream, whose hardware prefetch restarts at every page and, for a gather
// of scattered runs, at every run. Measured on the 2-vCPU build VM (single thread, CPU time per
// byte against one 256 MiB glibc memcpy, same process, 15 interleaved rounds): 8 KiB runs of a
// [heads, blocks, run] cache gathered into host blocks 0.75x (one stream, 16-byte SSE2 stores)
// -> 1.15x (4 lanes, 64-byte AVX-512 stores); 4 KiB runs 0.72x -> 1.05x; 1 MiB contiguous spans
// 0.81x -> 1.12x. The AVX-512 line copy is chosen at run time; without AVX-512 the pieces are
// copied one after another with 16-byte SSE2 stores (NO-AVX-512 RULE in stream_copy.cc: the
// lanes made the SSE2 copy 3-5x slower on a CPU without AVX-512).
// Rejected: one stream with wider stores only (AVX-512 alone: 0.87x on 8 KiB runs), software
// prefetch ahead of one stream (no gain), AVX2 32-byte stores (slower than SSE2 on that VM).
#pragma once

#include <cstddef>
#include <cstdint>

namespace tpusync {

inline constexpr size_t kStreamMinBytes = 64 << 10;

// One run of a batched non-temporal copy. Runs must not overlap each other's destinations or
// their sources' bytes (the lanes copy them in an interleaved order).
struct StreamRun {
  uint8_t* dst;
  const uint8_t* src;
  size_t bytes;
};

// kStreamMinBytes and up: StreamStore + StreamFence; smaller: memcpy.
void StreamCopy(void* dst, const void* src, size_t bytes);
// Non-temporal copy of any size, NOT fenced: call StreamFence before publishing the bytes.
void StreamStore(void* dst, const void* src, size_t bytes);
// Every run, non-temporal, interleaved across lanes (LANE CONTRACT); NOT fenced.
void StreamStoreRuns(const StreamRun* runs, size_t n);
// StreamStoreRuns with the SSE2 line copy whatever the CPU offers (tests cover both copies).
void StreamStoreRunsSse2(const StreamRun* runs, size_t n);
void StreamFence();

}  // namespace tpusync
