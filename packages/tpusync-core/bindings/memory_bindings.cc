// BlockPool = HostPool + BlockAllocator, and zero-copy DLPack views of its blocks.
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <optional>
#include <vector>

#include "bindings.h"
#include "dtype.h"
#include "tpusync/base/seconds.h"
#include "tpusync/memory/block_allocator.h"
#include "tpusync/memory/shm_reclaim.h"

namespace tpusync::bindings {
namespace {

using memory::BlockAllocator;
using memory::BlockId;

std::string ShapeString(const std::vector<size_t>& dims) {
  std::string out = "(";
  for (size_t i = 0; i < dims.size(); ++i) out += (i ? ", " : "") + std::to_string(dims[i]);
  return out + (dims.size() == 1 ? ",)" : ")");
}

struct Borrow {
  std::shared_ptr<BlockAllocator> blocks;
  BlockId id;
};

// BATCH BORROW CONTRACT: every id is checked and borrowed at once (all or nothing, one lock);
// the borrows end at release() or when the object is collected, whichever comes first. It is what
// a framework holds while a DMA it issued itself (a CUDA copy stream) reads or writes the blocks:
// a block freed meanwhile is recycled only afterwards. Rejected alternative: one numpy view per
// block, which costs a Python object per block and dominated large CUDA batches.
class BatchBorrow {
 public:
  BatchBorrow(std::shared_ptr<BlockAllocator> blocks, std::vector<BlockId> ids)
      : blocks_(std::move(blocks)), ids_(std::move(ids)) {
    ThrowIfError(blocks_->AcquireBorrow(ids_));
  }
  BatchBorrow(const BatchBorrow&) = delete;
  BatchBorrow& operator=(const BatchBorrow&) = delete;
  ~BatchBorrow() { Release(); }

  void Release() {
    if (blocks_) blocks_->ReleaseBorrow(ids_);
    blocks_.reset();
  }
  bool active() const { return blocks_ != nullptr; }
  size_t size() const { return ids_.size(); }
  std::vector<uint32_t> slots() const {
    std::vector<uint32_t> out(ids_.size());
    for (size_t i = 0; i < ids_.size(); ++i) out[i] = BlockAllocator::SlotOf(ids_[i]);
    return out;
  }

 private:
  std::shared_ptr<BlockAllocator> blocks_;
  std::vector<BlockId> ids_;
};

// Shape and dtype checks, then a borrow that the array's owner capsule returns when the last
// framework reference to the view dies.
template <typename... Framework>
nb::ndarray<Framework...> MakeView(const std::shared_ptr<BlockAllocator>& blocks, BlockId id,
                                   const std::string& dtype,
                                   const std::optional<std::vector<size_t>>& shape) {
  const nb::dlpack::dtype dt = ParseDType(dtype);
  const size_t item = dt.bits / 8;
  std::vector<size_t> dims;
  if (shape) {
    dims = *shape;
    size_t bytes = item;
    for (size_t d : dims) bytes *= d;
    if (bytes != blocks->block_bytes()) {
      throw StatusError(Status::InvalidArgument(
          StrCat("a view of shape ", ShapeString(dims), " and dtype ", dtype, " covers ", bytes,
                 " bytes but a block holds ", blocks->block_bytes(), " bytes")));
    }
  } else {
    if (blocks->block_bytes() % item != 0) {
      throw StatusError(
          Status::InvalidArgument(StrCat("block size ", blocks->block_bytes(),
                                         " is not a multiple of the ", dtype, " item size")));
    }
    dims = {blocks->block_bytes() / item};
  }
  ThrowIfError(blocks->AcquireBorrow({&id, 1}));
  auto* borrow = new Borrow{blocks, id};
  nb::capsule owner(borrow, [](void* p) noexcept {
    auto* b = static_cast<Borrow*>(p);
    b->blocks->ReleaseBorrow({&b->id, 1});
    delete b;
  });
  void* data = blocks->SlotAddress(BlockAllocator::SlotOf(id));
  return nb::ndarray<Framework...>(data, dims.size(), dims.data(), owner, nullptr, dt,
                                   nb::device::cpu::value);
}

}  // namespace

void init_memory(nb::module_& m) {
  nb::class_<BatchBorrow>(m, "BlockBorrow",
                          "Borrows of a batch of blocks (memory kept valid until release()).")
      .def_prop_ro("active", &BatchBorrow::active)
      .def_prop_ro("slots", &BatchBorrow::slots, "Pool slot of each id, in the given order.")
      .def("__len__", &BatchBorrow::size)
      .def("release", &BatchBorrow::Release, "End the borrows now (idempotent).");

  nb::class_<BlockAllocator>(
      m, "BlockPool", "Fixed-size host blocks in one prefaulted pool (anonymous or /dev/shm).")
      .def_static(
          "create",
          [](size_t block_bytes, size_t num_blocks, const std::string& shm_name, bool persist,
             bool prefault, bool huge_pages, bool lock_memory) {
            nb::gil_scoped_release release;  // prefaulting gigabytes takes a while
            memory::HostPoolOptions opts;
            opts.size_bytes = Unwrap(BlockAllocator::PoolBytesFor(block_bytes, num_blocks));
            opts.shm_name = shm_name;
            opts.persist = persist;
            opts.prefault = prefault;
            opts.huge_pages = huge_pages;
            opts.mlock = lock_memory;
            auto host = Unwrap(memory::HostPool::Create(opts));
            return OwnedGilFree(
                Unwrap(BlockAllocator::Create(std::move(host), block_bytes)).release());
          },
          nb::arg("block_bytes"), nb::arg("num_blocks"), nb::arg("shm_name") = "",
          nb::arg("persist") = false, nb::arg("prefault") = true, nb::arg("huge_pages") = false,
          nb::arg("mlock") = false)
      .def_prop_ro("block_bytes", &BlockAllocator::block_bytes)
      .def_prop_ro("block_stride", &BlockAllocator::block_stride)
      .def_prop_ro("num_blocks", &BlockAllocator::num_blocks)
      .def_prop_ro("num_free", &BlockAllocator::num_free)
      .def_prop_ro("pool_bytes", [](const BlockAllocator& a) { return a.host_pool().size(); })
      .def_prop_ro("shm_name", [](const BlockAllocator& a) { return a.host_pool().shm_name(); })
      .def_prop_ro("attached", [](const BlockAllocator& a) { return a.host_pool().attached(); })
      .def_prop_ro("huge_pages",
                   [](const BlockAllocator& a) { return a.host_pool().huge_pages_active(); })
      .def_prop_ro("locked", [](const BlockAllocator& a) { return a.host_pool().locked(); })
      .def(
          "wait_huge_pages",
          [](const BlockAllocator& a, double timeout) {
            return a.host_pool().WaitHugePages(SecondsToMs(timeout));
          },
          nb::arg("timeout") = 60.0, nb::call_guard<nb::gil_scoped_release>(),
          "Waits up to `timeout` s for a /dev/shm pool's background huge-page collapse; True "
          "when none is running.")
      .def_prop_ro(
          "base_address",
          [](const BlockAllocator& a) { return reinterpret_cast<uintptr_t>(a.SlotAddress(0)); })
      .def("stats",
           [](const BlockAllocator& a) {
             const auto s = a.stats();
             nb::dict d;
             d["num_blocks"] = s.num_blocks;
             d["num_free"] = s.num_free;
             d["num_borrowed"] = s.num_borrowed;
             d["allocs"] = s.allocs;
             d["frees"] = s.frees;
             d["exhausted"] = s.exhausted;
             return d;
           })
      .def(
          "alloc", [](BlockAllocator& a, size_t n) { return Unwrap(a.Alloc(n)); }, nb::arg("n"),
          nb::call_guard<nb::gil_scoped_release>())
      .def(
          "free",
          [](BlockAllocator& a, const std::vector<BlockId>& ids) { ThrowIfError(a.Free(ids)); },
          nb::arg("ids"), nb::call_guard<nb::gil_scoped_release>())
      .def(
          "retain",
          [](BlockAllocator& a, const std::vector<BlockId>& ids) { ThrowIfError(a.Retain(ids)); },
          nb::arg("ids"), nb::call_guard<nb::gil_scoped_release>())
      .def(
          "claim", [](BlockAllocator& a, uint32_t slot) { return Unwrap(a.Claim(slot)); },
          nb::arg("slot"))
      .def(
          "refcount", [](const BlockAllocator& a, BlockId id) { return Unwrap(a.RefCount(id)); },
          nb::arg("id"))
      .def(
          "address",
          [](const BlockAllocator& a, BlockId id) {
            return reinterpret_cast<uintptr_t>(Unwrap(a.Address(id)));
          },
          nb::arg("id"))
      .def_static("slot_of", &BlockAllocator::SlotOf, nb::arg("id"))
      .def(
          "borrow",
          [](std::shared_ptr<BlockAllocator> a, std::vector<BlockId> ids) {
            return std::make_unique<BatchBorrow>(std::move(a), std::move(ids));
          },
          nb::arg("ids"),
          "Borrow every block of ``ids`` at once (unknown, stale or freed ids raise, none "
          "borrowed); the memory stays valid until the returned BlockBorrow is released.")
      .def(
          "view",
          [](std::shared_ptr<BlockAllocator> a, BlockId id, const std::string& dtype,
             std::optional<std::vector<size_t>> shape) {
            return MakeView<nb::numpy>(a, id, dtype, shape);
          },
          nb::arg("id"), nb::arg("dtype") = "uint8", nb::arg("shape") = nb::none(),
          "A writable numpy array over the block's memory (no copy). The block's memory stays "
          "valid while the array lives, even if the block is freed.")
      .def(
          "dlpack",
          [](std::shared_ptr<BlockAllocator> a, BlockId id, const std::string& dtype,
             std::optional<std::vector<size_t>> shape) {
            return MakeView<nb::array_api>(a, id, dtype, shape);
          },
          nb::arg("id"), nb::arg("dtype") = "uint8", nb::arg("shape") = nb::none(),
          "A DLPack-exporting array over the block (torch.from_dlpack, jax.dlpack.from_dlpack, "
          "np.from_dlpack take it without a copy).")
      .def(
          "unlink", [](BlockAllocator& a) { ThrowIfError(a.host_pool().Unlink()); },
          "Remove the /dev/shm name now; the mapping stays valid until the pool is closed.");

  m.def(
      "reclaim_stale_segments",
      [](const std::string& prefix) {
        std::vector<std::pair<std::string, uint64_t>> out;
        for (auto& seg : Unwrap(memory::ReclaimStaleSegments(prefix))) {
          out.emplace_back(std::move(seg.name), seg.bytes);
        }
        return out;
      },
      nb::arg("prefix"),
      "Unlink every /dev/shm/<prefix>* segment that no live pool owns (its owner was destroyed or "
      "its process died, e.g. by SIGKILL) and return [(name, bytes)] of what was removed. Only "
      "for prefixes of non-persistent pools: a persistent warm-restart segment has no live owner "
      "either. InvalidArgumentError for a prefix under 8 characters or with characters outside "
      "letters, digits, '-', '_' and '.'.");
  m.def(
      "shm_segments",
      [](const std::string& prefix) {
        std::vector<std::tuple<std::string, uint64_t, bool>> out;
        for (auto& seg : Unwrap(memory::ListSegments(prefix))) {
          out.emplace_back(std::move(seg.name), seg.bytes, seg.owned);
        }
        return out;
      },
      nb::arg("prefix"),
      "[(name, bytes, owned)] of every /dev/shm/<prefix>* segment, in name order; owned: a live "
      "pool holds it. Removes nothing. Same prefix rules as reclaim_stale_segments.");
}

}  // namespace tpusync::bindings
