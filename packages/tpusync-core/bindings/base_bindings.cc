// Versions, checksums and the Status -> Python exception translator.
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include "bindings.h"
#include "tpusync/base/checksum.h"
#include "tpusync/base/version.h"

namespace tpusync::bindings {

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
}

}  // namespace tpusync::bindings
