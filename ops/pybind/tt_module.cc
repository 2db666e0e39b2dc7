// TT bindings of ortsparse._kernels: the TT GEMM kernels per ISA and the `tt` backend without ORT
// (tests compare both with numpy; benchmarks time the backend alone).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "pybind/bindings_common.h"

#include <algorithm>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "common/cpu_features.h"
#include "common/error.h"
#include "engine/tt_backend.h"
#include "kernels/kernel_set.h"

namespace py = pybind11;
using namespace ortsparse;
using bindings::FloatArray;
using bindings::IntArray;

namespace {

// C = A . B through the ISA's kernel; A, B 2-D (views with leading dims are exercised by the backend).
FloatArray tt_gemm(const std::string& isa, FloatArray a, FloatArray b) {
  if (a.ndim() != 2 || b.ndim() != 2 || a.shape(1) != b.shape(0)) throw py::value_error("need A [m, k] and B [k, n]");
  const size_t m = a.shape(0), k = a.shape(1), n = b.shape(1);
  FloatArray c = bindings::nan_filled(std::vector<size_t>{m, n});
  bindings::kernel_set(isa).tt->gemm(a.data(), k, b.data(), n, c.mutable_data(), n, m, k, n);
  return c;
}

class TTMatMul {
 public:
  TTMatMul(FloatArray cores, std::vector<int64_t> in_modes, std::vector<int64_t> out_modes, std::vector<int64_t> ranks,
           int order, const std::string& isa)
      : kernels_(&bindings::kernel_set(isa)) {
    engine::TTShape shape = engine::make_tt_shape(in_modes, out_modes, ranks, static_cast<size_t>(cores.size()));
    backend_ = std::make_unique<engine::TTBackend>(std::move(shape), cores.data(), order);
  }

  // rows: None (every token dense) or a list with, per token, None (dense) or its kept row indices.
  FloatArray call(FloatArray x, py::object bias, py::object rows) {
    const size_t k = backend_->k(), n = backend_->n();
    const bindings::MatMulArgs args(x, bias, k, n);
    const size_t m = args.m;
    const float* bp = args.bias;
    engine::GatedRows gated;
    py::list per_token = rows.is_none() ? py::list() : rows.cast<py::list>();
    if (!rows.is_none() && per_token.size() != m) throw py::value_error("rows must have one entry per token");
    for (size_t t = 0; t < m; ++t) {
      if (rows.is_none() || per_token[t].is_none()) {
        gated.add_dense_token();
        continue;
      }
      IntArray r = per_token[t].cast<IntArray>();
      for (ssize_t i = 0; i < r.size(); ++i) {
        const int32_t v = r.data()[i];
        if (v < 0 || static_cast<size_t>(v) >= k) throw py::index_error("row index out of range");
        gated.rows.push_back(v);
      }
      gated.dense.push_back(0);
      gated.scale.push_back(1.0f);
      gated.offset.push_back(gated.rows.size());
    }
    FloatArray y = bindings::nan_filled(std::vector<size_t>{m, n});
    {
      py::gil_scoped_release release;
      backend_->run(x.data(), m, gated, bp, y.mutable_data(), *kernels_, SerialTaskRunner());
    }
    return y;
  }

  size_t k() const { return backend_->k(); }
  size_t n() const { return backend_->n(); }
  size_t bytes() const { return backend_->bytes(); }
  bool right_to_left() const { return backend_->right_to_left(); }
  double macs_per_token() const { return backend_->macs_per_token(); }

 private:
  const kernels::KernelSet* kernels_;
  std::unique_ptr<engine::TTBackend> backend_;
};

}  // namespace

void register_tt(py::module_& m) {
  m.def("tt_gemm", &tt_gemm, py::arg("isa"), py::arg("a"), py::arg("b"));
  py::class_<TTMatMul>(m, "TTMatMul")
      .def(py::init<FloatArray, std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>, int, const std::string&>(),
           py::arg("cores"), py::arg("in_modes"), py::arg("out_modes"), py::arg("ranks"), py::arg("order") = -1,
           py::arg("isa") = "active")
      .def("__call__", &TTMatMul::call, py::arg("x"), py::arg("bias") = py::none(), py::arg("rows") = py::none())
      .def_property_readonly("k", &TTMatMul::k)
      .def_property_readonly("n", &TTMatMul::n)
      .def_property_readonly("bytes", &TTMatMul::bytes)
      .def_property_readonly("right_to_left", &TTMatMul::right_to_left)
      .def_property_readonly("macs_per_token", &TTMatMul::macs_per_token);
}
