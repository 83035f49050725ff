// BlockAllocator: fixed-size blocks carved from one HostPool; O(1) alloc, free and refcounting.
//
// ID CONTRACT: a BlockId is (generation << 32 | slot). Every alloc of a slot bumps its generation,
// so an id kept after its block was freed and reused is refused (kFailedPrecondition) instead of
// silently addressing someone else's data.
//
// LIFETIME CONTRACT: a block has `owners` (alloc = 1, Retain +1, Free -1) and `borrows` (live
// zero-copy views and in-flight copies: AcquireBorrow / ReleaseBorrow). Its slot returns to the
// free list only when both reach zero, so freeing a block that a view or a copy still uses is safe:
// the memory stays valid until the last borrow ends. New borrows require owners > 0 ("a view of a
// freed block is refused"). Free with owners == 0 is a double free (kFailedPrecondition).
//
// ALL-OR-NOTHING: batched calls validate every id before changing anything; on error no state
// moved.
//
// Thread-safe: one mutex guards the free list and counters; every operation is O(batch size).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "tpusync/base/status.h"
#include "tpusync/memory/host_pool.h"

namespace tpusync::memory {

using BlockId = uint64_t;

struct BlockAllocatorStats {
  size_t num_blocks = 0;
  size_t num_free = 0;
  size_t num_borrowed = 0;  // blocks with a live view or copy
  uint64_t allocs = 0;
  uint64_t frees = 0;
  uint64_t exhausted = 0;  // Alloc calls refused for lack of space
};

// OWNERSHIP NOTE: enable_shared_from_this lets the Python bindings hand native code the same
// control block Python holds; without it each conversion makes a shared_ptr whose deleter takes the
// GIL, and an engine worker dropping the last one at interpreter exit would be killed mid-unwind.
class BlockAllocator : public std::enable_shared_from_this<BlockAllocator> {
 public:
  // Blocks start at `offset` bytes into the pool (room for a caller's metadata region) and are
  // spaced by block_stride(): block_bytes rounded up to 4 KiB (blocks >= 4 KiB, so O_DIRECT and DMA
  // can use them in place) or to 64 bytes (cache line) for smaller blocks.
  // With max_blocks > 0 at most that many blocks are carved (a pool rounded up to whole pages can
  // otherwise hold a few more small blocks than asked for).
  static Result<std::unique_ptr<BlockAllocator>> Create(std::unique_ptr<HostPool> pool,
                                                        size_t block_bytes, size_t offset = 0,
                                                        size_t max_blocks = 0);

  static uint32_t SlotOf(BlockId id) { return static_cast<uint32_t>(id & 0xffffffffu); }
  static size_t StrideFor(size_t block_bytes);
  // Bytes of a host pool that holds num_blocks blocks of block_bytes: refused for zero blocks,
  // more than 2^32 blocks, or a size that does not fit in size_t (it used to wrap around to a
  // tiny pool).
  static Result<size_t> PoolBytesFor(size_t block_bytes, size_t num_blocks);

  size_t block_bytes() const { return block_bytes_; }
  size_t block_stride() const { return stride_; }
  size_t num_blocks() const { return slots_.size(); }
  size_t num_free() const;
  BlockAllocatorStats stats() const;
  HostPool& host_pool() { return *pool_; }
  const HostPool& host_pool() const { return *pool_; }

  // Allocates n blocks, all or none (kPoolExhausted names the pool size and the request).
  Result<std::vector<BlockId>> Alloc(size_t n);
  // Allocates the given free slot (used when rebuilding state over a re-attached pool).
  Result<BlockId> Claim(uint32_t slot);
  // Drops one owner reference from each id.
  Status Free(std::span<const BlockId> ids);
  // Adds one owner reference to each id.
  Status Retain(std::span<const BlockId> ids);
  Result<uint32_t> RefCount(BlockId id) const;

  // Borrows keep a block's memory valid (views, copies in flight). Acquire needs a live owner.
  Status AcquireBorrow(std::span<const BlockId> ids);
  void ReleaseBorrow(std::span<const BlockId> ids);

  // Address of a live block (owners > 0).
  Result<uint8_t*> Address(BlockId id) const;
  // Address of a slot regardless of state (for code that owns the slot by other means).
  uint8_t* SlotAddress(uint32_t slot) const { return base_ + static_cast<size_t>(slot) * stride_; }

 private:
  struct Slot {
    uint32_t generation = 0;
    uint32_t owners = 0;
    uint32_t borrows = 0;
  };
  BlockAllocator() = default;
  Status CheckLive(BlockId id) const;  // mu_ held
  void MaybeRecycle(uint32_t slot);    // mu_ held

  std::unique_ptr<HostPool> pool_;
  uint8_t* base_ = nullptr;
  size_t block_bytes_ = 0;
  size_t stride_ = 0;
  mutable std::mutex mu_;
  std::vector<Slot> slots_;
  std::vector<uint32_t> free_;  // stack of free slots
  std::vector<uint8_t> in_free_list_;
  size_t num_borrowed_ = 0;
  uint64_t allocs_ = 0, frees_ = 0, exhausted_ = 0;
};

}  // namespace tpusync::memory
