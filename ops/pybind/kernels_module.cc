// ortsparse._kernels: the engine's raw kernels and gates for tests, benchmarks and offline work.
// Nothing here is used by ORT; every function takes the ISA explicitly so one machine tests all.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "pybind/bindings_common.h"

#include <memory>
#include <string>

#include "common/cpu_features.h"
#include "common/error.h"
#include "engine/dense_backend.h"
#include "engine/gated_matmul.h"
#include "engine/kwta_gate.h"
#include "kernels/kernel_set.h"
#include "kernels/top_k.h"

namespace py = pybind11;
void register_proc(py::module_& m);  // ops/pybind/proc_module.cc
void register_attention(py::module_& m);
void register_tt(py::module_& m);  // tt_module.cc
void register_quant(py::module_& m);  // quant_module.cc
using namespace ortsparse;
using bindings::FloatArray;
using bindings::IntArray;

namespace {

using bindings::parse_isa;

const kernels::MatMulKernels& table(const std::string& isa) { return *bindings::kernel_set(isa).matmul; }
const kernels::SelectKernels& select_table(const std::string& isa) { return *bindings::kernel_set(isa).select; }

const int32_t* rows_ptr(const py::object& rows, size_t k, size_t* nrows) {
  if (rows.is_none()) return nullptr;
  IntArray r = rows.cast<IntArray>();
  *nrows = static_cast<size_t>(r.size());
  for (ssize_t i = 0; i < r.size(); ++i)
    if (r.data()[i] < 0 || static_cast<size_t>(r.data()[i]) >= k) throw py::index_error("row index out of range");
  return r.data();
}

// Checked arguments shared by the two row kernels.
struct RowKernelArgs {
  size_t k = 0, n = 0, nrows = 0;
  IntArray rows_keep;
  const int32_t* rows = nullptr;
};

RowKernelArgs row_kernel_args(const FloatArray& w, const py::object& rows, size_t nrows) {
  if (w.ndim() != 2) throw py::value_error("W must be 2-D");
  RowKernelArgs a;
  a.k = w.shape(0);
  a.n = w.shape(1);
  a.nrows = nrows;
  if (!rows.is_none()) {
    a.rows_keep = rows.cast<IntArray>();
    size_t count = 0;
    a.rows = rows_ptr(a.rows_keep, a.k, &count);
    if (count != nrows) throw py::value_error("rows and xv differ in length");
  } else if (nrows > a.k) {
    throw py::value_error("xv longer than K");
  }
  return a;
}

// y starts as y_init (accumulate) or is written from scratch (it holds NaN until the kernel runs).
bool init_output(FloatArray& y, const py::object& y_init) {
  if (y_init.is_none()) return false;
  FloatArray init = y_init.cast<FloatArray>();
  if (init.size() != y.size()) throw py::value_error("y_init has the wrong size");
  std::copy(init.data(), init.data() + init.size(), y.mutable_data());
  return true;
}

FloatArray gemv_rows(const std::string& isa, FloatArray w, py::object rows, FloatArray xv, py::object y_init) {
  const RowKernelArgs a = row_kernel_args(w, rows, static_cast<size_t>(xv.size()));
  FloatArray y = bindings::nan_filled(a.n);
  const bool accumulate = init_output(y, y_init);
  table(isa).gemv_rows(w.data(), a.n, a.rows, xv.data(), a.nrows, y.mutable_data(), a.n, accumulate);
  return y;
}

FloatArray gemm_rows(const std::string& isa, FloatArray w, py::object rows, FloatArray xv, py::object y_init) {
  if (xv.ndim() != 2 || static_cast<size_t>(xv.shape(1)) != kernels::kTokenTile)
    throw py::value_error("xv must be [nrows, kTokenTile]");
  const RowKernelArgs a = row_kernel_args(w, rows, static_cast<size_t>(xv.shape(0)));
  FloatArray y = bindings::nan_filled(std::vector<size_t>{kernels::kTokenTile, a.n});
  const bool accumulate = init_output(y, y_init);
  table(isa).gemm_rows(w.data(), a.n, a.rows, xv.data(), a.nrows, y.mutable_data(), a.n, a.n, accumulate);
  return y;
}

FloatArray block_reduce(const std::string& isa, FloatArray x, size_t block, bool square) {
  if (block < 1) throw py::value_error("block must be >= 1");
  const size_t k = x.size();
  FloatArray out = bindings::nan_filled((k + block - 1) / block);
  (square ? table(isa).block_sumsq : table(isa).block_sumabs)(x.data(), k, block, out.mutable_data());
  return out;
}

// silu(gate) * up on one ISA (gate and up of one length; out pre-filled with NaN, so an unwritten
// entry shows).
FloatArray silu_glu(const std::string& isa, FloatArray gate, FloatArray up) {
  if (gate.ndim() != 1 || up.ndim() != 1 || gate.size() != up.size())
    throw py::value_error("gate and up must be 1-D arrays of one length");
  FloatArray out = bindings::nan_filled(std::vector<size_t>{static_cast<size_t>(gate.size())});
  table(isa).silu_glu(gate.data(), up.data(), static_cast<size_t>(gate.size()), out.mutable_data());
  return out;
}

using KeyArray = py::array_t<uint32_t, py::array::c_style | py::array::forcecast>;

py::tuple order_keys(const std::string& isa, FloatArray values) {
  if (values.size() == 0) throw py::value_error("values must not be empty");
  KeyArray keys(values.size());
  uint32_t lo = 0, hi = 0;
  select_table(isa).order_keys(values.data(), values.size(), keys.mutable_data(), &lo, &hi);
  return py::make_tuple(keys, lo, hi);
}

IntArray indices_in_range(const std::string& isa, KeyArray keys, uint32_t lo, uint32_t hi) {
  std::vector<int32_t> out(keys.size() + kernels::kIndexSlack, -1);
  const size_t count = select_table(isa).indices_in_range(keys.data(), keys.size(), lo, hi, out.data());
  IntArray result(count);
  std::copy(out.begin(), out.begin() + count, result.mutable_data());
  return result;
}

IntArray select_top_k(FloatArray values, size_t k, const std::string& isa) {
  std::vector<int32_t> kept(values.size() + kernels::kIndexSlack, -1);
  std::vector<uint32_t> scratch;
  const size_t count = kernels::select_top_k(select_table(isa), values.data(), values.size(), k, kept.data(), scratch);
  IntArray out(count);
  std::copy(kept.begin(), kept.begin() + count, out.mutable_data());
  return out;
}

// The KwtaBlockMatMul computation without ORT: the same gate and engine the op runs.
class KwtaMatMul {
 public:
  KwtaMatMul(FloatArray w, size_t block, double k_frac, int64_t k_abs, const std::string& score, float threshold,
             float temp, int64_t duty, const std::string& duty_mode, bool renorm, const std::string& isa)
      : kernels_(&bindings::kernel_set(isa)) {
    if (w.ndim() != 2) throw py::value_error("W must be 2-D");
    const size_t k = w.shape(0), n = w.shape(1);
    if (block < 1 || block > k) throw py::value_error("block must be in [1, K]");
    engine::KwtaConfig c;
    c.k_frac = k_frac;
    c.k_abs = k_abs;
    c.score = engine::parse_kwta_score(score);
    c.threshold = threshold;
    c.temp = temp;
    c.duty = duty;
    c.duty_mode = engine::parse_duty_mode(duty_mode);
    c.renorm = renorm;
    auto backend = std::make_shared<const engine::DenseBackend>(std::make_shared<const engine::DenseWeights>(w.data(), k, n));
    const engine::BlockPartition part(k, block);
    auto gate = std::make_unique<engine::KwtaGate>(part, c, c.score == engine::KwtaScore::kL2Weighted
                                                                ? backend->block_norms(part)
                                                                : std::vector<float>{});
    gate_ = gate.get();
    matmul_ = std::make_unique<engine::GatedMatMul>(std::move(gate), std::move(backend));
  }

  FloatArray call(FloatArray x, py::object bias) {
    const size_t k = matmul_->k(), n = matmul_->n();
    const bindings::MatMulArgs args(x, bias, k, n);
    const size_t m = args.m;
    const float* bp = args.bias;
    FloatArray y = bindings::nan_filled(std::vector<size_t>{m, n});
    {
      py::gil_scoped_release release;
      matmul_->run(x.data(), 1, m, bp, y.mutable_data(), false, *kernels_, SerialTaskRunner());
    }
    return y;
  }

  // Kept K-rows per token (all rows for a dense token), as the gate decides for this call.
  py::list plan(FloatArray x) {
    const size_t k = matmul_->k();
    if (x.ndim() != 2 || static_cast<size_t>(x.shape(1)) != k) throw py::value_error("x must be [M, K]");
    engine::GatedRows gated;
    gate_->plan(x.data(), x.shape(0), false, *kernels_, gated);
    py::list out;
    for (size_t t = 0; t < gated.tokens(); ++t) {
      const size_t count = gated.row_count(t, k);
      IntArray rows(count);
      for (size_t i = 0; i < count; ++i)
        rows.mutable_data()[i] = gated.dense[t] ? static_cast<int32_t>(i) : gated.rows[gated.offset[t] + i];
      out.append(rows);
    }
    return out;
  }

 private:
  const kernels::KernelSet* kernels_;
  engine::KwtaGate* gate_;  // the gate inside matmul_
  std::unique_ptr<engine::GatedMatMul> matmul_;
};

// The shared packing of one weight buffer as the ops see it (tests of the sharing rule).
class SharedDenseWeights {
 public:
  explicit SharedDenseWeights(FloatArray w) {
    if (w.ndim() != 2) throw py::value_error("W must be 2-D");
    weights_ = engine::DenseWeights::pack_shared(w.data(), w.shape(0), w.shape(1));
  }
  bool is_shared_with(const SharedDenseWeights& other) const { return weights_ == other.weights_; }
  FloatArray rows() const {
    FloatArray out = bindings::nan_filled(std::vector<size_t>{weights_->k(), weights_->n()});
    for (size_t r = 0; r < weights_->k(); ++r)
      std::copy_n(weights_->data() + r * weights_->ldw(), weights_->n(), out.mutable_data() + r * weights_->n());
    return out;
  }

 private:
  std::shared_ptr<const engine::DenseWeights> weights_;
};

}  // namespace

PYBIND11_MODULE(_kernels, m) {
  m.doc() = "ortsparse raw kernels (tests, benchmarks, offline builders)";
  register_attention(m);
  py::register_exception<Error>(m, "Error", PyExc_ValueError);
  m.attr("TOKEN_TILE") = kernels::kTokenTile;
  register_proc(m);
  register_tt(m);
  register_quant(m);
  m.def("active_isa", [] { return std::string(isa_name(active_isa())); });
  m.def("isa_supported", [](const std::string& name) {
    for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512})
      if (name == isa_name(isa)) return isa_supported(isa);
    throw py::value_error("unknown ISA '" + name + "'");
  });
  m.def("supported_isas", [] {
    std::vector<std::string> out;
    for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512})
      if (isa_supported(isa)) out.push_back(isa_name(isa));
    return out;
  });
  m.def("gemv_rows", &gemv_rows, py::arg("isa"), py::arg("w"), py::arg("rows"), py::arg("xv"), py::arg("y_init") = py::none());
  m.def("gemm_rows", &gemm_rows, py::arg("isa"), py::arg("w"), py::arg("rows"), py::arg("xv"), py::arg("y_init") = py::none());
  m.def("block_sumsq", [](const std::string& isa, FloatArray x, size_t block) { return block_reduce(isa, x, block, true); });
  m.def("block_sumabs", [](const std::string& isa, FloatArray x, size_t block) { return block_reduce(isa, x, block, false); });
  m.def("silu_glu", &silu_glu, py::arg("isa"), py::arg("gate"), py::arg("up"));
  m.def("order_keys", &order_keys, py::arg("isa"), py::arg("values"));
  m.def("count_at_least", [](const std::string& isa, KeyArray keys, uint32_t t) {
    return select_table(isa).count_at_least(keys.data(), keys.size(), t);
  });
  m.def("indices_in_range", &indices_in_range, py::arg("isa"), py::arg("keys"), py::arg("lo"), py::arg("hi"));
  m.def("select_top_k", &select_top_k, py::arg("values"), py::arg("k"), py::arg("isa") = "active");
  py::class_<SharedDenseWeights>(m, "SharedDenseWeights")
      .def(py::init<FloatArray>(), py::arg("w"), py::keep_alive<1, 2>())
      .def("is_shared_with", &SharedDenseWeights::is_shared_with)
      .def("rows", &SharedDenseWeights::rows);
  py::class_<KwtaMatMul>(m, "KwtaMatMul")
      .def(py::init<FloatArray, size_t, double, int64_t, const std::string&, float, float, int64_t, const std::string&, bool,
                    const std::string&>(),
           py::arg("w"), py::arg("block") = 1, py::arg("k_frac") = 0.5, py::arg("k_abs") = 0, py::arg("score") = "l2",
           py::arg("threshold") = 0.0f, py::arg("temp") = 1.0f, py::arg("duty") = 1, py::arg("duty_mode") = "dense",
           py::arg("renorm") = false, py::arg("isa") = "active")
      .def("__call__", &KwtaMatMul::call, py::arg("x"), py::arg("bias") = py::none())
      .def("plan", &KwtaMatMul::plan, py::arg("x"));
}
