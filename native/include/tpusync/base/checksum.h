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

namespace tpusync {

uint64_t Checksum64(const void* data, size_t bytes, uint64_t seed = 0);

}  // namespace tpusync
