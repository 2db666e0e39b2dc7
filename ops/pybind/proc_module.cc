// ortsparse._kernels, proc part: the ProcSparseMatMul builder loops, the hash, and the proc
// backend without ORT (kernel twin tests, benchmarks).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "pybind/bindings_common.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "common/cpu_features.h"
#include "common/error.h"
#include "engine/kwta_gate.h"
#include "engine/gated_matmul.h"
#include "engine/proc_backend.h"

namespace py = pybind11;
using namespace ortsparse;
using bindings::FloatArray;
using U16Array = py::array_t<uint16_t, py::array::c_style | py::array::forcecast>;

namespace {



FloatArray base_values(const std::string& isa, uint64_t seed, float scale, uint64_t n, uint64_t k0, size_t count) {
  FloatArray out = bindings::nan_filled(count);
  bindings::kernel_set(isa).proc->base_values(seed, scale, n, k0, count, out.mutable_data());
  return out;
}

// One chunk of output units: wt [units, K] is W's columns n0 .. n0 + units (transposed, so a unit
// is contiguous). Per unit: deltas from the base, the top `fanout` blocks by ||delta_b|| * importance_b
// (ties: lower block), soft shedding (|delta| < shed_eps -> 0), then the hard cap: at most
// `watermark` nonzero deltas per unit, the largest |delta| kept (ties: lower k). 0 = no cap.
py::tuple build(FloatArray wt, uint64_t n0, size_t block, size_t fanout, float base_scale, uint64_t seed,
                float shed_eps, size_t watermark, py::object importance) {
  if (wt.ndim() != 2) throw py::value_error("wt must be [units, K]");
  const size_t units = wt.shape(0), k = wt.shape(1);
  if (block < 1 || block > k) throw py::value_error("block must be in [1, K]");
  const size_t nb = (k + block - 1) / block;
  if (nb > 65536) throw py::value_error("more than 65536 blocks: use a larger block");
  if (fanout < 1 || fanout > nb) throw py::value_error("fanout must be in [1, blocks=" + std::to_string(nb) + "]");
  FloatArray imp_arr;
  const float* imp = nullptr;
  if (!importance.is_none()) {
    imp_arr = importance.cast<FloatArray>();
    if (static_cast<size_t>(imp_arr.size()) != nb) throw py::value_error("importance must hold one value per block");
    imp = imp_arr.data();
  }
  U16Array index({units, fanout});
  FloatArray deltas({units, fanout, block});
  uint64_t soft = 0, hard = 0;
  {
    py::gil_scoped_release release;
    const float* w = wt.data();
    uint16_t* out_index = index.mutable_data();
    float* out_deltas = deltas.mutable_data();
    std::vector<float> d(k);
    std::vector<double> score(nb);
    std::vector<uint32_t> order(nb);
    std::vector<std::pair<float, uint32_t>> kept_abs;
    for (size_t u = 0; u < units; ++u) {
      const float* wu = w + u * k;
      const uint64_t n = n0 + u;
      for (size_t r = 0; r < k; ++r)
        d[r] = wu[r] - (base_scale != 0.0f ? engine::proc_base(seed, base_scale, n, r) : 0.0f);
      for (size_t b = 0; b < nb; ++b) {
        double s = 0.0;
        for (size_t r = b * block; r < std::min(k, (b + 1) * block); ++r) s += static_cast<double>(d[r]) * d[r];
        score[b] = imp ? s * static_cast<double>(imp[b]) * imp[b] : s;
      }
      std::iota(order.begin(), order.end(), 0u);
      std::partial_sort(order.begin(), order.begin() + fanout, order.end(), [&](uint32_t a, uint32_t b) {
        return score[a] > score[b] || (score[a] == score[b] && a < b);
      });
      std::sort(order.begin(), order.begin() + fanout);
      float* du = out_deltas + u * fanout * block;
      std::fill(du, du + fanout * block, 0.0f);
      kept_abs.clear();
      for (size_t f = 0; f < fanout; ++f) {
        const size_t b = order[f];
        out_index[u * fanout + f] = static_cast<uint16_t>(b);
        for (size_t r = b * block, i = 0; r < std::min(k, (b + 1) * block); ++r, ++i) {
          const float v = d[r];
          if (std::fabs(v) < shed_eps) {
            ++soft;
            continue;
          }
          du[f * block + i] = v;
          if (v != 0.0f) kept_abs.emplace_back(std::fabs(v), static_cast<uint32_t>(f * block + i));
        }
      }
      if (watermark > 0 && kept_abs.size() > watermark) {
        std::nth_element(kept_abs.begin(), kept_abs.begin() + watermark, kept_abs.end(),
                         [](const auto& a, const auto& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); });
        for (size_t i = watermark; i < kept_abs.size(); ++i) du[kept_abs[i].second] = 0.0f;
        hard += kept_abs.size() - watermark;
      }
    }
  }
  return py::make_tuple(index, deltas, soft, hard);
}

// The proc backend with the dense or kwta gate, serial, on a chosen ISA.
class ProcMatMul {
 public:
  ProcMatMul(U16Array index, py::array deltas, size_t k, size_t block, uint64_t seed, float base_scale,
             double kwta_k_frac, size_t kwta_block, const std::string& kwta_score, const std::string& isa)
      : kernels_(&bindings::kernel_set(isa)) {
    if (index.ndim() != 2) throw py::value_error("index must be [N, fanout]");
    const size_t n = index.shape(0), fanout = index.shape(1);
    kernels::DeltaType type;
    py::array contiguous;
    if (deltas.dtype().kind() == 'f' && deltas.dtype().itemsize() == 2) {
      type = kernels::DeltaType::kF16;
      contiguous = py::array::ensure(deltas, py::array::c_style);
    } else {
      type = kernels::DeltaType::kF32;
      contiguous = FloatArray::ensure(deltas);
    }
    if (contiguous.ndim() != 3 || static_cast<size_t>(contiguous.shape(0)) != n ||
        static_cast<size_t>(contiguous.shape(1)) != fanout || static_cast<size_t>(contiguous.shape(2)) != block)
      throw py::value_error("deltas must be [N, fanout, block]");
    weights_ = std::make_shared<const engine::ProcWeights>(k, n, block, fanout, seed, base_scale, index.data(),
                                                            contiguous.data(), type);
    auto backend = std::make_shared<const engine::ProcBackend>(weights_);
    std::unique_ptr<engine::KwtaGate> gate;
    if (kwta_k_frac < 1.0) {
      engine::KwtaConfig c;
      c.k_frac = kwta_k_frac;
      c.score = engine::parse_kwta_score(kwta_score);
      const engine::BlockPartition part(k, kwta_block ? kwta_block : block);
      gate = std::make_unique<engine::KwtaGate>(part, c, c.score == engine::KwtaScore::kL2Weighted
                                                             ? backend->block_norms(part)
                                                             : std::vector<float>{});
    }
    matmul_ = std::make_unique<engine::GatedMatMul>(std::move(gate), std::move(backend));
  }

  FloatArray call(FloatArray x, py::object bias) {
    const size_t k = weights_->k(), n = weights_->n();
    const bindings::MatMulArgs args(x, bias, k, n);
    const size_t m = args.m;
    const float* bp = args.bias;
    FloatArray y = bindings::nan_filled(std::vector<size_t>{m, n});
    {
      py::gil_scoped_release release;
      stats_ = matmul_->run(x.data(), 1, m, bp, y.mutable_data(), false, *kernels_, SerialTaskRunner()).backend;
    }
    return y;
  }

  py::tuple last_stats() const { return py::make_tuple(stats_.blocks, stats_.unit_passes); }
  size_t bytes() const { return weights_->bytes(); }
  size_t zero_deltas() const { return weights_->zero_deltas(); }

 private:
  const kernels::KernelSet* kernels_;
  std::shared_ptr<const engine::ProcWeights> weights_;
  std::unique_ptr<engine::GatedMatMul> matmul_;
  engine::BackendStats stats_;
};

}  // namespace

void register_proc(py::module_& m) {
  m.def("proc_base_values", &base_values, py::arg("isa"), py::arg("seed"), py::arg("scale"), py::arg("n"),
        py::arg("k0"), py::arg("count"));
  m.def("proc_build", &build, py::arg("wt"), py::arg("n0"), py::arg("block"), py::arg("fanout"),
        py::arg("base_scale"), py::arg("seed"), py::arg("shed_eps"), py::arg("watermark"),
        py::arg("importance") = py::none());
  py::class_<ProcMatMul>(m, "ProcMatMul")
      .def(py::init<U16Array, py::array, size_t, size_t, uint64_t, float, double, size_t, const std::string&,
                    const std::string&>(),
           py::arg("index"), py::arg("deltas"), py::arg("k"), py::arg("block"), py::arg("seed") = 0,
           py::arg("base_scale") = 0.0f, py::arg("kwta_k_frac") = 1.0, py::arg("kwta_block") = 0,
           py::arg("kwta_score") = "l2", py::arg("isa") = "active")
      .def("__call__", &ProcMatMul::call, py::arg("x"), py::arg("bias") = py::none())
      .def("last_stats", &ProcMatMul::last_stats)
      .def_property_readonly("bytes", &ProcMatMul::bytes)
      .def_property_readonly("zero_deltas", &ProcMatMul::zero_deltas);
}
