// Batched host memory copies on the engine's workers.
//
// COPY CONTRACT: CopyAsync splits the spans into one part per worker with balanced byte counts
// (large spans are cut at chunk boundaries), so a batch of many small blocks and one huge block
// both keep every worker busy. Caller memory must stay valid until the future completes; the
// bindings guarantee this by holding the arrays (and block borrows) until then.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "tpusync/engine/future.h"
#include "tpusync/engine/thread_pool.h"

namespace tpusync::engine {

struct CopySpan {
  uint8_t* dst;
  const uint8_t* src;
  size_t bytes;
};

inline constexpr size_t kCopyChunkBytes = size_t{4} << 20;

// COALESCE CONTRACT: neighbours in the given order merge only when both their destinations AND
// their sources are back to back (a.dst + a.bytes == b.dst and a.src + a.bytes == b.src), so the
// merged span copies exactly the bytes the two did; empty spans are dropped; the order is kept.
// Used by CopyAsync: a batch over consecutive device blocks and consecutive pool slots (vLLM's
// CPU layout, a contiguous region) becomes a few long runs instead of one span per block.
// Rejected: sorting spans by address first (a gather whose runs interleave two regions, e.g.
// heads of a [heads, blocks, ...] cache, still never merges, and sorting costs n log n).
std::vector<CopySpan> CoalesceSpans(std::vector<CopySpan> spans);

// Splits spans into at most `parts` groups of about equal bytes, cutting spans at `chunk` bytes.
std::vector<std::vector<CopySpan>> PartitionCopies(const std::vector<CopySpan>& spans, size_t parts,
                                                   size_t chunk = kCopyChunkBytes);

// Copies every span; completes OK, or kCancelled if cancelled between chunks.
Future CopyAsync(ThreadPool& pool, std::vector<CopySpan> spans);

// Seconds taken by one plain memcpy of `bytes` on the calling thread (the benchmark reference).
double TimedMemcpySeconds(void* dst, const void* src, size_t bytes);

}  // namespace tpusync::engine
