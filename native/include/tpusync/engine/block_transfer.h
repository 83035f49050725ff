// Batched copies between caller memory and pool blocks (the host side of every offload path).
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

namespace tpusync::engine {

// Caller memory holding blocks at a fixed stride: row r starts at base + r * stride. With `rows`
// empty, block i of a batch is row i; otherwise it is row rows[i] (a gather / scatter over a
// block-major paged cache). Every row index must be < num_rows, checked before any byte moves.
struct RowBuffer {
  uint8_t* base = nullptr;
  size_t stride = 0;
  size_t num_rows = 0;
  std::vector<uint64_t> rows;
};

// Copies row(i) of `src` into pool block ids[i].
Future PutBlocks(ThreadPool& pool, std::shared_ptr<memory::BlockAllocator> blocks,
                 std::vector<memory::BlockId> ids, RowBuffer src);
// Copies pool block ids[i] into row(i) of `dst`.
Future GetBlocks(ThreadPool& pool, std::shared_ptr<memory::BlockAllocator> blocks,
                 std::vector<memory::BlockId> ids, RowBuffer dst);

}  // namespace tpusync::engine
