// KVStore: the tiered KV block store (native/include/tpusync/store/kv_store.h). Thin: argument
// conversion, GIL release, Status -> exception; every decision lives in native/.
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "bindings.h"
#include "tpusync/base/seconds.h"
#include "tpusync/store/kv_store.h"

namespace tpusync::bindings {
namespace {

using store::KVStore;
using store::KVStoreOptions;

std::vector<std::string_view> Views(const std::vector<nb::bytes>& keys) {
  std::vector<std::string_view> out;
  out.reserve(keys.size());
  for (const auto& k : keys) out.emplace_back(k.c_str(), k.size());
  return out;
}

// A read-only numpy uint8 array over the per-key result vector (owned by the capsule).
nb::object Mask(std::shared_ptr<std::vector<uint8_t>> v, size_t n) {
  v->resize(n);
  auto* holder = new std::shared_ptr<std::vector<uint8_t>>(v);
  nb::capsule owner(holder, [](void* p) noexcept {
    delete static_cast<std::shared_ptr<std::vector<uint8_t>>*>(p);
  });
  size_t shape[1] = {n};
  return nb::cast(nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>(v->data(), 1, shape, owner));
}

nb::dict Latency(const store::LatencyStats& l) {
  nb::dict d;
  d["count"] = l.count;
  d["total_s"] = l.total_ns / 1e9;
  d["max_s"] = l.max_ns / 1e9;
  return d;
}

nb::dict Stats(const store::StoreStats& s) {
  nb::dict d;
  d["keys"] = s.keys;
  d["policy"] = s.policy;
  d["puts"] = s.puts;
  d["put_stored"] = s.put_stored;
  d["put_present"] = s.put_present;
  d["put_rejected"] = s.put_rejected;
  d["gets"] = s.gets;
  d["misses"] = s.misses;
  d["evicted"] = s.evicted;
  d["corrupted"] = s.corrupted;
  d["writeback_errors"] = s.writeback_errors;
  d["writeback_inflight"] = s.writeback_inflight;
  d["write_through"] = s.write_through;
  d["write_through_dropped"] = s.write_through_dropped;
  d["write_through_errors"] = s.write_through_errors;
  d["engine_queue"] = s.engine_queue;
  d["put_latency"] = Latency(s.put_latency);
  d["get_latency"] = Latency(s.get_latency);
  nb::dict tiers;
  for (const auto& t : s.tiers) {
    nb::dict e;
    e["hits"] = t.hits;
    e["evictions"] = t.evictions;
    e["promotions_in"] = t.promotions_in;
    e["demotions_in"] = t.demotions_in;
    e["indexed"] = t.indexed;
    e["capacity_blocks"] = t.tier.capacity_blocks;
    e["used_blocks"] = t.tier.used_blocks;
    e["blocks_written"] = t.tier.blocks_written;
    e["blocks_read"] = t.tier.blocks_read;
    e["bytes_written"] = t.tier.bytes_written;
    e["bytes_read"] = t.tier.bytes_read;
    e["write_errors"] = t.tier.write_errors;
    e["no_space_errors"] = t.tier.no_space_errors;
    e["read_errors"] = t.tier.read_errors;
    e["corrupted"] = t.tier.corrupted;
    e["recovered"] = t.tier.recovered;
    e["write_s"] = t.tier.write_ns / 1e9;
    e["read_s"] = t.tier.read_ns / 1e9;
    e["direct_io"] = t.tier.direct_io;
    e["io_backend"] = t.tier.io_backend;
    e["huge_pages"] = t.tier.huge_pages;
    e["cold_start_reason"] = t.tier.cold_start_reason;
    e["recovery"] = t.tier.recovery;
    e["recovery_slots_read"] = t.tier.recovery_slots_read;
    e["checkpoints"] = t.tier.checkpoints;
    e["manifest_errors"] = t.tier.manifest_errors;
    e["journaled"] = t.tier.journaled;
    e["manifest_write_back"] = t.tier.manifest_write_back;
    tiers[nb::str(std::string(block::TierName(t.kind)).c_str())] = e;
  }
  d["tiers"] = tiers;
  return d;
}

}  // namespace

KVStoreOptions StoreOptions(size_t block_bytes, size_t host_blocks, const std::string& name_space,
                            const std::string& fingerprint, const std::string& disk_dir,
                            size_t disk_blocks, size_t disk_segment_blocks, bool disk_direct_io,
                            const std::string& io_backend, size_t io_threads,
                            const std::string& policy, size_t writeback_batch,
                            size_t writeback_headroom, double put_wait_s, bool prefault,
                            bool huge_pages, bool write_through, block::Recency index_recency,
                            double disk_checkpoint_s, size_t disk_checkpoint_writes,
                            bool disk_manifest_progressive_write_back) {
  KVStoreOptions o;
  o.block_bytes = block_bytes;
  o.host_blocks = host_blocks;
  o.name_space = name_space;
  o.fingerprint = fingerprint;
  o.disk_dir = disk_dir;
  o.disk_blocks = disk_blocks;
  o.disk_segment_blocks = disk_segment_blocks;
  o.disk_direct_io = disk_direct_io;
  o.io_backend = io_backend;
  o.io_threads = io_threads;
  o.policy = policy;
  o.writeback_batch = writeback_batch;
  o.writeback_headroom = writeback_headroom;
  o.put_wait_s = put_wait_s;
  o.prefault = prefault;
  o.huge_pages = huge_pages;
  o.write_through = write_through;
  o.index_recency = index_recency;
  o.disk_checkpoint_s = disk_checkpoint_s;
  o.disk_checkpoint_writes = disk_checkpoint_writes;
  o.disk_manifest_progressive_write_back = disk_manifest_progressive_write_back;
  return o;
}

void init_store(nb::module_& m) {
  nb::class_<KVStore>(m, "KVStoreNative",
                      "Tiered KV block store (use tpusync.core.KVStore, the Python face).")
      .def_static(
          "open",
          [](std::shared_ptr<engine::ThreadPool> engine, size_t block_bytes, size_t host_blocks,
             const std::string& name_space, const std::string& fingerprint,
             const std::string& disk_dir, size_t disk_blocks, size_t disk_segment_blocks,
             bool disk_direct_io, const std::string& io_backend, size_t io_threads,
             const std::string& policy, size_t writeback_batch, size_t writeback_headroom,
             double put_wait_s, bool prefault, bool huge_pages, bool write_through,
             block::Recency index_recency, double disk_checkpoint_s, size_t disk_checkpoint_writes,
             bool disk_manifest_progressive_write_back) {
            KVStoreOptions o =
                StoreOptions(block_bytes, host_blocks, name_space, fingerprint, disk_dir,
                             disk_blocks, disk_segment_blocks, disk_direct_io, io_backend,
                             io_threads, policy, writeback_batch, writeback_headroom, put_wait_s,
                             prefault, huge_pages, write_through, index_recency, disk_checkpoint_s,
                             disk_checkpoint_writes, disk_manifest_progressive_write_back);
            nb::gil_scoped_release release;
            return OwnedGilFree(Unwrap(KVStore::Open(o, std::move(engine))).release());
          },
          nb::arg("engine"), nb::arg("block_bytes"), nb::arg("host_blocks"),
          nb::arg("name_space") = "", nb::arg("fingerprint") = "", nb::arg("disk_dir") = "",
          nb::arg("disk_blocks") = 0, nb::arg("disk_segment_blocks") = 0,
          nb::arg("disk_direct_io") = true, nb::arg("io_backend") = "auto",
          nb::arg("io_threads") = 4, nb::arg("policy") = "lru", nb::arg("writeback_batch") = 32,
          nb::arg("writeback_headroom") = 0, nb::arg("put_wait_s") = 5.0,
          nb::arg("prefault") = true, nb::arg("huge_pages") = false,
          nb::arg("write_through") = false,
          nb::arg("index_recency") = block::BlockIndex::kDefaultRecency,
          nb::arg("disk_checkpoint_s") = 60.0, nb::arg("disk_checkpoint_writes") = 1 << 16,
          nb::arg("disk_manifest_progressive_write_back") = true)
      .def_prop_ro("block_bytes", &KVStore::block_bytes)
      .def_prop_ro("index_recency", &KVStore::index_recency,
                   "Recency mode of the store's index (CLOCK or EXACT_LRU).")
      .def(
          "put",
          [](KVStore& s, const std::vector<nb::bytes>& keys, ReadArray src,
             std::optional<std::vector<uint64_t>> rows) {
            engine::RowBuffer buf = ReadRows(src, keys.size(), s.block_bytes(), std::move(rows));
            auto stored = std::make_shared<std::vector<uint8_t>>(keys.size());
            auto k = Keys(keys);
            engine::Future f;
            {
              nb::gil_scoped_release release;  // may wait (bounded) for write-back room
              f = s.Put(std::move(k), std::move(buf), stored);
            }
            return std::make_pair(WrapFuture(std::move(f), std::move(src), std::nullopt),
                                  Mask(stored, keys.size()));
          },
          nb::arg("keys"), nb::arg("src"), nb::arg("rows") = nb::none(),
          "(future, stored mask): mask[i] is 1 once keys[i] is stored (read it after the future).")
      .def(
          "get",
          [](KVStore& s, const std::vector<nb::bytes>& keys, WriteArray dst,
             std::optional<std::vector<uint64_t>> rows) {
            engine::RowBuffer buf = WriteRows(dst, keys.size(), s.block_bytes(), std::move(rows));
            auto found = std::make_shared<std::vector<uint8_t>>(keys.size());
            auto k = Keys(keys);
            engine::Future f;
            {
              nb::gil_scoped_release release;
              f = s.Get(std::move(k), std::move(buf), found);
            }
            return std::make_pair(WrapFuture(std::move(f), std::nullopt, std::move(dst)),
                                  Mask(found, keys.size()));
          },
          nb::arg("keys"), nb::arg("dst"), nb::arg("rows") = nb::none(),
          "(future, found mask): mask[i] is 1 when keys[i] was read and verified.")
      .def(
          "lookup",
          [](KVStore& s, const std::vector<nb::bytes>& keys) {
            auto views = Views(keys);
            std::vector<block::Placement> where;
            size_t n;
            {
              nb::gil_scoped_release release;
              n = s.Lookup(views, &where);
            }
            std::vector<block::Tier> best;
            best.reserve(where.size());
            for (const auto& p : where) best.push_back(*p.best());
            return std::make_pair(n, std::move(best));
          },
          nb::arg("keys"), "(length of the leading run of stored keys, fastest tier of each)")
      .def(
          "pin",
          [](KVStore& s, const std::vector<nb::bytes>& keys) { ThrowIfError(s.Pin(Views(keys))); },
          nb::arg("keys"))
      .def(
          "unpin",
          [](KVStore& s, const std::vector<nb::bytes>& keys) {
            ThrowIfError(s.Unpin(Views(keys)));
          },
          nb::arg("keys"))
      .def(
          "remove",
          [](KVStore& s, const std::vector<nb::bytes>& keys) {
            auto views = Views(keys);
            nb::gil_scoped_release release;
            return Unwrap(s.Remove(views));
          },
          nb::arg("keys"))
      .def("clear", &KVStore::Clear, nb::call_guard<nb::gil_scoped_release>())
      .def(
          "flush",
          [](KVStore& s, double timeout) {
            const auto wait = SecondsToDuration(WaitTimeout(timeout));
            nb::gil_scoped_release release;
            ThrowIfError(s.Flush(wait));
          },
          nb::arg("timeout"))
      .def(
          "checkpoint",
          [](KVStore& s) {
            nb::gil_scoped_release release;
            ThrowIfError(s.CheckpointNow());
          },
          "Write a checkpoint of every tier now (disk: manifest + new journal generation).")
      .def("stats", [](const KVStore& s) { return Stats(s.stats()); })
      .def("enable_events", &KVStore::EnableEvents, nb::arg("capacity"),
           "Record placement changes (capacity > 0: queue bound; 0: off).")
      .def(
          "take_events",
          [](KVStore& s, size_t max) {
            std::vector<store::StoreEvent> evs;
            uint64_t dropped = 0;
            {
              nb::gil_scoped_release release;
              evs = s.TakeEvents(max, &dropped);
            }
            static constexpr const char* kKinds[] = {"stored", "removed", "cleared"};
            nb::list out;
            for (const auto& e : evs) {
              out.append(nb::make_tuple(kKinds[static_cast<size_t>(e.kind)], e.tier,
                                        nb::bytes(e.key.data(), e.key.size())));
            }
            return nb::make_tuple(out, dropped);
          },
          nb::arg("max") = 65536,
          "([(kind, tier, key)], events dropped since the last call); kind is 'stored', "
          "'removed' or 'cleared'.");
}

}  // namespace tpusync::bindings
