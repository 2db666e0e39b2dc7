// ProcSparseMatMul(X, indices, deltas, B?) = the composer with the `proc` weight backend and either
// the dense gate (default) or the `kwta` gate (kwta_* attributes: the composed mode).
#include <cmath>
#include <cstring>
#include <memory>

#include "common/metrics.h"
#include "engine/gated_matmul.h"
#include "engine/kwta_gate.h"
#include "engine/proc_backend.h"
#include "ort/kwta_attributes.h"
#include "ort/matmul_io.h"
#include "ort/op_schema.h"
#include "ort/ops.h"

namespace ortsparse::ort {
namespace {

using Schema = schema::ProcSparseMatMul;  // names and defaults: graph_rewrite/op_schema.json

enum Counter { kCalls, kRows, kBlocks, kUnitPasses, kGateTotal, kGateKept };
enum Constant { kTrims, kMemRatio, kFanout };

std::vector<std::pair<std::string, double>> describe_proc(const uint64_t* c, const double* constants) {
  return {
      {"proc.fanout_effective", c[kUnitPasses] ? static_cast<double>(c[kBlocks]) / c[kUnitPasses] : constants[kFanout]},
      {"proc.trims", constants[kTrims]},
      {"proc.mem_ratio", constants[kMemRatio]},
      {"proc.fanout", constants[kFanout]},
      {"kwta.keep_ratio", c[kGateTotal] ? static_cast<double>(c[kGateKept]) / c[kGateTotal] : 1.0},
      {"calls", static_cast<double>(c[kCalls])},
      {"rows", static_cast<double>(c[kRows])},
      {"blocks_computed", static_cast<double>(c[kBlocks])},
  };
}

// The gate attributes of KwtaBlockMatMul, prefixed `kwta_` (kwta_block defaults to the op's block). Without any of k_frac < 1, k_abs or
// threshold the gate keeps every row: no gate is built (the dense gate).
struct GateSpec {
  bool enabled = false;
  engine::KwtaConfig config;
  int64_t block = 0;
};

GateSpec read_gate(const Attributes& attrs, int64_t block) {
  GateSpec g;
  g.config = read_kwta_attributes(attrs, "kwta_", Schema::kwta_k_frac);
  const engine::KwtaConfig& c = g.config;
  g.block = attrs.get_int("kwta_block", block);
  g.enabled = c.k_frac < 1.0 || c.k_abs > 0 || c.threshold > 0.0f;
  return g;
}

class ProcSparseMatMulKernel : public KernelBase<ProcSparseMatMulKernel> {
 public:
  static constexpr const char* kOpName = "ProcSparseMatMul";
  static std::vector<InputSpec> inputs() {
    return {{ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, false},
            {ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT16, false},
            {ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED, false},  // float or float16, checked at creation
            {ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, true}};
  }
  static size_t output_count() { return 1; }

  ProcSparseMatMulKernel(const OrtApi&, const OrtKernelInfo* info) : KernelBase(kOpName, info) {
    const Attributes attrs(info);
    kernel_set_or_fail();
    const int64_t k = attrs.get_int("K", Schema::K), n = attrs.get_int("N", Schema::N);
    const int64_t block = attrs.get_int("block", Schema::block);
    const int64_t seed = attrs.get_int("seed", Schema::seed);
    const float base_scale = attrs.get_float("base_scale", Schema::base_scale);
    if (k < 1) fail("attribute K=", k, " must be >= 1 (the rows of the dense W this layer replaces)");
    if (n < 1) fail("attribute N=", n, " must be >= 1");
    if (block < 1 || block > k) fail("attribute block=", block, " must be in [1, K=", k, "]");
    if (!std::isfinite(base_scale)) fail("attribute base_scale=", base_scale, " must be finite");
    const int64_t nb = (k + block - 1) / block;
    const int64_t fanout = attrs.get_int("fanout", Schema::fanout);
    const ConstantTensorAny index = constant_input(info, 1, "indices",
                                                   "the builder's packed weights, read once at session creation");
    const ConstantTensorAny deltas = constant_input(info, 2, "deltas",
                                                    "the builder's packed weights, read once at session creation");
    if (index.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT16)
      fail("input indices must be uint16, got ", element_type_name(index.type));
    if (index.shape.size() != 2 || index.shape[0] != n)
      fail("input indices has shape ", shape_string(index.shape), ", expected [N=", n, ", fanout]");
    const int64_t f = index.shape[1];
    if (fanout >= 0 && fanout != f) fail("attribute fanout=", fanout, " but input indices has shape ", shape_string(index.shape));
    if (f < 1 || f > nb) fail("input indices has shape ", shape_string(index.shape), ": fanout must be in [1, ", nb, "] (K=", k, ", block=", block, ")");
    kernels::DeltaType type;
    if (deltas.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) {
      type = kernels::DeltaType::kF32;
    } else if (deltas.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16) {
      type = kernels::DeltaType::kF16;
    } else {
      fail("input deltas must be float32 or float16, got ", element_type_name(deltas.type));
    }
    const std::vector<int64_t> want{n, f, block};
    if (deltas.shape != want)
      fail("input deltas has shape ", shape_string(deltas.shape), ", expected ", shape_string(want), " [N, fanout, block]");
    auto weights = std::make_shared<const engine::ProcWeights>(
        static_cast<size_t>(k), static_cast<size_t>(n), static_cast<size_t>(block), static_cast<size_t>(f),
        static_cast<uint64_t>(seed), base_scale, static_cast<const uint16_t*>(index.data), deltas.data, type);
    const double mem_ratio = static_cast<double>(weights->bytes()) / (static_cast<double>(k) * n * sizeof(float));
    const double trims = static_cast<double>(weights->zero_deltas());
    auto backend = std::make_shared<const engine::ProcBackend>(std::move(weights));
    const GateSpec gate = read_gate(attrs, block);
    std::unique_ptr<engine::InputGate> kwta;
    engine::GatedMatMulOptions options;
    if (gate.enabled) {
      if (gate.block < 1 || gate.block > k) fail("attribute kwta_block=", gate.block, " must be in [1, K=", k, "]");
      const engine::BlockPartition partition(static_cast<size_t>(k), static_cast<size_t>(gate.block));
      std::vector<float> norms;
      if (gate.config.score == engine::KwtaScore::kL2Weighted) norms = backend->block_norms(partition);
      kwta = std::make_unique<engine::KwtaGate>(partition, gate.config, std::move(norms));
      options.max_gated_rows = gate.config.max_gated_rows;
    }
    matmul_ = std::make_unique<engine::GatedMatMul>(std::move(kwta), std::move(backend), options);
    metrics_ = metrics_slot(kOpName, node(), describe_proc);
    metrics_->set_constant(kTrims, trims);
    metrics_->set_constant(kMemRatio, mem_ratio);
    metrics_->set_constant(kFanout, static_cast<double>(f));
  }

  void Compute(OrtKernelContext* context) {
    const engine::MatMulStats run = run_matmul(context, *matmul_, 3);
    if (run.gate.rows == 0) return;
    metrics_->add(kCalls, 1);
    metrics_->add(kRows, run.gate.rows);
    metrics_->add(kBlocks, run.backend.blocks);
    metrics_->add(kUnitPasses, run.backend.unit_passes);
    metrics_->add(kGateTotal, run.gate.blocks_total);
    metrics_->add(kGateKept, run.gate.blocks_kept);
  }

 private:
  std::unique_ptr<engine::GatedMatMul> matmul_;
  std::shared_ptr<MetricsSlot> metrics_;
};

}  // namespace

const OrtCustomOp* proc_sparse_matmul_op() {
  static const OpAdapter<ProcSparseMatMulKernel> op;
  return &op;
}

}  // namespace ortsparse::ort
