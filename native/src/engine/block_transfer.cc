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
  f->OnComplete([blocks, ids = std::move(ids)](const Status&) { blocks->ReleaseBorrow(ids); });
  return f;
}

}  // namespace

Future PutBlocks(ThreadPool& pool, std::shared_ptr<memory::BlockAllocator> blocks,
                 std::vector<memory::BlockId> ids, RowBuffer src) {
  return Transfer(pool, std::move(blocks), std::move(ids), std::move(src), /*put=*/true);
}

Future GetBlocks(ThreadPool& pool, std::shared_ptr<memory::BlockAllocator> blocks,
                 std::vector<memory::BlockId> ids, RowBuffer dst) {
  return Transfer(pool, std::move(blocks), std::move(ids), std::move(dst), /*put=*/false);
}

}  // namespace tpusync::engine
