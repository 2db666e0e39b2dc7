// KwtaBlockMatMul = the composer with the `kwta` gate (behind the `bitmap` gate when pack_mode is
// set) and an optional SwiGLU epilogue (glu) over one of two weight backends, told apart by the
// type of input 1:
//   float form      (X, W float [K, N], B?)                                   -> dense backend
//   quantized form  (X, B uint8, scales, zero_points?, bias?) + K, N, bits, block_size, exactly
//                   com.microsoft.MatMulNBits' weight inputs and attributes   -> quant backend
#include <memory>

#include "common/metrics.h"
#include "engine/bitmap_gate.h"
#include "engine/dense_backend.h"
#include "engine/gated_matmul.h"
#include "engine/kwta_gate.h"
#include "engine/quant_backend.h"
#include "ort/kwta_attributes.h"
#include "ort/matmul_io.h"
#include "ort/op_schema.h"
#include "ort/ops.h"

namespace ortsparse::ort {
namespace {

using Schema = schema::KwtaBlockMatMul;  // names and defaults: graph_rewrite/op_schema.json

enum Counter {
  kCalls, kRows, kBlocksTotal, kBlocksKept, kDutyHits, kPackCalls, kPackApplied, kPackActive, kPackBlocks,
  kDecodeCalls, kDecodePoolCalls
};
enum Constant { kTemp, kKeepCount, kNumBlocks, kPackEnabled, kPackMode, kPackPopcnt };

std::vector<std::pair<std::string, double>> describe_kwta(const uint64_t* c, const double* constants) {
  std::vector<std::pair<std::string, double>> out = {
      {"kwta.keep_ratio", c[kBlocksTotal] ? static_cast<double>(c[kBlocksKept]) / c[kBlocksTotal] : 1.0},
      {"kwta.duty_hits", static_cast<double>(c[kDutyHits])},
      {"kwta.temp", constants[kTemp]},
      {"calls", static_cast<double>(c[kCalls])},
      {"rows", static_cast<double>(c[kRows])},
      {"blocks_total", static_cast<double>(c[kBlocksTotal])},
      {"blocks_kept", static_cast<double>(c[kBlocksKept])},
  };
  if (c[kDecodeCalls]) {  // how often decode's tasks went to the pool (measured dispatch)
    out.push_back({"decode.calls", static_cast<double>(c[kDecodeCalls])});
    out.push_back({"decode.pool_ratio", static_cast<double>(c[kDecodePoolCalls]) / c[kDecodeCalls]});
  }
  if (constants[kPackEnabled] != 0.0) {  // the bitmap gate (pack_mode)
    out.push_back({"pack.enabled", 1.0});
    out.push_back({"pack.mode", constants[kPackMode]});
    out.push_back({"pack.density", c[kPackBlocks] ? static_cast<double>(c[kPackActive]) / c[kPackBlocks] : 0.0});
    out.push_back({"pack.active", c[kPackCalls] ? static_cast<double>(c[kPackApplied]) / c[kPackCalls] : 0.0});
    out.push_back({"pack.popcnt", constants[kPackPopcnt]});
  }
  return out;
}

engine::BitmapConfig read_bitmap_config(const Attributes& attrs, const engine::KwtaConfig& kwta) {
  engine::BitmapConfig c;
  c.mode = engine::parse_pack_gate_mode(attrs.get_string("pack_mode", Schema::pack_mode));
  c.eps = attrs.get_float("pack_eps", Schema::pack_eps);
  c.density_max = attrs.get_float("pack_density_max", Schema::pack_density_max);
  if (c.mode != engine::PackGateMode::kNone && kwta.duty != 1)
    fail("attribute pack_mode='", c.mode == engine::PackGateMode::kBinary ? "binary" : "ternary",
         "' composes with the kwta rule of every call; duty=", kwta.duty, " is not supported with it (use duty=1)");
  return c;
}

// Attribute glu: "none" (Y = X·W, N columns) or "silu" (W's N columns are [gate | up]; Y =
// silu(X·W_gate) * (X·W_up), N/2 columns).
engine::Glu read_glu(const Attributes& attrs, size_t n) {
  const std::string glu = attrs.get_string("glu", Schema::glu);
  if (glu == "none") return engine::Glu::kNone;
  if (glu != "silu") fail("attribute glu='", glu, "' is not one of 'none', 'silu'");
  if (n % 2 != 0) fail("attribute glu='silu' needs an even N (the weight's two halves, gate and up), got N=", n);
  return engine::Glu::kSilu;
}

class KwtaBlockMatMulKernel : public KernelBase<KwtaBlockMatMulKernel> {
 public:
  static constexpr const char* kOpName = "KwtaBlockMatMul";
  static std::vector<InputSpec> inputs() {
    return {{ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, false},
            {ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED, false},  // W float, or MatMulNBits' B uint8
            {ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, true},       // bias (float form) or scales (quantized)
            {ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED, true},   // zero_points (quantized form, uint8)
            {ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, true}};      // bias (quantized form)
  }
  static size_t output_count() { return 1; }

  KwtaBlockMatMulKernel(const OrtApi&, const OrtKernelInfo* info) : KernelBase(kOpName, info) {
    const Attributes attrs(info);
    const kernels::KernelSet& kernels = kernel_set_or_fail();
    const engine::KwtaConfig config = read_kwta_attributes(attrs, "", Schema::k_frac);
    const int64_t block = attrs.get_int("block", Schema::block);
    quantized_ = input_type(info, 1) == ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8;
    std::shared_ptr<const engine::WeightBackend> backend = quantized_ ? quant_backend(info, attrs) : dense_backend(info, attrs);
    const size_t k = backend->k();
    if (k == 0) fail("the weights have K = 0 rows: K must be >= 1");
    if (block < 1 || static_cast<size_t>(block) > k)
      fail("attribute block=", block, " must be in [1, K=", k, "]");
    if (k > static_cast<size_t>(INT32_MAX)) fail("K=", k, " is too large");
    const engine::BlockPartition partition(k, static_cast<size_t>(block));
    std::vector<float> norms;
    if (config.score == engine::KwtaScore::kL2Weighted) norms = backend->block_norms(partition);
    auto kwta = std::make_unique<engine::KwtaGate>(partition, config, std::move(norms));
    metrics_ = metrics_slot(kOpName, node(), describe_kwta);
    metrics_->set_constant(kTemp, config.temp);
    const engine::BitmapConfig bitmap = read_bitmap_config(attrs, config);
    std::unique_ptr<engine::InputGate> gate;
    if (bitmap.mode == engine::PackGateMode::kNone) {
      gate = std::move(kwta);
    } else {
      gate = std::make_unique<engine::BitmapGate>(bitmap, std::move(kwta));
      metrics_->set_constant(kPackEnabled, 1.0);
      metrics_->set_constant(kPackMode, static_cast<double>(static_cast<int>(bitmap.mode)));
      metrics_->set_constant(kPackPopcnt, static_cast<double>(static_cast<int>(kernels.popcnt_path)));
    }
    engine::GatedMatMulOptions options;
    options.max_gated_rows = config.max_gated_rows;
    options.glu = read_glu(attrs, backend->n());
    matmul_ = std::make_unique<engine::GatedMatMul>(std::move(gate), std::move(backend), options);
  }

  void Compute(OrtKernelContext* context) {
    const engine::MatMulStats run = run_matmul(context, *matmul_, quantized_ ? 4 : 2, false, quantized_ ? "bias" : "B");
    const engine::GateStats& s = run.gate;
    if (s.rows == 0) return;
    metrics_->add(kCalls, 1);
    metrics_->add(kRows, s.rows);
    if (s.bitmap_ran) {
      metrics_->add(kPackCalls, 1);
      metrics_->add(kPackActive, s.bitmap_active);
      metrics_->add(kPackBlocks, s.bitmap_blocks);
      if (s.bitmap_applied) metrics_->add(kPackApplied, 1);
    }
    metrics_->add(kBlocksTotal, s.blocks_total);
    metrics_->add(kBlocksKept, s.blocks_kept);
    if (s.gated) metrics_->add(kDutyHits, 1);
    if (run.backend.decode_calls) {
      metrics_->add(kDecodeCalls, run.backend.decode_calls);
      metrics_->add(kDecodePoolCalls, run.backend.decode_pool_calls);
    }
  }

 private:
  static std::shared_ptr<const engine::WeightBackend> dense_backend(const OrtKernelInfo* info, const Attributes& attrs) {
    const ConstantTensor w = constant_float_input(info, 1, "W", 2);
    if (attrs.get_int("accuracy_level", Schema::accuracy_level) != 0)
      fail("attribute accuracy_level=", attrs.get_int("accuracy_level", Schema::accuracy_level),
           " belongs to the quantized form (uint8 input B); a float W is multiplied in fp32");
    if (input_present(info, 3) || input_present(info, 4))
      fail("inputs zero_points / bias (#3, #4) belong to the quantized form, whose input 1 is MatMulNBits' uint8 B; "
           "with a float W the inputs are (X, W, B?)");
    return std::make_shared<const engine::DenseBackend>(
        engine::DenseWeights::pack_shared(w.data, static_cast<size_t>(w.shape[0]), static_cast<size_t>(w.shape[1])));
  }

  // MatMulNBits' B / scales / zero_points and K, N, bits, block_size, repacked once here.
  static std::shared_ptr<const engine::WeightBackend> quant_backend(const OrtKernelInfo* info, const Attributes& attrs) {
    constexpr const char* kWhy = "MatMulNBits' quantized weights, repacked once at session creation";
    engine::MatMulNBitsTensors t;
    t.k = attrs.get_int("K", Schema::K);
    t.n = attrs.get_int("N", Schema::N);
    t.bits = attrs.get_int("bits", Schema::bits);
    t.block_size = attrs.get_int("block_size", Schema::block_size);
    if (t.k < 1 || t.n < 1 || t.bits == 0 || t.block_size == 0)
      fail("the quantized form (uint8 input B) needs attributes K, N, bits and block_size as MatMulNBits has them; got K=",
           t.k, ", N=", t.n, ", bits=", t.bits, ", block_size=", t.block_size);
    const ConstantTensorAny b = constant_input(info, 1, "B", kWhy);
    t.b = static_cast<const uint8_t*>(b.data);
    t.b_shape = b.shape;
    if (!input_present(info, 2)) fail("input scales (#2) is required in the quantized form");
    const ConstantTensorAny scales = constant_input(info, 2, "scales", kWhy);
    if (scales.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT)
      fail("input scales must be float32, got ", element_type_name(scales.type));
    t.scales = static_cast<const float*>(scales.data);
    t.scales_shape = scales.shape;
    if (input_present(info, 3)) {
      const ConstantTensorAny zp = constant_input(info, 3, "zero_points", kWhy);
      if (zp.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 && zp.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT)
        fail("input zero_points must be uint8, got ", element_type_name(zp.type));
      t.zero_points = zp.data;
      t.zero_points_shape = zp.shape;
      t.zero_points_are_float = zp.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
    }
    engine::QuantTuning tuning;
    tuning.int8_decode = engine::int8_decode_for_accuracy_level(attrs.get_int("accuracy_level", Schema::accuracy_level));
    return std::make_shared<const engine::QuantBackend>(std::make_shared<const engine::QuantWeights>(t), tuning);
  }

  bool quantized_ = false;
  std::unique_ptr<engine::GatedMatMul> matmul_;
  std::shared_ptr<MetricsSlot> metrics_;
};

}  // namespace

const OrtCustomOp* kwta_block_matmul_op() {
  static const OpAdapter<KwtaBlockMatMulKernel> op;
  return &op;
}

}  // namespace ortsparse::ort
