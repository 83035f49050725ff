// Batched copies between caller memory and pool blocks (the host side of every offload path).
//
// Two forms: a row form (RowBuffer: block i is one contiguous row of caller memory) and a segment
// form (SegmentList: block i is assembled from / scattered to any number of contiguous spans of
// caller memory, for paged caches where one block is not one row - K/V split on an outer axis, the
// block axis inside the heads axis, several layers packed into one host block).
//
// BORROW CONTRACT: PutBlocks / GetBlocks validate every id and borrow every block before any byte
// moves (an unknown, stale or freed id fails the whole batch with nothing copied), and release the
// borrows when the copy completes, so a block freed mid-copy is recycled only afterwards.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "tpusync/engine/future.h"
#include "tpusync/engine/thread_pool.h"
#include "tpusync/memory/block_allocator.h"
#include "tpusync/memory/row_buffer.h"

namespace tpusync::engine {

using memory::RowBuffer;  // memory/row_buffer.h (the store uses it too)

// Copies row(i) of `src` into pool block ids[i].
Future PutBlocks(ThreadPool& pool, std::shared_ptr<memory::BlockAllocator> blocks,
                 std::vector<memory::BlockId> ids, RowBuffer src);
// Copies pool block ids[i] into row(i) of `dst`.
Future GetBlocks(ThreadPool& pool, std::shared_ptr<memory::BlockAllocator> blocks,
                 std::vector<memory::BlockId> ids, RowBuffer dst);

// One contiguous span of caller memory that the segment form may read or write.
struct MemoryRegion {
  uint8_t* base = nullptr;
  size_t bytes = 0;
};

// One segment: `bytes` bytes at `block_offset` inside pool block ids[block] pair with the same
// number of bytes at `region_offset` inside regions[region].
struct Segment {
  uint64_t block = 0;
  uint64_t block_offset = 0;
  uint64_t region = 0;
  uint64_t region_offset = 0;
  uint64_t bytes = 0;
};
static_assert(sizeof(Segment) == 5 * sizeof(uint64_t),
              "Segment is filled from an [n, 5] uint64 array: keep it five packed uint64 fields");

// SEGMENT CONTRACT: every segment is bounds-checked before any byte moves - block index < ids,
// block_offset + bytes <= block_bytes, region index < regions, region_offset + bytes <= region
// bytes (all overflow-safe) - and every id is borrowed, so a bad plan fails the whole batch with
// nothing copied and can never touch memory outside the regions and blocks it names. Segments of
// one call must not overlap on their destination side (checked by the planner, not here: an
// overlap is a data race on bytes the caller owns, never an out-of-bounds access).
//
// Rejected alternative: raw source addresses per segment (no region table). It is what a DMA
// engine takes, but then nothing native can check that an address belongs to the caller's arrays.
struct SegmentList {
  std::vector<MemoryRegion> regions;
  std::vector<Segment> segments;
};

// Gathers caller memory into pool blocks: each segment copies region bytes into its block.
Future PutSegments(ThreadPool& pool, std::shared_ptr<memory::BlockAllocator> blocks,
                   std::vector<memory::BlockId> ids, SegmentList src);
// Scatters pool blocks into caller memory: each segment copies block bytes into its region.
Future GetSegments(ThreadPool& pool, std::shared_ptr<memory::BlockAllocator> blocks,
                   std::vector<memory::BlockId> ids, SegmentList dst);

}  // namespace tpusync::engine
