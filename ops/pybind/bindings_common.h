// What every _kernels binding file shares: the array types, the ISA-name parser and the checks of a
// matmul call's x [M, K] / bias [N] arguments.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "common/cpu_features.h"

namespace ortsparse::bindings {

namespace py = pybind11;
using FloatArray = py::array_t<float, py::array::c_style | py::array::forcecast>;
using IntArray = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

// "scalar" | "avx2" | "avx512" (must be supported by this CPU) | "" or "active" (the process's ISA).
inline Isa parse_isa(const std::string& name) {
  if (name.empty() || name == "active") return active_isa();
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512})
    if (name == isa_name(isa)) {
      if (!isa_supported(isa)) throw py::value_error("ISA " + name + " is not supported by this CPU");
      return isa;
    }
  throw py::value_error("unknown ISA '" + name + "' (scalar, avx2, avx512, active)");
}

// x must be [M, K]; bias None or N values (kept alive here while `bias` points into it).
struct MatMulArgs {
  size_t m = 0;
  const float* bias = nullptr;
  FloatArray bias_values;

  MatMulArgs(const FloatArray& x, const py::object& bias_arg, size_t k, size_t n) {
    if (x.ndim() != 2 || static_cast<size_t>(x.shape(1)) != k) throw py::value_error("x must be [M, K]");
    m = static_cast<size_t>(x.shape(0));
    if (!bias_arg.is_none()) {
      bias_values = bias_arg.cast<FloatArray>();
      if (static_cast<size_t>(bias_values.size()) != n) throw py::value_error("bias must have N values");
      bias = bias_values.data();
    }
  }
};

}  // namespace ortsparse::bindings
