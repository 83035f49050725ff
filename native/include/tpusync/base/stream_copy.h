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
// bytes copied block by block. Rejected: AVX2/AVX-512 streaming stores (need runtime dispatch;
// SSE2 is in every x86-64 and the copy is memory-bound either way).
#pragma once

#include <cstddef>

namespace tpusync {

inline constexpr size_t kStreamMinBytes = 64 << 10;

// kStreamMinBytes and up: StreamStore + StreamFence; smaller: memcpy.
void StreamCopy(void* dst, const void* src, size_t bytes);
// Non-temporal copy of any size, NOT fenced: call StreamFence before publishing the bytes.
void StreamStore(void* dst, const void* src, size_t bytes);
void StreamFence();

}  // namespace tpusync
