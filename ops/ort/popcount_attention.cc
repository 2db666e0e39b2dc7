// PopcountAttention(Q, K, V, attn_mask?) -> Y: validates shapes and the mask's broadcast, then
// runs the attention engine (ops/attention/popcount_attention.h), or with reuse_rows = 1 the
// re-encoding mode (ops/attention/reencode.h) when the call is exact attention.
#include <cmath>
#include <memory>

#include "attention/popcount_attention.h"
#include "attention/reencode.h"
#include "common/metrics.h"
#include "ort/attention_attributes.h"
#include "ort/matmul_io.h"
#include "ort/ops.h"

namespace ortsparse::ort {
namespace {

attention::PopcountAttentionConfig read_config(const Attributes& attrs) {
  attention::PopcountAttentionConfig c =
      read_selection_attributes(attrs, schema_selection_defaults<schema::PopcountAttention>());
  c.scale = attrs.get_float("scale", schema::PopcountAttention::scale);
  const int64_t causal = attrs.get_int("is_causal", schema::PopcountAttention::is_causal);
  if (causal != 0 && causal != 1) fail("attribute is_causal=", causal, " must be 0 or 1");
  c.causal = causal == 1;
  return c;
}

// Counters of the re-encoding mode (reuse_rows = 1): a slot of their own, "PopcountAttention.reencode".
enum ReencodeCounter { kReCalls, kReApplied, kReBusy, kReResets, kReRowsReused, kReRowsCorrected, kReRowsRecomputed,
                       kReKeysAttended, kReKeysScored };

std::vector<std::pair<std::string, double>> describe_reencode(const uint64_t* c, const double*) {
  const uint64_t rows = c[kReRowsReused] + c[kReRowsCorrected] + c[kReRowsRecomputed];
  auto ratio = [](uint64_t a, uint64_t b) { return b ? static_cast<double>(a) / static_cast<double>(b) : 0.0; };
  return {
      {"calls", static_cast<double>(c[kReCalls])},
      {"calls_applied", static_cast<double>(c[kReApplied])},
      {"calls_busy", static_cast<double>(c[kReBusy])},
      {"resets", static_cast<double>(c[kReResets])},
      {"rows_reused", static_cast<double>(c[kReRowsReused])},
      {"rows_corrected", static_cast<double>(c[kReRowsCorrected])},
      {"rows_recomputed", static_cast<double>(c[kReRowsRecomputed])},
      {"reused_ratio", ratio(c[kReRowsReused], rows)},
      {"keys_scored_ratio", ratio(c[kReKeysScored], c[kReKeysAttended])},
  };
}

struct Tensor4 {
  const float* data = nullptr;
  std::vector<int64_t> shape;
};

Tensor4 float_input4(Ort::KernelContext& context, size_t index, const char* name, const char* dims) {
  Ort::ConstValue value = context.GetInput(index);
  auto info = value.GetTensorTypeAndShapeInfo();
  if (info.GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT)
    fail("input ", name, " must be float32, got ", element_type_name(info.GetElementType()));
  Tensor4 t;
  t.shape = info.GetShape();
  if (t.shape.size() != 4) fail("input ", name, " must be 4-D ", dims, ", got shape ", shape_string(t.shape));
  t.data = value.GetTensorData<float>();
  return t;
}

class PopcountAttentionKernel : public KernelBase<PopcountAttentionKernel> {
 public:
  static constexpr const char* kOpName = "PopcountAttention";
  static std::vector<InputSpec> inputs() {
    return {{ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, false},
            {ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, false},
            {ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, false},
            {ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED, true}};  // bool or float
  }
  static size_t output_count() { return 1; }

  PopcountAttentionKernel(const OrtApi&, const OrtKernelInfo* info) : KernelBase(kOpName, info) {
    const attention::PopcountAttentionConfig config = read_config(Attributes(info));
    const kernels::KernelSet& kernels = kernel_set_or_fail();
    attention_ = std::make_unique<attention::PopcountAttention>(config, kernels);
    metrics_ = metrics_slot(kOpName, node(), describe_attention);
    metrics_->set_constant(kEnabled, config.select == attention::Selector::kNone ? 0.0 : 1.0);
    metrics_->set_constant(kMode, static_cast<double>(static_cast<int>(config.mode)));
    metrics_->set_constant(kPopcnt, static_cast<double>(static_cast<int>(kernels.popcnt_path)));
    metrics_->set_constant(kSelect, static_cast<double>(static_cast<int>(config.select)));
    const int64_t reuse_rows = Attributes(info).get_int("reuse_rows", schema::PopcountAttention::reuse_rows);
    if (reuse_rows != 0 && reuse_rows != 1) fail("attribute reuse_rows=", reuse_rows, " must be 0 or 1");
    reuse_tol_ = Attributes(info).get_float("reuse_tol", schema::PopcountAttention::reuse_tol);
    if (!(reuse_tol_ >= 0.0f) || !std::isfinite(reuse_tol_))
      fail("attribute reuse_tol=", reuse_tol_, " must be a finite number >= 0 (0: rows reused only when bit-identical)");
    if (reuse_rows == 1) {
      reencoder_ = std::make_unique<attention::Reencoder>();
      reencode_metrics_ = metrics_slot(std::string(kOpName) + ".reencode", node(), describe_reencode);
    }
  }

  void Compute(OrtKernelContext* raw_context) {
    Ort::KernelContext context(raw_context);
    const Tensor4 q = float_input4(context, 0, "Q", "[B, H, Sq, D]");
    const Tensor4 k = float_input4(context, 1, "K", "[B, Hkv, Skv, D]");
    const Tensor4 v = float_input4(context, 2, "V", "[B, Hkv, Skv, Dv]");
    for (const Tensor4* t : {&q, &k, &v})
      for (int64_t d : t->shape)
        if (d < 0) fail("negative dimension in ", shape_string(t->shape));
    const std::string shapes = " (Q " + shape_string(q.shape) + ", K " + shape_string(k.shape) + ", V " + shape_string(v.shape) + ")";
    if (k.shape[0] != q.shape[0] || v.shape[0] != q.shape[0]) fail("batch sizes differ", shapes);
    if (k.shape[3] != q.shape[3]) fail("head dims of Q and K differ", shapes);
    if (v.shape[1] != k.shape[1] || v.shape[2] != k.shape[2]) fail("K and V must have the same [B, Hkv, Skv]", shapes);
    if (k.shape[1] == 0 && q.shape[1] != 0) fail("K has 0 heads but Q has ", q.shape[1], shapes);
    if (k.shape[1] > 0 && q.shape[1] % k.shape[1] != 0)
      fail("Q heads H=", q.shape[1], " must be a multiple of K/V heads Hkv=", k.shape[1], " (GQA)", shapes);
    attention::AttentionCall call;
    attention::AttentionDims& dims = call.dims;
    dims.b = static_cast<size_t>(q.shape[0]);
    dims.h = static_cast<size_t>(q.shape[1]);
    dims.hkv = static_cast<size_t>(k.shape[1]);
    dims.sq = static_cast<size_t>(q.shape[2]);
    dims.skv = static_cast<size_t>(k.shape[2]);
    dims.d = static_cast<size_t>(q.shape[3]);
    dims.dv = static_cast<size_t>(v.shape[3]);
    const std::vector<int64_t> full{q.shape[0], q.shape[1], q.shape[2], k.shape[2]};

    attention::MaskView& mask = call.mask;
    size_t mask_elements = 0;
    if (context.GetInputCount() > 3) {
      Ort::ConstValue m = context.GetInput(3);
      if (m) {
        auto info = m.GetTensorTypeAndShapeInfo();
        const auto type = info.GetElementType();
        if (type == ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL) {
          mask.keep = reinterpret_cast<const uint8_t*>(m.GetTensorData<bool>());
        } else if (type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) {
          mask.add = m.GetTensorData<float>();
        } else {
          fail("input attn_mask must be bool or float32, got ", element_type_name(type));
        }
        const std::vector<int64_t> ms = info.GetShape();
        if (ms.empty() || ms.size() > 4)
          fail("input attn_mask has shape ", shape_string(ms), ": rank must be 1..4, broadcastable to [B, H, Sq, Skv] = ",
               shape_string(full));
        // numpy broadcasting, dims aligned right; a dim of 1 is broadcast (stride 0).
        size_t stride = 1;
        for (size_t a = 0; a < ms.size(); ++a) {
          const size_t md = ms.size() - 1 - a, fd = 3 - a;
          if (ms[md] != 1 && ms[md] != full[fd])
            fail("input attn_mask has shape ", shape_string(ms), ", not broadcastable to [B, H, Sq, Skv] = ",
                 shape_string(full), " (dim ", md, ")");
          mask.stride[fd] = ms[md] == 1 ? 0 : stride;
          stride *= static_cast<size_t>(ms[md]);
        }
        mask_elements = stride;
      }
    }
    Ort::UnownedValue out = context.GetOutput(0, std::vector<int64_t>{q.shape[0], q.shape[1], q.shape[2], v.shape[3]});
    float* y = out.GetTensorMutableData<float>();
    const size_t y_count = dims.b * dims.h * dims.sq * dims.dv;
    if (y_count == 0) return;
    if (dims.hkv == 0 || dims.skv == 0) {  // no key at all: every query is fully masked
      std::fill(y, y + y_count, 0.0f);
      return;
    }
    call.q = q.data;
    call.k = k.data;
    call.v = v.data;
    call.y = y;
    call.q_rows = attention::contiguous_bhsd(dims.h, dims.sq, dims.d);
    call.k_rows = attention::contiguous_bhsd(dims.hkv, dims.skv, dims.d);
    call.v_rows = attention::contiguous_bhsd(dims.hkv, dims.skv, dims.dv);
    call.y_rows = attention::contiguous_bhsd(dims.h, dims.sq, dims.dv);
    const OrtTaskRunner runner(raw_context);
    if (reencoder_ && attention::reencode_applies(attention_->config(), dims.skv) && reencode(call, mask_elements, runner))
      return;
    count_attention(*metrics_, attention_->run(call, runner));
  }

 private:
  // The re-encoding mode on an exact call; false: the caller computes the call in full.
  bool reencode(const attention::AttentionCall& call, size_t mask_elements, const TaskRunner& runner) {
    const attention::PopcountAttentionConfig& config = attention_->config();
    attention::ReencodeParams params;
    params.scale = config.scale > 0.0f ? config.scale : static_cast<float>(1.0 / std::sqrt(static_cast<double>(call.dims.d)));
    params.causal = config.causal;
    params.mask_elements = mask_elements;
    params.tol = reuse_tol_;
    const attention::ReencodeStats rs = reencoder_->run(call, params, attention_->kernels(), runner);
    MetricsSlot& slot = *reencode_metrics_;
    slot.add(kReCalls, 1);
    slot.add(kReBusy, rs.busy ? 1 : 0);
    slot.add(kReResets, rs.reset ? 1 : 0);
    if (!rs.applied) return false;
    slot.add(kReApplied, 1);
    slot.add(kReRowsReused, rs.rows_reused);
    slot.add(kReRowsCorrected, rs.rows_corrected);
    slot.add(kReRowsRecomputed, rs.rows_recomputed);
    slot.add(kReKeysAttended, rs.keys_attended);
    slot.add(kReKeysScored, rs.keys_scored);
    attention::AttentionStats stats;
    stats.keys_total = rs.keys_attended;
    stats.keys_exact = rs.keys_scored;
    count_attention(*metrics_, stats);
    return true;
  }

  std::unique_ptr<attention::PopcountAttention> attention_;
  std::shared_ptr<MetricsSlot> metrics_;
  std::unique_ptr<attention::Reencoder> reencoder_;  // reuse_rows = 1
  std::shared_ptr<MetricsSlot> reencode_metrics_;
  float reuse_tol_ = 0.0f;
};

}  // namespace

const OrtCustomOp* popcount_attention_op() {
  static const OpAdapter<PopcountAttentionKernel> op;
  return &op;
}

}  // namespace ortsparse::ort
