// Engine (worker threads), Future, and batched copies between caller arrays and pool blocks.
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "bindings.h"
#include "tpusync/base/seconds.h"
#include "tpusync/engine/block_transfer.h"
#include "tpusync/engine/copy.h"
#include "tpusync/engine/thread_pool.h"

namespace tpusync::bindings {
namespace {

using engine::Future;
using engine::ThreadPool;
using memory::BlockAllocator;
using memory::BlockId;

using SrcArray = nb::ndarray<nb::ro, nb::device::cpu>;
using DstArray = nb::ndarray<nb::device::cpu>;

bool Finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

// EXIT GATE: an engine worker enters Python (a done-callback, a DROP HAND-OFF decref) only
// through a PythonEntry, and tpusync.core's atexit hook closes the gate (close_exit_gate), then
// waits, GIL released, until no worker is inside. Checking Finalizing() alone raced: a callback
// that gave up the GIL (a sleep, file I/O, another future's result) let the main thread start
// finalizing, and taking the GIL back then ended the worker thread with a forced unwind through a
// noexcept frame: std::terminate, the process aborted at exit (5 of 5 runs of such a callback).
// The entry is counted BEFORE the gate is checked and the hook closes the gate BEFORE it counts,
// so one of the two always sees the other (sequentially consistent atomics).
std::atomic<bool> g_exit_gate_closed{false};
std::atomic<int> g_python_entries{0};

class PythonEntry {
 public:
  PythonEntry() {
    g_python_entries.fetch_add(1);
    open_ = !g_exit_gate_closed.load() && !Finalizing();
    if (!open_) g_python_entries.fetch_sub(1);
  }
  ~PythonEntry() {
    if (open_) g_python_entries.fetch_sub(1);
  }
  PythonEntry(const PythonEntry&) = delete;
  PythonEntry& operator=(const PythonEntry&) = delete;
  bool open() const { return open_; }

 private:
  bool open_;
};

double DefaultTimeout() {
  const char* env = std::getenv("TPUSYNC_DEFAULT_TIMEOUT_S");
  if (env != nullptr) {
    const double v = std::atof(env);
    if (v > 0) return v;
  }
  return 120.0;
}

// The arrays an operation reads or writes; each holds a reference to its Python owner.
struct HeldArrays {
  std::optional<SrcArray> src;
  std::optional<DstArray> dst;
  std::vector<SrcArray> src_regions;
  std::vector<DstArray> dst_regions;
};

// Set while this thread runs a done-callback (PyFuture::AddDoneCallback). Such a thread is an
// engine worker (or the registering thread, when the future was already complete).
thread_local int tls_in_done_callback = 0;

// A Python-facing future: the native future plus the arrays the operation reads or writes.
//
// KEEPALIVE CONTRACT: the arrays are held until the operation completes, so a dropped future can
// never let a worker write into freed memory. Destroying a PyFuture whose operation still runs:
// - outside a done-callback, waits for it (GIL released): a dropped future means "done";
// - inside a done-callback (DROP HAND-OFF), waits for nothing: the arrays are handed to the
//   operation, which releases them under the GIL when it completes. That thread is an engine
//   worker the dropped operation may be queued behind; waiting there hung a one-thread engine
//   for good (found by the 2026-12-07 audit).
class PyFuture {
 public:
  explicit PyFuture(Future f) : f_(std::move(f)) {}
  ~PyFuture() {
    if (f_->done()) return;
    // FORK RULE (bindings.h): in a forked child the workers of a parent's operation do not exist,
    // so it never completes; nothing here can write into the arrays either.
    if (concurrency::ForkGeneration() != fork_generation_) return;
    if (tls_in_done_callback > 0) {
      auto* handed = new HeldArrays(std::move(held));
      f_->OnComplete([handed](const Status&) {
        PythonEntry entry;  // EXIT GATE: closed, leak the references, never decref
        if (!entry.open()) return;
        nb::gil_scoped_acquire gil;
        delete handed;
      });
      return;
    }
    nb::gil_scoped_release release;
    (void)f_->Wait(std::nullopt);
  }
  HeldArrays held;

  bool Done() const { return f_->done(); }
  bool Cancel() { return f_->Cancel(); }

  // Waits up to `timeout` seconds in slices so Ctrl-C (KeyboardInterrupt) is honoured.
  bool Wait(double timeout) {
    using Clock = std::chrono::steady_clock;
    const Clock::time_point deadline = Clock::now() + SecondsToDuration(WaitTimeout(timeout));
    for (;;) {
      const Clock::duration left = deadline - Clock::now();
      const Clock::duration slice =
          std::clamp<Clock::duration>(left, Clock::duration::zero(), std::chrono::milliseconds(50));
      Status s;
      {
        nb::gil_scoped_release release;
        s = f_->Wait(std::chrono::duration_cast<std::chrono::nanoseconds>(slice));
      }
      if (s.code() != StatusCode::kTimeout || f_->done()) return true;
      if (PyErr_CheckSignals() != 0) throw nb::python_error();
      if (std::chrono::steady_clock::now() >= deadline) return false;
    }
  }

  void Result(std::optional<double> timeout) {
    const double t = WaitTimeout(timeout.value_or(DefaultTimeout()));
    if (!Wait(t)) {
      throw StatusError(Status::Timeout(StrCat("operation not complete after ", t, " s")));
    }
    ThrowIfError(f_->Wait(std::chrono::nanoseconds(0)));
  }

  std::string State() const {
    switch (f_->state()) {
      case engine::FutureState::kPending: return "pending";
      case engine::FutureState::kRunning: return "running";
      case engine::FutureState::kDone: break;
    }
    const Status s = f_->Wait(std::chrono::nanoseconds(0));
    return s.ok() ? "done" : (s.code() == StatusCode::kCancelled ? "cancelled" : "failed");
  }

  void AddDoneCallback(nb::object fn) {
    // The callable is owned by the callback and released under the GIL (never on a bare worker).
    PyObject* raw = fn.release().ptr();
    Future f = f_;
    f_->OnComplete([raw, f](const Status&) {
      PythonEntry entry;  // EXIT GATE: closed, drop silently, never touch Python
      if (!entry.open()) return;
      nb::gil_scoped_acquire gil;
      ++tls_in_done_callback;
      try {
        nb::handle callable(raw);
        callable(nb::cast(PyFuture(f)));
      } catch (nb::python_error& e) {
        e.discard_as_unraisable("tpusync Future done-callback");
      } catch (const std::exception& e) {
        PyErr_SetString(PyExc_RuntimeError, e.what());
        PyErr_WriteUnraisable(raw);
      }
      --tls_in_done_callback;
      Py_DECREF(raw);
    });
  }

  const Future& future() const { return f_; }

 private:
  Future f_;
  uint64_t fork_generation_ = concurrency::ForkGeneration();  // FORK RULE
};

template <typename Array>
bool CContiguous(const Array& a, size_t from_dim) {
  int64_t expect = 1;
  for (size_t d = a.ndim(); d-- > from_dim;) {
    if (a.shape(d) != 1 && a.stride(d) != expect) return false;
    expect *= static_cast<int64_t>(a.shape(d));
  }
  return true;
}

// Describes caller memory as rows of block_bytes. Without `rows`: a C-contiguous buffer of exactly
// n * block_bytes bytes, or shape [n, ...] whose rows are contiguous runs of block_bytes at any row
// stride. With `rows`: shape [num_rows, ...] of such rows, of which rows[i] pairs with block i.
template <typename Array>
engine::RowBuffer Rows(const Array& a, size_t n, size_t block_bytes,
                       std::optional<std::vector<uint64_t>> rows) {
  const size_t item = a.itemsize();
  engine::RowBuffer out;
  out.base = static_cast<uint8_t*>(const_cast<void*>(static_cast<const void*>(a.data())));
  if (n == 0 && (!rows || rows->empty())) {
    out.stride = block_bytes;  // an empty batch moves nothing (numpy 2 gives an empty array
    return out;                // strides of 0, so its shape and strides say nothing)
  }
  if (!rows && CContiguous(a, 0) && a.nbytes() == n * block_bytes) {
    out.stride = block_bytes;
    out.num_rows = n;
    return out;
  }
  if (a.ndim() >= 2 && CContiguous(a, 1) && a.stride(0) > 0) {
    size_t row = item;
    for (size_t d = 1; d < a.ndim(); ++d) row *= a.shape(d);
    // [m >= n, ...]: without rows= the first n rows (a request's hit run into a buffer sized
    // for the whole request, as in docs/tiers.md).
    if (row == block_bytes && (rows || a.shape(0) >= n)) {
      out.stride = static_cast<size_t>(a.stride(0)) * item;
      out.num_rows = a.shape(0);
      if (rows) out.rows = std::move(*rows);
      return out;
    }
  }
  throw StatusError(Status::InvalidArgument(StrCat(
      "buffer of ", a.nbytes(), " bytes (", a.ndim(), " dims) does not hold ", n, " blocks of ",
      block_bytes,
      " bytes: pass a C-contiguous array of exactly n*block_bytes bytes, or shape [m >= n, "
      "...] (with rows=: [num_rows, ...]) whose rows are contiguous runs of block_bytes bytes")));
}

using SegmentArray = nb::ndarray<const uint64_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

template <typename Array>
engine::SegmentList Segments(const std::vector<Array>& regions, const SegmentArray& segments) {
  if (segments.shape(1) != 5) {
    throw StatusError(Status::InvalidArgument(
        StrCat("segments must have shape [n, 5] (block, block_offset, region, region_offset, "
               "bytes), got [",
               segments.shape(0), ", ", segments.shape(1), "]")));
  }
  engine::SegmentList out;
  for (const auto& r : regions) {
    if (!CContiguous(r, 0)) {
      throw StatusError(Status::InvalidArgument("segment regions must be C-contiguous arrays"));
    }
    out.regions.push_back(
        {static_cast<uint8_t*>(const_cast<void*>(static_cast<const void*>(r.data()))), r.nbytes()});
  }
  out.segments.resize(segments.shape(0));
  std::memcpy(out.segments.data(), segments.data(), segments.nbytes());
  return out;
}

}  // namespace

bool InDoneCallback() { return tls_in_done_callback > 0; }

nb::object WrapFuture(Future f, std::optional<ReadArray> src, std::optional<WriteArray> dst) {
  auto* out = new PyFuture(std::move(f));
  out->held.src = std::move(src);
  out->held.dst = std::move(dst);
  return nb::cast(out, nb::rv_policy::take_ownership);
}

engine::RowBuffer ReadRows(const ReadArray& a, size_t n, size_t block_bytes,
                           std::optional<std::vector<uint64_t>> rows) {
  return Rows(a, n, block_bytes, std::move(rows));
}

engine::RowBuffer WriteRows(const WriteArray& a, size_t n, size_t block_bytes,
                            std::optional<std::vector<uint64_t>> rows) {
  return Rows(a, n, block_bytes, std::move(rows));
}

void init_engine(nb::module_& m) {
  nb::class_<ThreadPool>(m, "Engine",
                         "Worker threads that run copies while Python keeps computing.")
      .def(nb::new_([](int64_t threads) {
             if (threads < 0) {
               throw StatusError(Status::InvalidArgument(
                   StrCat("Engine threads must be >= 0 (0: one per CPU), got ", threads)));
             }
             return OwnedGilFree(new ThreadPool(static_cast<size_t>(threads)));
           }),
           nb::arg("threads") = 0)
      .def_prop_ro("num_threads", &ThreadPool::num_threads)
      .def_prop_ro("queue_depth", &ThreadPool::queue_depth);

  nb::class_<PyFuture>(m, "Future", "Completion of an asynchronous tpusync operation.")
      .def("done", &PyFuture::Done)
      .def("cancel", &PyFuture::Cancel,
           "Cancel: a pending operation never starts; a running one stops between chunks.")
      .def("wait", &PyFuture::Wait, nb::arg("timeout"),
           "Wait up to `timeout` seconds; True when complete (successfully or not).")
      .def("result", &PyFuture::Result, nb::arg("timeout") = nb::none(),
           "Wait (default TPUSYNC_DEFAULT_TIMEOUT_S or 120 s), then raise the operation's error "
           "if it failed; TimeoutError if it is still running.")
      .def_prop_ro("state", &PyFuture::State,
                   "'pending', 'running', 'done', 'failed' or 'cancelled'.")
      .def("add_done_callback", &PyFuture::AddDoneCallback, nb::arg("fn"),
           "Call fn(future) once complete, on an engine thread holding the GIL.");

  m.def(
      "put_blocks",
      [](ThreadPool& eng, std::shared_ptr<BlockAllocator> blocks, std::vector<BlockId> ids,
         SrcArray src, std::optional<std::vector<uint64_t>> rows) {
        engine::RowBuffer buf = Rows(src, ids.size(), blocks->block_bytes(), std::move(rows));
        Future f;
        {
          nb::gil_scoped_release release;
          f = engine::PutBlocks(eng, blocks, std::move(ids), std::move(buf));
        }
        auto* out = new PyFuture(std::move(f));
        out->held.src = std::move(src);
        return out;
      },
      nb::arg("engine"), nb::arg("pool"), nb::arg("ids"), nb::arg("src"),
      nb::arg("rows") = nb::none(), nb::rv_policy::take_ownership,
      "Copy block i of `src` (row rows[i] when given) into pool block ids[i] on the engine's "
      "threads.");

  m.def(
      "get_blocks",
      [](ThreadPool& eng, std::shared_ptr<BlockAllocator> blocks, std::vector<BlockId> ids,
         DstArray dst, std::optional<std::vector<uint64_t>> rows) {
        engine::RowBuffer buf = Rows(dst, ids.size(), blocks->block_bytes(), std::move(rows));
        Future f;
        {
          nb::gil_scoped_release release;
          f = engine::GetBlocks(eng, blocks, std::move(ids), std::move(buf));
        }
        auto* out = new PyFuture(std::move(f));
        out->held.dst = std::move(dst);
        return out;
      },
      nb::arg("engine"), nb::arg("pool"), nb::arg("ids"), nb::arg("dst"),
      nb::arg("rows") = nb::none(), nb::rv_policy::take_ownership,
      "Copy pool block ids[i] into block i of `dst` (row rows[i] when given) on the engine's "
      "threads.");

  m.def(
      "put_segments",
      [](ThreadPool& eng, std::shared_ptr<BlockAllocator> blocks, std::vector<BlockId> ids,
         std::vector<SrcArray> regions, SegmentArray segments) {
        engine::SegmentList list = Segments(regions, segments);
        Future f;
        {
          nb::gil_scoped_release release;
          f = engine::PutSegments(eng, blocks, std::move(ids), std::move(list));
        }
        auto* out = new PyFuture(std::move(f));
        out->held.src_regions = std::move(regions);
        return out;
      },
      nb::arg("engine"), nb::arg("pool"), nb::arg("ids"), nb::arg("regions"), nb::arg("segments"),
      nb::rv_policy::take_ownership,
      "Gather: for each row (block, block_offset, region, region_offset, bytes) of the uint64 "
      "[n, 5] `segments`, copy bytes of regions[region] into pool block ids[block]. Every bound "
      "is checked before any byte moves.");

  m.def(
      "get_segments",
      [](ThreadPool& eng, std::shared_ptr<BlockAllocator> blocks, std::vector<BlockId> ids,
         std::vector<DstArray> regions, SegmentArray segments) {
        engine::SegmentList list = Segments(regions, segments);
        Future f;
        {
          nb::gil_scoped_release release;
          f = engine::GetSegments(eng, blocks, std::move(ids), std::move(list));
        }
        auto* out = new PyFuture(std::move(f));
        out->held.dst_regions = std::move(regions);
        return out;
      },
      nb::arg("engine"), nb::arg("pool"), nb::arg("ids"), nb::arg("regions"), nb::arg("segments"),
      nb::rv_policy::take_ownership,
      "Scatter: the inverse of put_segments (pool block bytes into the regions).");

  m.def(
      "copy",
      [](ThreadPool& eng, DstArray dst, SrcArray src) {
        if (dst.nbytes() != src.nbytes()) {
          throw StatusError(Status::InvalidArgument(
              StrCat("copy between arrays of ", src.nbytes(), " and ", dst.nbytes(), " bytes")));
        }
        if (!CContiguous(src, 0) || !CContiguous(dst, 0)) {
          throw StatusError(Status::InvalidArgument("copy needs C-contiguous arrays"));
        }
        std::vector<engine::CopySpan> spans = {{static_cast<uint8_t*>(dst.data()),
                                                static_cast<const uint8_t*>(src.data()),
                                                src.nbytes()}};
        Future f;
        {
          nb::gil_scoped_release release;
          f = engine::CopyAsync(eng, std::move(spans));
        }
        auto* out = new PyFuture(std::move(f));
        out->held.src = std::move(src);
        out->held.dst = std::move(dst);
        return out;
      },
      nb::arg("engine"), nb::arg("dst"), nb::arg("src"), nb::rv_policy::take_ownership,
      "Copy all bytes of src into dst, split across the engine's threads.");

  m.def(
      "memcpy_seconds",
      [](DstArray dst, SrcArray src) {
        if (dst.nbytes() != src.nbytes()) {
          throw StatusError(Status::InvalidArgument("memcpy_seconds needs equal-sized arrays"));
        }
        if (!CContiguous(src, 0) || !CContiguous(dst, 0)) {
          throw StatusError(Status::InvalidArgument("memcpy_seconds needs C-contiguous arrays"));
        }
        nb::gil_scoped_release release;
        return engine::TimedMemcpySeconds(dst.data(), src.data(), src.nbytes());
      },
      nb::arg("dst"), nb::arg("src"),
      "Seconds for one plain memcpy on the calling thread (benchmark reference).");

  m.def(
      "close_exit_gate",
      [](double timeout) {
        g_exit_gate_closed.store(true);
        const auto deadline = std::chrono::steady_clock::now() + SecondsToDuration(timeout);
        nb::gil_scoped_release release;
        while (g_python_entries.load() > 0 && std::chrono::steady_clock::now() < deadline) {
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
        return g_python_entries.load() == 0;
      },
      nb::arg("timeout"),
      "EXIT GATE (interpreter exit; tpusync.core's atexit hook): from now on engine workers run "
      "no Python (done-callbacks are dropped); waits up to `timeout` s for those inside Python "
      "to leave. True when none is left.");
}

}  // namespace tpusync::bindings
