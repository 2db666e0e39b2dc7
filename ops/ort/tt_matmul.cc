// TTMatMul(X, cores, B?, W_dense?) = the composer with the dense gate (every row) over the `tt`
// weight backend, with the NaN guard. The cores come as one concatenated constant tensor (see
// docs/ops.md); a dense copy of W is only kept when the rewriter asks for the guard's fallback.
#include <cstdint>
#include <cstring>
#include <memory>

#include "common/metrics.h"
#include "engine/dense_backend.h"
#include "engine/gated_matmul.h"
#include "engine/tt_backend.h"
#include "ort/matmul_io.h"
#include "ort/op_schema.h"
#include "ort/ops.h"

namespace ortsparse::ort {
namespace {

using Schema = schema::TTMatMul;  // names and defaults: graph_rewrite/op_schema.json

enum Counter { kCalls, kRows, kFallbackCalls, kMacsDense, kMacsTT, kBytesDense, kBytesKept, kRankSum, kGapMicro };
enum Constant { kRank, kGap, kSpeedup, kMemSaved };

std::vector<std::pair<std::string, double>> describe_tt(const uint64_t* c, const double* constants) {
  const double calls = static_cast<double>(c[kCalls]);
  // Per call weighted so that totals over several nodes stay meaningful; before the first call
  // (or after reset_metrics) the node's constants are shown.
  const auto per_call = [&](Counter counter, Constant fallback, double scale) {
    return calls > 0 ? static_cast<double>(c[counter]) * scale / calls : constants[fallback];
  };
  return {
      {"tt.enabled", calls > 0 ? 1.0 - static_cast<double>(c[kFallbackCalls]) / calls : 1.0},
      {"tt.rank", per_call(kRankSum, kRank, 1.0)},
      {"tt.gap", per_call(kGapMicro, kGap, 1e-6)},
      {"tt.speedup", c[kMacsTT] ? static_cast<double>(c[kMacsDense]) / static_cast<double>(c[kMacsTT]) : constants[kSpeedup]},
      {"tt.mem_saved", c[kBytesDense] ? 1.0 - static_cast<double>(c[kBytesKept]) / static_cast<double>(c[kBytesDense])
                                      : constants[kMemSaved]},
      {"calls", calls},
      {"rows", static_cast<double>(c[kRows])},
      {"nan_fallbacks", static_cast<double>(c[kFallbackCalls])},
  };
}


class TTMatMulKernel : public KernelBase<TTMatMulKernel> {
 public:
  static constexpr const char* kOpName = "TTMatMul";
  static std::vector<InputSpec> inputs() {
    return {{ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, false},
            {ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, false},
            {ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, true},
            {ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, true}};
  }
  static size_t output_count() { return 1; }

  TTMatMulKernel(const OrtApi&, const OrtKernelInfo* info) : KernelBase(kOpName, info) {
    const Attributes attrs(info);
    kernel_set_or_fail();
    const std::vector<int64_t> in_modes = attrs.get_ints("in_modes");
    const std::vector<int64_t> out_modes = attrs.get_ints("out_modes");
    const std::vector<int64_t> ranks = attrs.get_ints("ranks");
    const float gap = attrs.get_float("gap", Schema::gap);
    const int64_t nan_guard = attrs.get_int("nan_guard", Schema::nan_guard);
    if (nan_guard != 0 && nan_guard != 1) fail("attribute nan_guard=", nan_guard, " must be 0 or 1");
    const int64_t order = attrs.get_int("order", Schema::order);
    if (order < -1 || order > 1) fail("attribute order=", order, " must be -1 (auto), 0 (first core first) or 1 (last core first)");
    const ConstantTensor cores = constant_float_input(info, 1, "cores", 1);
    engine::TTShape shape = engine::make_tt_shape(in_modes, out_modes, ranks, static_cast<size_t>(cores.shape[0]));
    auto backend = std::make_shared<const engine::TTBackend>(std::move(shape), cores.data, static_cast<int>(order));
    const size_t k = backend->k(), n = backend->n();
    engine::GatedMatMulOptions options;
    options.nan_guard = nan_guard == 1;
    if (input_present(info, 3)) {
      const ConstantTensor w = constant_float_input(info, 3, "W_dense", 2);
      if (w.shape[0] != static_cast<int64_t>(k) || w.shape[1] != static_cast<int64_t>(n))
        fail("input W_dense has shape ", shape_string(w.shape), " but the cores describe W [", k, ", ", n, "]");
      options.fallback = std::make_shared<const engine::DenseBackend>(engine::DenseWeights::pack_shared(w.data, k, n));
    }
    rank_ = backend->shape().max_rank();
    macs_tt_ = static_cast<uint64_t>(backend->macs_per_token() + 0.5);
    macs_dense_ = static_cast<uint64_t>(k) * n;
    bytes_dense_ = static_cast<uint64_t>(k) * n * sizeof(float);
    bytes_kept_ = backend->bytes() + (options.fallback ? options.fallback->bytes() : 0);
    gap_micro_ = gap >= 0 ? static_cast<uint64_t>(static_cast<double>(gap) * 1e6 + 0.5) : 0;
    metrics_ = metrics_slot(kOpName, node(), describe_tt);
    metrics_->set_constant(kRank, static_cast<double>(rank_));
    metrics_->set_constant(kGap, gap);
    metrics_->set_constant(kSpeedup, static_cast<double>(macs_dense_) / std::max<double>(1.0, backend->macs_per_token()));
    metrics_->set_constant(kMemSaved, 1.0 - static_cast<double>(bytes_kept_) / std::max<double>(1.0, bytes_dense_));
    matmul_ = std::make_unique<engine::GatedMatMul>(nullptr, std::move(backend), std::move(options));
  }

  void Compute(OrtKernelContext* context) {
    const engine::MatMulStats run = run_matmul(context, *matmul_, 2);
    const size_t m = run.gate.rows;
    if (m == 0) return;
    metrics_->add(kCalls, 1);
    metrics_->add(kRows, m);
    metrics_->add(kFallbackCalls, run.nan_fallback ? 1 : 0);
    metrics_->add(kMacsDense, macs_dense_ * m);
    metrics_->add(kMacsTT, (run.nan_fallback ? macs_dense_ : macs_tt_) * m);
    metrics_->add(kBytesDense, bytes_dense_);
    metrics_->add(kBytesKept, bytes_kept_);
    metrics_->add(kRankSum, rank_);
    metrics_->add(kGapMicro, gap_micro_);
  }

 private:
  std::unique_ptr<engine::GatedMatMul> matmul_;
  uint64_t rank_ = 0, macs_tt_ = 0, macs_dense_ = 0, bytes_dense_ = 0, bytes_kept_ = 0, gap_micro_ = 0;
  std::shared_ptr<MetricsSlot> metrics_;
};

}  // namespace

const OrtCustomOp* tt_matmul_op() {
  static const OpAdapter<TTMatMulKernel> op;
  return &op;
}

}  // namespace ortsparse::ort
