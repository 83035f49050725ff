// RowBuffer: caller memory holding blocks at a fixed stride (numpy / torch / JAX host arrays, a
// block-major paged cache). Used by the engine's block transfers and by the tiered store.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace tpusync::memory {

// Caller memory holding blocks at a fixed stride: row r starts at base + r * stride. With `rows`
// empty, block i of a batch is row i; otherwise it is row rows[i] (a gather / scatter over a
// block-major paged cache). Every row index must be < num_rows, checked before any byte moves.
struct RowBuffer {
  uint8_t* base = nullptr;
  size_t stride = 0;
  size_t num_rows = 0;
  std::vector<uint64_t> rows;
};

}  // namespace tpusync::memory
