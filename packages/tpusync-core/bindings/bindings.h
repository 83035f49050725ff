// Shared helpers of the nanobind bindings. Bindings stay thin: argument conversion, GIL handling
// and Status -> exception; every decision lives in native/.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <unistd.h>

#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "tpusync/base/status.h"
#include "tpusync/engine/block_transfer.h"
#include "tpusync/engine/future.h"

#include "tpusync/store/kv_store.h"

namespace tpusync::bindings {

namespace nb = nanobind;

// Carries a non-OK Status to the exception translator (tpusync.core.errors).
struct StatusError : std::exception {
  explicit StatusError(Status s) : status(std::move(s)), what_(status.ToString()) {}
  const char* what() const noexcept override { return what_.c_str(); }
  Status status;
  std::string what_;
};

inline void ThrowIfError(const Status& s) {
  if (!s.ok()) throw StatusError(s);
}

template <typename T>
T Unwrap(Result<T> r) {
  if (!r.ok()) throw StatusError(r.status());
  return std::move(r).value();
}

// WAIT TIMEOUT RULE: a wait's timeout in seconds; NaN is refused by name (it acted as 0: a
// result(nan) raised "not complete after nan s" for work that was fine). Negative values wait
// not at all and inf for ever, as Python's own waits (SECONDS CONTRACT, base/seconds.h).
inline double WaitTimeout(double seconds) {
  if (seconds != seconds) {
    throw StatusError(
        Status::InvalidArgument("a wait timeout must be a number of seconds, got nan"));
  }
  return seconds;
}

// Keys (block hashes) as owned byte strings, converted while the GIL is held.
inline std::vector<std::string> Keys(const std::vector<nb::bytes>& keys) {
  std::vector<std::string> out;
  out.reserve(keys.size());
  for (const auto& k : keys) out.emplace_back(k.c_str(), k.size());
  return out;
}

// engine_bindings.cc: true while this thread runs a Future's done-callback (an engine worker, or
// the registering thread when the future was already complete).
bool InDoneCallback();

// GIL-FREE DESTRUCTION: a native object whose destructor waits for engine work or other threads
// (an Engine joins its workers, a KVStore waits for its operations, a P/D consumer, producer,
// store node or client joins its connection threads, which may sit in a connect until its
// timeout) goes to Python as a shared_ptr whose deleter
// never waits where that work could be stuck behind the waiter:
// - holding the GIL, it releases it around the delete (a worker may need the GIL to finish: a
//   done-callback, the DROP HAND-OFF in engine_bindings.cc);
// - inside a done-callback, it deletes on a thread of its own and returns at once: the waiting
//   thread would be an engine worker the awaited work may be queued behind (a store closed in a
//   callback of its own put on a one-thread engine hung for good), or the very worker an Engine's
//   destructor joins.
//
// FORK RULE: in a child forked after the object was made, it is never deleted (leaked): the child
// has none of its threads, and joining them or destroying the condition variables they waited on
// hung the child at exit for good (os.fork after any store use; found by the 2026-12-07 audit).
template <typename T>
std::shared_ptr<T> OwnedGilFree(T* p) {
  const pid_t creator = getpid();
  return std::shared_ptr<T>(p, [creator](T* q) {
    if (getpid() != creator) return;  // FORK RULE
    if (InDoneCallback()) {
      try {
        std::thread([q] { delete q; }).detach();
        return;
      } catch (const std::system_error&) {  // no thread to be had: delete here, as before
      }
    }
    if (PyGILState_Check() == 0) {
      delete q;
      return;
    }
    nb::gil_scoped_release release;
    delete q;
  });
}

// CPU arrays a native operation reads from / writes into (numpy, torch, jax via DLPack).
using ReadArray = nb::ndarray<nb::ro, nb::device::cpu>;
using WriteArray = nb::ndarray<nb::device::cpu>;

// engine_bindings.cc: a tpusync.core.Future over `f` that holds the arrays until it completes.
nb::object WrapFuture(engine::Future f, std::optional<ReadArray> src,
                      std::optional<WriteArray> dst);
// engine_bindings.cc: rows of block_bytes in an array, with the same rules as put_blocks.
engine::RowBuffer ReadRows(const ReadArray& a, size_t n, size_t block_bytes,
                           std::optional<std::vector<uint64_t>> rows);
engine::RowBuffer WriteRows(const WriteArray& a, size_t n, size_t block_bytes,
                            std::optional<std::vector<uint64_t>> rows);

// The host / disk tier options shared by KVStoreNative.open and open_remote_kv_store (the Python
// keyword arguments of both, in one place).
store::KVStoreOptions StoreOptions(
    size_t block_bytes, size_t host_blocks, const std::string& name_space,
    const std::string& fingerprint, const std::string& disk_dir, size_t disk_blocks,
    size_t disk_segment_blocks, bool disk_direct_io, const std::string& io_backend,
    size_t io_threads, const std::string& policy, size_t writeback_batch, size_t writeback_headroom,
    double put_wait_s, bool prefault, bool huge_pages, bool write_through,
    block::Recency index_recency, double disk_checkpoint_s, size_t disk_checkpoint_writes,
    bool disk_manifest_progressive_write_back);

void init_base(nb::module_& m);
void init_memory(nb::module_& m);
void init_block(nb::module_& m);
void init_engine(nb::module_& m);
void init_store(nb::module_& m);
void init_transport(nb::module_& m);

}  // namespace tpusync::bindings
