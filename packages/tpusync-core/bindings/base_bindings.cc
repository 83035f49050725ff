// Versions, checksums and the Status -> Python exception translator.
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "bindings.h"
#include "tpusync/base/bf16.h"
#include "tpusync/base/checksum.h"
#include "tpusync/base/f16.h"
#include "tpusync/base/status.h"
#include "tpusync/base/version.h"

namespace tpusync::bindings {

namespace {

// A copy source or destination: C-contiguous host memory of any dtype (dims of extent 1 may
// carry any stride; empty arrays are fine). Checked here, never converted: nanobind would otherwise
// copy a strided destination into a temporary and the bytes would land there.
template <typename Array>
bool Dense(const Array& a) {
  if (a.nbytes() == 0) return true;  // empty: its strides mean nothing
  int64_t expect = 1;
  for (size_t d = a.ndim(); d-- > 0;) {
    if (a.shape(d) != 1 && a.stride(d) != expect) return false;
    expect *= static_cast<int64_t>(a.shape(d));
  }
  return true;
}

template <typename Array>
size_t DenseBytes(const Array& a, const char* what) {
  if (!Dense(a)) {
    throw StatusError(Status::InvalidArgument(
        StrCat(what,
               " must be a C-contiguous host array (copy strided data with the "
               "framework's copy, then hash it with checksum64)")));
  }
  return a.nbytes();
}

size_t SameBytes(const nb::ndarray<nb::device::cpu>& dst,
                 const nb::ndarray<nb::ro, nb::device::cpu>& src) {
  const size_t n = DenseBytes(src, "src");
  if (DenseBytes(dst, "dst") != n) {
    throw StatusError(Status::InvalidArgument(
        StrCat("copy from ", n, " source bytes into a ", dst.nbytes(), "-byte destination")));
  }
  return n;
}

// The contiguous runs of a strided array in C order: byte offsets from data() and the run length
// (its longest C-contiguous suffix of dims). The innermost dim must be contiguous.
template <typename Array>
size_t RowRuns(const Array& a, const char* what, std::vector<int64_t>* starts) {
  const size_t nd = a.ndim();
  const auto item = static_cast<int64_t>(a.itemsize());
  size_t k = nd;
  int64_t run = 1;
  while (k > 0 && (a.shape(k - 1) == 1 || a.stride(k - 1) == run)) {
    run *= static_cast<int64_t>(a.shape(k - 1));
    --k;
  }
  if (k == nd) {
    throw StatusError(Status::InvalidArgument(
        StrCat(what,
               ": its innermost dimension is strided (copy it with the framework's copy, "
               "then hash it with update)")));
  }
  size_t count = 1;
  for (size_t d = 0; d < k; ++d) count *= a.shape(d);
  std::vector<int64_t> idx(k, 0);
  starts->reserve(count);
  for (size_t i = 0; i < count; ++i) {
    int64_t off = 0;
    for (size_t d = 0; d < k; ++d) off += idx[d] * a.stride(d);
    starts->push_back(off * item);
    for (size_t d = k; d-- > 0;) {
      if (++idx[d] < static_cast<int64_t>(a.shape(d))) break;
      idx[d] = 0;
    }
  }
  return static_cast<size_t>(run * item);
}

// The runs of copy_update / cast_update: one for two dense arrays; a gather (strided src) or a
// scatter (strided dst) by rows otherwise, the packed side advancing contiguously. Each run's
// `bytes` counts source bytes; the destination takes 1 / `shrink` of them (1: a copy, 2: float32
// -> bfloat16 / float16, Checksum64Stream::CastUpdateRuns). The callers check sizes and dtypes.
std::vector<StreamRun> Runs(const nb::ndarray<nb::device::cpu>& dst,
                            const nb::ndarray<nb::ro, nb::device::cpu>& src, const char* op,
                            size_t shrink) {
  auto* d = static_cast<uint8_t*>(dst.data());
  const auto* s = static_cast<const uint8_t*>(src.data());
  const bool dd = Dense(dst), sd = Dense(src);
  if (dd && sd) return {{d, s, src.nbytes()}};
  if (!dd && !sd) {
    throw StatusError(Status::InvalidArgument(
        StrCat(op, ": dst or src must be C-contiguous (both are strided)")));
  }
  std::vector<int64_t> starts;
  std::vector<StreamRun> runs;
  if (dd) {  // gather: strided source rows into the packed destination
    const size_t run = RowRuns(src, "src", &starts);
    runs.reserve(starts.size());
    for (size_t i = 0; i < starts.size(); ++i) {
      runs.push_back({d + i * run / shrink, s + starts[i], run});
    }
  } else {  // scatter: the packed source into strided destination rows
    const size_t run = RowRuns(dst, "dst", &starts);
    runs.reserve(starts.size());
    for (size_t i = 0; i < starts.size(); ++i) {
      runs.push_back({d + starts[i], s + i * run * shrink, run * shrink});
    }
  }
  return runs;
}

std::vector<StreamRun> CopyRuns(const nb::ndarray<nb::device::cpu>& dst,
                                const nb::ndarray<nb::ro, nb::device::cpu>& src) {
  if (dst.nbytes() != src.nbytes()) {
    throw StatusError(Status::InvalidArgument(StrCat(
        "copy from ", src.nbytes(), " source bytes into a ", dst.nbytes(), "-byte destination")));
  }
  return Runs(dst, src, "copy_update", 1);
}

// float32 source -> bfloat16 (or uint16 holding bfloat16 bits) or float16 destination, as many
// values on both sides. Sets `narrow` to the matching cast.
std::vector<StreamRun> CastRuns(const nb::ndarray<nb::device::cpu>& dst,
                                const nb::ndarray<nb::ro, nb::device::cpu>& src,
                                Checksum64Stream::NarrowFn* narrow) {
  if (src.dtype() != nb::dtype<float>()) {
    throw StatusError(Status::InvalidArgument(
        StrCat("cast_update: src must be float32, not a ", src.itemsize() * 8, "-bit dtype")));
  }
  const nb::dlpack::dtype dt = dst.dtype();
  const bool bf16 = (dt.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat) &&
                     dt.bits == 16 && dt.lanes == 1) ||
                    dt == nb::dtype<uint16_t>();
  const bool f16 = dt.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Float) &&
                   dt.bits == 16 && dt.lanes == 1;
  if (!bf16 && !f16) {
    throw StatusError(Status::InvalidArgument(
        "cast_update: dst must be bfloat16, float16, or uint16 holding bfloat16 bits"));
  }
  *narrow = f16 ? &F32ToF16 : &F32ToBf16;
  if (dst.size() != src.size()) {
    throw StatusError(Status::InvalidArgument(StrCat(
        "cast_update: ", src.size(), " source values into ", dst.size(), " destination values")));
  }
  if (reinterpret_cast<uintptr_t>(dst.data()) % 2 != 0) {
    throw StatusError(Status::InvalidArgument("cast_update: dst is not 2-byte aligned"));
  }
  return Runs(dst, src, "cast_update", 2);
}

// The Python face of Checksum64Stream, held through a pointer so its 64-byte aligned state never
// depends on the Python allocator's alignment.
struct PyChecksumStream {
  explicit PyChecksumStream(uint64_t seed) : h(std::make_unique<Checksum64Stream>(seed)) {}
  std::unique_ptr<Checksum64Stream> h;
};

}  // namespace

void init_base(nb::module_& m) {
  m.attr("__version__") = kVersionString;
  m.attr("API_VERSION") = kApiVersion;

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const StatusError& e) {
      // Class per StatusCode, defined in Python so it can inherit from the matching builtin.
      nb::object cls = nb::module_::import_("tpusync.core.errors")
                           .attr("error_class")(std::string(StatusCodeName(e.status.code())));
      PyErr_SetString(cls.ptr(), e.status.message().c_str());
    }
  });

  m.def(
      "checksum64",
      [](nb::bytes data, uint64_t seed) { return Checksum64(data.c_str(), data.size(), seed); },
      nb::arg("data"), nb::arg("seed") = 0,
      "XXH3-64 checksum of bytes (the checksum every stored block carries).");
  m.def(
      "checksum64",
      [](nb::ndarray<nb::ro, nb::c_contig, nb::device::cpu> data, uint64_t seed) {
        const void* ptr = data.data();
        const size_t n = data.nbytes();
        nb::gil_scoped_release release;
        return Checksum64(ptr, n, seed);
      },
      nb::arg("data"), nb::arg("seed") = 0,
      "XXH3-64 checksum of a C-contiguous host array's bytes, without a copy.");
  m.def(
      "copy_checksum64",
      [](nb::ndarray<nb::device::cpu> dst, nb::ndarray<nb::ro, nb::device::cpu> src,
         uint64_t seed) {
        const size_t n = SameBytes(dst, src);
        void* d = dst.data();
        const void* s = src.data();
        nb::gil_scoped_release release;
        return CopyWithChecksum64(d, s, n, seed);
      },
      nb::arg("dst").noconvert(), nb::arg("src").noconvert(), nb::arg("seed") = 0,
      "Copy src's bytes into dst and return their XXH3-64 (== checksum64(src, seed)) in one pass "
      "over memory. Both C-contiguous host arrays of the same byte size, any dtypes; "
      "InvalidArgumentError otherwise.");

  nb::class_<PyChecksumStream>(
      m, "Checksum64Stream",
      "XXH3-64 of bytes that come in pieces: update / copy_update with consecutive pieces, then "
      "digest() == checksum64(all pieces joined, seed). Not thread-safe: one per thread.")
      .def(nb::init<uint64_t>(), nb::arg("seed") = 0)
      .def(
          "reset", [](PyChecksumStream& s, uint64_t seed) { s.h->Reset(seed); },
          nb::arg("seed") = 0, "Start a new digest with this seed.")
      .def(
          "update",
          [](PyChecksumStream& s, nb::ndarray<nb::ro, nb::device::cpu> data) {
            const size_t n = DenseBytes(data, "data");
            const void* p = data.data();
            nb::gil_scoped_release release;
            s.h->Update(p, n);
          },
          nb::arg("data").noconvert(), "Hash the next piece (a C-contiguous host array's bytes).")
      .def(
          "copy_update",
          [](PyChecksumStream& s, nb::ndarray<nb::device::cpu> dst,
             nb::ndarray<nb::ro, nb::device::cpu> src, bool keep_in_cache) {
            const std::vector<StreamRun> runs = CopyRuns(dst, src);
            nb::gil_scoped_release release;
            s.h->CopyUpdateRuns(runs.data(), runs.size(), keep_in_cache);
          },
          nb::arg("dst").noconvert(), nb::arg("src").noconvert(), nb::kw_only(),
          nb::arg("keep_in_cache") = false,
          "Copy the next piece from src into dst and hash its bytes (in C order) in the same "
          "pass. Host arrays of the same byte size, any dtypes; both C-contiguous, or one of them "
          "strided with a contiguous innermost dimension (a gather into / scatter out of the "
          "other); InvalidArgumentError otherwise. Large copies bypass the cache (non-temporal "
          "stores) unless keep_in_cache: then dst stays cached for a reader that comes right "
          "after.")
      .def(
          "cast_update",
          [](PyChecksumStream& s, nb::ndarray<nb::device::cpu> dst,
             nb::ndarray<nb::ro, nb::device::cpu> src) {
            Checksum64Stream::NarrowFn narrow = nullptr;
            const std::vector<StreamRun> runs = CastRuns(dst, src, &narrow);
            nb::gil_scoped_release release;
            s.h->CastUpdateRuns(runs.data(), runs.size(), narrow);
          },
          nb::arg("dst").noconvert(), nb::arg("src").noconvert(),
          "Hash the next piece (src: float32 host values, its bytes in C order) and write it into "
          "dst as bfloat16 or float16 (dst's dtype; uint16 means bfloat16 bits) in the same pass: "
          "round to nearest even like torch's tensor.to(dst dtype) for every non-NaN value; NaN "
          "becomes 0x7FC0 (bfloat16) or sign | 0x7E00 (float16). dst is a host array with as "
          "many values; both C-contiguous, or one of "
          "them strided with a contiguous innermost dimension; InvalidArgumentError otherwise.")
      .def(
          "digest", [](const PyChecksumStream& s) { return s.h->Digest(); },
          "The digest of every piece so far (the state stays usable).");
}

}  // namespace tpusync::bindings
