// What every _kernels binding file shares: the array types, the ISA-name parser and the checks of a
// matmul call's x [M, K] / bias [N] arguments.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>

#include "common/cpu_features.h"
#include "kernels/kernel_set.h"

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

// "portable" | "popcnt" | "vpopcntdq" (must be supported) | "" or "active" (the process's path).
inline kernels::PopcntPath parse_popcnt(const std::string& name) {
  if (name.empty() || name == "active") return kernels::active_kernel_set().popcnt_path;
  const kernels::PopcntPath p = kernels::parse_popcnt_path(name);
  if (!kernels::popcnt_path_supported(p)) throw py::value_error("popcount path " + name + " is not supported by this CPU");
  return p;
}

// The kernel set of an ISA name (and popcount path name).
inline const kernels::KernelSet& kernel_set(const std::string& isa, const std::string& popcnt = "active") {
  return kernels::kernel_set(parse_isa(isa), parse_popcnt(popcnt));
}

// An output array filled with NaN, so a kernel that leaves an entry unwritten fails the test.
template <typename Shape>
FloatArray nan_filled(Shape shape) {
  FloatArray out(shape);
  std::fill(out.mutable_data(), out.mutable_data() + out.size(), std::numeric_limits<float>::quiet_NaN());
  return out;
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
