// dtype names <-> DLPack dtypes for zero-copy views ("float16", "bfloat16", "uint8", ...).
#pragma once

#include <nanobind/ndarray.h>

#include <string>

#include "bindings.h"

namespace tpusync::bindings {

inline nb::dlpack::dtype ParseDType(const std::string& name) {
  using nb::dlpack::dtype_code;
  struct Entry {
    const char* name;
    dtype_code code;
    uint8_t bits;
  };
  static const Entry kTable[] = {
      {"uint8", dtype_code::UInt, 8},     {"int8", dtype_code::Int, 8},
      {"uint16", dtype_code::UInt, 16},   {"int16", dtype_code::Int, 16},
      {"uint32", dtype_code::UInt, 32},   {"int32", dtype_code::Int, 32},
      {"uint64", dtype_code::UInt, 64},   {"int64", dtype_code::Int, 64},
      {"float16", dtype_code::Float, 16}, {"bfloat16", dtype_code::Bfloat, 16},
      {"float32", dtype_code::Float, 32}, {"float64", dtype_code::Float, 64},
      {"bool", dtype_code::Bool, 8},
  };
  for (const auto& e : kTable) {
    if (name == e.name) return nb::dlpack::dtype{static_cast<uint8_t>(e.code), e.bits, 1};
  }
  throw StatusError(Status::InvalidArgument(StrCat(
      "unsupported dtype '", name,
      "': use one of uint8/16/32/64, int8/16/32/64, float16, bfloat16, float32, float64, bool")));
}

}  // namespace tpusync::bindings
