// BlockIndex: key -> per-tier placement, pins, LRU.
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <string_view>
#include <vector>

#include "bindings.h"
#include "tpusync/block/block_index.h"

namespace tpusync::bindings {
namespace {

using block::BlockIndex;
using block::Placement;
using block::Tier;

std::string_view View(const nb::bytes& b) { return {b.c_str(), b.size()}; }

}  // namespace

void init_block(nb::module_& m) {
  nb::enum_<Tier>(m, "Tier")
      .value("DEVICE", Tier::kDevice)
      .value("HOST", Tier::kHost)
      .value("DISK", Tier::kDisk)
      .value("REMOTE", Tier::kRemote);
  nb::enum_<block::Recency>(m, "Recency",
                            "Recency mode of a BlockIndex: EXACT_LRU relinks on every touch; CLOCK "
                            "sets a reference bit and relinks at eviction (second chance).")
      .value("EXACT_LRU", block::Recency::kExactLru)
      .value("CLOCK", block::Recency::kClock);

  nb::class_<Placement>(m, "Placement", "Where one key lives: tiers, their locations, pin count.")
      .def_ro("pins", &Placement::pins)
      .def_ro("tier_mask", &Placement::tier_mask)
      .def("has", &Placement::in, nb::arg("tier"))
      .def_prop_ro("best", &Placement::best, "The fastest tier holding the key.")
      .def(
          "location",
          [](const Placement& p, Tier t) -> std::optional<uint64_t> {
            if (!p.in(t)) return std::nullopt;
            return p.location[static_cast<size_t>(t)];
          },
          nb::arg("tier"));

  nb::class_<BlockIndex>(m, "BlockIndex",
                         "Content-addressed index: engine block hash -> placement per tier.")
      .def(nb::init<block::Recency>(), nb::arg("recency") = BlockIndex::kDefaultRecency)
      .def_prop_ro("recency", &BlockIndex::recency)
      .def(
          "insert",
          [](BlockIndex& idx, nb::bytes key, Tier tier, uint64_t location) {
            ThrowIfError(idx.Insert(View(key), tier, location));
          },
          nb::arg("key"), nb::arg("tier"), nb::arg("location"))
      .def(
          "insert_many",
          [](BlockIndex& idx,
             nb::ndarray<const uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> keys, Tier tier,
             uint64_t first_location) {
            const size_t n = keys.shape(0), width = keys.shape(1);
            const char* base = reinterpret_cast<const char*>(keys.data());
            nb::gil_scoped_release release;
            for (size_t i = 0; i < n; ++i) {
              ThrowIfError(idx.Insert({base + i * width, width}, tier, first_location + i));
            }
          },
          // noconvert: an array of another dtype would be cast element by element to uint8
          // (other keys than the caller's, silently); it is refused instead.
          nb::arg("keys").noconvert(), nb::arg("tier"), nb::arg("first_location"),
          "Insert row i of a [n, key_bytes] C-contiguous uint8 array at location first_location "
          "+ i (bulk registration; stops at the first error).")
      .def(
          "lookup",
          [](BlockIndex& idx, nb::bytes key, bool touch) { return idx.Lookup(View(key), touch); },
          nb::arg("key"), nb::arg("touch") = true)
      .def(
          "lookup_prefix",
          [](BlockIndex& idx, const std::vector<nb::bytes>& keys) {
            std::vector<std::string_view> views;
            views.reserve(keys.size());
            for (const auto& k : keys) views.push_back(View(k));
            std::vector<Placement> out;
            size_t n;
            {
              nb::gil_scoped_release release;  // the bytes objects stay referenced by `keys`
              n = idx.LookupPrefix(views, &out);
            }
            return std::make_pair(n, std::move(out));
          },
          nb::arg("keys"), "Length of the leading run of indexed keys, and their placements.")
      .def(
          "lookup_prefix_array",
          [](BlockIndex& idx,
             nb::ndarray<const uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> keys) {
            const size_t n = keys.shape(0), width = keys.shape(1);
            const char* base = reinterpret_cast<const char*>(keys.data());
            nb::gil_scoped_release release;  // the array stays referenced by the caller
            std::vector<std::string_view> views;
            views.reserve(n);
            for (size_t i = 0; i < n; ++i) views.emplace_back(base + i * width, width);
            return idx.LookupPrefix(views, nullptr);
          },
          nb::arg("keys").noconvert(),  // as insert_many: no silent cast to uint8
          "Length of the leading run of indexed keys among the rows of a [n, key_bytes] "
          "C-contiguous uint8 array (touching them); no per-key Python objects, placements not "
          "returned.")
      .def(
          "reserve",
          [](BlockIndex& idx, size_t keys) {
            nb::gil_scoped_release release;
            ThrowIfError(idx.Reserve(keys));
          },
          nb::arg("keys"), "Size the hash table for this many keys (no rehash up to it).")
      .def(
          "remove",
          [](BlockIndex& idx, nb::bytes key, Tier tier) {
            return Unwrap(idx.Remove(View(key), tier));
          },
          nb::arg("key"), nb::arg("tier"))
      .def(
          "erase", [](BlockIndex& idx, nb::bytes key) { return Unwrap(idx.Erase(View(key))); },
          nb::arg("key"))
      .def(
          "pin", [](BlockIndex& idx, nb::bytes key) { ThrowIfError(idx.Pin(View(key))); },
          nb::arg("key"))
      .def(
          "unpin", [](BlockIndex& idx, nb::bytes key) { ThrowIfError(idx.Unpin(View(key))); },
          nb::arg("key"))
      .def(
          "eviction_candidates",
          [](BlockIndex& idx, Tier tier, size_t n) {
            std::vector<std::pair<nb::bytes, uint64_t>> out;
            for (auto& v : idx.EvictionCandidates(tier, n)) {
              out.emplace_back(nb::bytes(v.key.data(), v.key.size()), v.location);
            }
            return out;
          },
          nb::arg("tier"), nb::arg("n"),
          "Up to n least-recently-used unpinned (key, location) pairs of a tier.")
      .def("count", &BlockIndex::Count, nb::arg("tier"))
      .def("__len__", &BlockIndex::size)
      .def("clear", &BlockIndex::Clear);
}

}  // namespace tpusync::bindings
