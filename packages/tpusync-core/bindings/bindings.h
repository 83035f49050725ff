// Shared helpers of the nanobind bindings. Bindings stay thin: argument conversion, GIL handling
// and Status -> exception; every decision lives in native/.
#pragma once

#include <nanobind/nanobind.h>

#include <exception>
#include <string>
#include <utility>

#include "tpusync/base/status.h"

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

void init_base(nb::module_& m);
void init_memory(nb::module_& m);
void init_block(nb::module_& m);
void init_engine(nb::module_& m);
void init_transport(nb::module_& m);

}  // namespace tpusync::bindings
