#include "tpusync/engine/block_transfer.h"

#include "tpusync/engine/copy.h"

namespace tpusync::engine {
namespace {

Future Transfer(ThreadPool& pool, std::shared_ptr<memory::BlockAllocator> blocks,
                std::vector<memory::BlockId> ids, RowBuffer user, bool put) {
  const size_t bytes = blocks->block_bytes();
  if (!ids.empty() && user.stride < bytes) {
    return Future::Completed(Status::InvalidArgument(
        StrCat("buffer row stride ", user.stride, " is smaller than the block size ", bytes)));
  }
  if (!user.rows.empty() && user.rows.size() != ids.size()) {
    return Future::Completed(Status::InvalidArgument(StrCat(
        user.rows.size(), " row indices given for ", ids.size(), " blocks; counts must match")));
  }
  const size_t needed = user.rows.empty() ? ids.size() : 0;
  if (needed > user.num_rows) {
    return Future::Completed(Status::InvalidArgument(
        StrCat("buffer holds ", user.num_rows, " blocks but ", needed, " were asked for")));
  }
  for (uint64_t r : user.rows) {
    if (r >= user.num_rows) {
      return Future::Completed(Status::InvalidArgument(
          StrCat("row index ", r, " is out of range for a buffer of ", user.num_rows, " blocks")));
    }
  }
  Status borrowed = blocks->AcquireBorrow(ids);
  if (!borrowed.ok()) return Future::Completed(borrowed);
  std::vector<CopySpan> spans;
  spans.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    uint8_t* block = blocks->SlotAddress(memory::BlockAllocator::SlotOf(ids[i]));
    uint8_t* mem = user.base + (user.rows.empty() ? i : user.rows[i]) * user.stride;
    spans.push_back(put ? CopySpan{block, mem, bytes} : CopySpan{mem, block, bytes});
  }
  Future f = CopyAsync(pool, std::move(spans));
  f->OnCleanup([blocks, ids = std::move(ids)](const Status&) { blocks->ReleaseBorrow(ids); });
  return f;
}

Status CheckSegments(const memory::BlockAllocator& blocks, size_t num_ids,
                     const SegmentList& list) {
  const uint64_t block_bytes = blocks.block_bytes();
  for (size_t i = 0; i < list.segments.size(); ++i) {
    const Segment& s = list.segments[i];
    if (s.block >= num_ids) {
      return Status::InvalidArgument(
          StrCat("segment ", i, " names block ", s.block, " of a batch of ", num_ids, " blocks"));
    }
    if (s.block_offset > block_bytes || s.bytes > block_bytes - s.block_offset) {
      return Status::InvalidArgument(StrCat("segment ", i, " covers bytes [", s.block_offset, ", ",
                                            s.block_offset, " + ", s.bytes, ") of a block of ",
                                            block_bytes, " bytes"));
    }
    if (s.region >= list.regions.size()) {
      return Status::InvalidArgument(StrCat("segment ", i, " names region ", s.region, " of ",
                                            list.regions.size(), " regions"));
    }
    const uint64_t region_bytes = list.regions[s.region].bytes;
    if (s.region_offset > region_bytes || s.bytes > region_bytes - s.region_offset) {
      return Status::InvalidArgument(StrCat("segment ", i, " covers bytes [", s.region_offset, ", ",
                                            s.region_offset, " + ", s.bytes, ") of region ",
                                            s.region, " which holds ", region_bytes, " bytes"));
    }
  }
  return Status::OK();
}

Future TransferSegments(ThreadPool& pool, std::shared_ptr<memory::BlockAllocator> blocks,
                        std::vector<memory::BlockId> ids, SegmentList user, bool put) {
  Status valid = CheckSegments(*blocks, ids.size(), user);
  if (!valid.ok()) return Future::Completed(valid);
  Status borrowed = blocks->AcquireBorrow(ids);
  if (!borrowed.ok()) return Future::Completed(borrowed);
  std::vector<uint8_t*> block_base(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    block_base[i] = blocks->SlotAddress(memory::BlockAllocator::SlotOf(ids[i]));
  }
  std::vector<CopySpan> spans;
  spans.reserve(user.segments.size());
  for (const Segment& s : user.segments) {
    if (s.bytes == 0) continue;
    uint8_t* block = block_base[s.block] + s.block_offset;
    uint8_t* mem = user.regions[s.region].base + s.region_offset;
    spans.push_back(put ? CopySpan{block, mem, s.bytes} : CopySpan{mem, block, s.bytes});
  }
  Future f = CopyAsync(pool, std::move(spans));
  f->OnCleanup([blocks, ids = std::move(ids)](const Status&) { blocks->ReleaseBorrow(ids); });
  return f;
}

}  // namespace

Future PutSegments(ThreadPool& pool, std::shared_ptr<memory::BlockAllocator> blocks,
                   std::vector<memory::BlockId> ids, SegmentList src) {
  return TransferSegments(pool, std::move(blocks), std::move(ids), std::move(src), /*put=*/true);
}

Future GetSegments(ThreadPool& pool, std::shared_ptr<memory::BlockAllocator> blocks,
                   std::vector<memory::BlockId> ids, SegmentList dst) {
  return TransferSegments(pool, std::move(blocks), std::move(ids), std::move(dst), /*put=*/false);
}

Future PutBlocks(ThreadPool& pool, std::shared_ptr<memory::BlockAllocator> blocks,
                 std::vector<memory::BlockId> ids, RowBuffer src) {
  return Transfer(pool, std::move(blocks), std::move(ids), std::move(src), /*put=*/true);
}

Future GetBlocks(ThreadPool& pool, std::shared_ptr<memory::BlockAllocator> blocks,
                 std::vector<memory::BlockId> ids, RowBuffer dst) {
  return Transfer(pool, std::move(blocks), std::move(ids), std::move(dst), /*put=*/false);
}

}  // namespace tpusync::engine
