// BlockKey: an engine's block hash, treated as opaque bytes.
//
// KEY CONTRACT: tpusync never computes or interprets a key. vLLM's request.block_hashes, SGLang's
// page hashes or any other content address are used byte for byte, so a prefix stored by one
// process is found by another that hashes the same tokens. Keys are 1..kMaxKeyBytes bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "tpusync/base/status.h"

namespace tpusync::block {

inline constexpr size_t kMaxKeyBytes = 64;

using BlockKey = std::string;

Status ValidateKey(std::string_view key);

// Hashes key bytes with XXH3 (keys are often already hashes, but not always well mixed).
struct BlockKeyHash {
  using is_transparent = void;  // heterogeneous lookup by string_view, no key copies
  size_t operator()(std::string_view key) const;
};

}  // namespace tpusync::block
