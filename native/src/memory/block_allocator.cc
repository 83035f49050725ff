#include "tpusync/memory/block_allocator.h"

#include <algorithm>

namespace tpusync::memory {

size_t BlockAllocator::StrideFor(size_t block_bytes) {
  const size_t align = block_bytes >= 4096 ? 4096 : 64;
  return (block_bytes + align - 1) / align * align;
}

Result<size_t> BlockAllocator::PoolBytesFor(size_t block_bytes, size_t num_blocks) {
  if (block_bytes == 0) return Status::InvalidArgument("block size must be > 0 bytes");
  if (num_blocks == 0) return Status::InvalidArgument("num_blocks must be > 0");
  if (num_blocks > 0xffffffffu) return Status::InvalidArgument("more than 2^32 blocks in one pool");
  const size_t stride = StrideFor(block_bytes);
  size_t bytes = 0;
  if (stride < block_bytes || __builtin_mul_overflow(stride, num_blocks, &bytes)) {
    return Status::InvalidArgument(
        StrCat(num_blocks, " blocks of ", block_bytes, " bytes do not fit in one address space"));
  }
  return bytes;
}

Result<std::unique_ptr<BlockAllocator>> BlockAllocator::Create(std::unique_ptr<HostPool> pool,
                                                               size_t block_bytes, size_t offset,
                                                               size_t max_blocks) {
  if (!pool) return Status::InvalidArgument("BlockAllocator needs a host pool");
  if (block_bytes == 0) return Status::InvalidArgument("block size must be > 0 bytes");
  if (offset % 4096 != 0)
    return Status::InvalidArgument("block region offset must be 4 KiB aligned");
  const size_t stride = StrideFor(block_bytes);
  if (offset > pool->size() || (pool->size() - offset) / stride == 0) {
    return Status::InvalidArgument(StrCat("a host pool of ", pool->size(),
                                          " bytes cannot hold one block of ", block_bytes,
                                          " bytes after a ", offset, "-byte header"));
  }
  size_t n = (pool->size() - offset) / stride;
  if (max_blocks > 0) n = std::min(n, max_blocks);
  if (n > 0xffffffffu) return Status::InvalidArgument("more than 2^32 blocks in one pool");
  std::unique_ptr<BlockAllocator> a(new BlockAllocator());
  a->base_ = pool->data() + offset;
  a->pool_ = std::move(pool);
  a->block_bytes_ = block_bytes;
  a->stride_ = stride;
  a->slots_.resize(n);
  a->free_.reserve(n);
  a->in_free_list_.assign(n, 1);
  // Pop order 0, 1, 2, ...: low addresses first keeps small working sets compact.
  for (size_t i = n; i-- > 0;) a->free_.push_back(static_cast<uint32_t>(i));
  return a;
}

size_t BlockAllocator::num_free() const {
  std::lock_guard<std::mutex> lock(mu_);
  return free_.size();
}

BlockAllocatorStats BlockAllocator::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return {slots_.size(), free_.size(), num_borrowed_, allocs_, frees_, exhausted_};
}

Status BlockAllocator::CheckLive(BlockId id) const {
  const uint32_t slot = SlotOf(id);
  const uint32_t gen = static_cast<uint32_t>(id >> 32);
  if (slot >= slots_.size()) {
    return Status::InvalidArgument(StrCat("unknown block id ", id, ": slot ", slot,
                                          " is outside a pool of ", slots_.size(), " blocks"));
  }
  const Slot& s = slots_[slot];
  if (s.generation != gen) {
    return Status::FailedPrecondition(
        StrCat("stale block id ", id, ": slot ", slot, " was freed and reallocated"));
  }
  if (s.owners == 0) {
    return Status::FailedPrecondition(StrCat("block id ", id, " was already freed"));
  }
  return Status::OK();
}

void BlockAllocator::MaybeRecycle(uint32_t slot) {
  Slot& s = slots_[slot];
  if (s.owners == 0 && s.borrows == 0 && !in_free_list_[slot]) {
    in_free_list_[slot] = 1;
    free_.push_back(slot);
  }
}

Result<std::vector<BlockId>> BlockAllocator::Alloc(size_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  if (n > free_.size()) {
    ++exhausted_;
    return Status::PoolExhausted(StrCat("host block pool exhausted: requested ", n, " blocks of ",
                                        block_bytes_, " bytes but only ", free_.size(), " of ",
                                        slots_.size(), " are free (pool size ", pool_->size(),
                                        " bytes); free blocks, or create a larger pool"));
  }
  std::vector<BlockId> ids;
  ids.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const uint32_t slot = free_.back();
    free_.pop_back();
    in_free_list_[slot] = 0;
    Slot& s = slots_[slot];
    ++s.generation;
    s.owners = 1;
    ids.push_back((static_cast<uint64_t>(s.generation) << 32) | slot);
  }
  allocs_ += n;
  return ids;
}

Result<BlockId> BlockAllocator::Claim(uint32_t slot) {
  std::lock_guard<std::mutex> lock(mu_);
  if (slot >= slots_.size()) {
    return Status::InvalidArgument(
        StrCat("slot ", slot, " is outside a pool of ", slots_.size(), " blocks"));
  }
  if (!in_free_list_[slot]) return Status::AlreadyExists(StrCat("slot ", slot, " is in use"));
  // O(n) removal from the free stack is fine: Claim runs once per slot while rebuilding.
  free_.erase(std::find(free_.begin(), free_.end(), slot));
  in_free_list_[slot] = 0;
  Slot& s = slots_[slot];
  ++s.generation;
  s.owners = 1;
  ++allocs_;
  return (static_cast<uint64_t>(s.generation) << 32) | slot;
}

Status BlockAllocator::Free(std::span<const BlockId> ids) {
  std::lock_guard<std::mutex> lock(mu_);
  for (BlockId id : ids) TPUSYNC_RETURN_IF_ERROR(CheckLive(id));
  // OWNER COUNT RULE: one batch may name an id at most as often as the block has owners. More
  // would recycle the slot while an owner still uses it (and wrap the count): a later alloc()
  // then handed the same memory out again. Counted on a sorted copy, O(n log n).
  if (ids.size() > 1) {
    std::vector<BlockId> sorted(ids.begin(), ids.end());
    std::sort(sorted.begin(), sorted.end());
    for (size_t i = 0; i < sorted.size();) {
      size_t j = i + 1;
      while (j < sorted.size() && sorted[j] == sorted[i]) ++j;
      if (j - i > slots_[SlotOf(sorted[i])].owners) {
        return Status::FailedPrecondition(
            StrCat("block id ", sorted[i], " appears ", j - i, " times in one free() call but has ",
                   slots_[SlotOf(sorted[i])].owners, " owner(s) (double free)"));
      }
      i = j;
    }
  }
  for (BlockId id : ids) {
    const uint32_t slot = SlotOf(id);
    --slots_[slot].owners;
    MaybeRecycle(slot);
  }
  frees_ += ids.size();
  return Status::OK();
}

Status BlockAllocator::Retain(std::span<const BlockId> ids) {
  std::lock_guard<std::mutex> lock(mu_);
  for (BlockId id : ids) TPUSYNC_RETURN_IF_ERROR(CheckLive(id));
  for (BlockId id : ids) ++slots_[SlotOf(id)].owners;
  return Status::OK();
}

Result<uint32_t> BlockAllocator::RefCount(BlockId id) const {
  std::lock_guard<std::mutex> lock(mu_);
  TPUSYNC_RETURN_IF_ERROR(CheckLive(id));
  return slots_[SlotOf(id)].owners;
}

Status BlockAllocator::AcquireBorrow(std::span<const BlockId> ids) {
  std::lock_guard<std::mutex> lock(mu_);
  for (BlockId id : ids) TPUSYNC_RETURN_IF_ERROR(CheckLive(id));
  for (BlockId id : ids) {
    if (slots_[SlotOf(id)].borrows++ == 0) ++num_borrowed_;
  }
  return Status::OK();
}

void BlockAllocator::ReleaseBorrow(std::span<const BlockId> ids) {
  std::lock_guard<std::mutex> lock(mu_);
  for (BlockId id : ids) {
    const uint32_t slot = SlotOf(id);
    if (slot >= slots_.size() || slots_[slot].borrows == 0) continue;  // tolerate, never underflow
    if (--slots_[slot].borrows == 0) --num_borrowed_;
    MaybeRecycle(slot);
  }
}

Result<uint8_t*> BlockAllocator::Address(BlockId id) const {
  std::lock_guard<std::mutex> lock(mu_);
  TPUSYNC_RETURN_IF_ERROR(CheckLive(id));
  return SlotAddress(SlotOf(id));
}

}  // namespace tpusync::memory
