// PopcountGroupQueryAttention: com.microsoft.GroupQueryAttention's inputs, attributes and outputs
// plus PopcountAttention's selection attributes. Reads the attributes (refusing the GQA options the
// engine does not implement: quantized KV caches, Q/K norm weights, query_seqlens, output_qk), binds
// the tensors and runs ops/attention/gqa_attention.h.
#include <memory>
#include <string>

#include "attention/gqa_attention.h"
#include "common/metrics.h"
#include "ort/attention_attributes.h"
#include "ort/matmul_io.h"
#include "ort/ops.h"

namespace ortsparse::ort {
namespace {

// Input order of com.microsoft.GroupQueryAttention (onnxruntime >= 1.21; the later inputs of newer
// releases are declared so a node carrying them gets a clear refusal instead of a schema error).
enum Input {
  kQuery, kKey, kValue, kPastKey, kPastValue, kSeqlensK, kTotalSequenceLength, kCosCache, kSinCache,
  kPositionIds, kAttentionBias, kHeadSink, kKScale, kVScale, kQNormWeight, kKNormWeight, kQuerySeqlens, kInputCount
};
using Schema = schema::PopcountGroupQueryAttention;  // names and defaults: graph_rewrite/op_schema.json
static_assert(Schema::kInputCount == kInputCount, "the Input enum and the schema's input list differ");
constexpr const auto& kInputNames = Schema::kInputNames;

// The selection defaults of this form (the schema's): the page selector with the setting measured on
// SmolLM2 (docs/ops.md; the rewriter's recommended setting, graph_rewrite/techniques/popcount.py).
attention::PopcountAttentionConfig gqa_selection_defaults() { return schema_selection_defaults<Schema>(); }

attention::GqaConfig read_config(const Attributes& attrs) {
  attention::GqaConfig c;
  c.num_heads = attrs.get_int("num_heads", Schema::num_heads);
  c.kv_num_heads = attrs.get_int("kv_num_heads", Schema::kv_num_heads);
  c.scale = attrs.get_float("scale", Schema::scale);
  if (c.scale < 0.0f) fail("attribute scale=", c.scale, " must be >= 0 (0: 1/sqrt(head_size))");
  c.softcap = attrs.get_float("softcap", Schema::softcap);
  c.local_window_size = attrs.get_int("local_window_size", Schema::local_window_size);
  c.do_rotary = read_flag(attrs, "do_rotary", Schema::do_rotary != 0);
  c.rotary_interleaved = read_flag(attrs, "rotary_interleaved", Schema::rotary_interleaved != 0);
  c.causal = read_flag(attrs, "causal", Schema::causal != 0);
  c.smooth_softmax = read_flag(attrs, "smooth_softmax", Schema::smooth_softmax != 0);
  // The refused options (qk_output, *_quant_type, kv_cache_bit_width): any value but the schema's default,
  // which is what the engine implements, is refused.
  if (const int64_t qk = attrs.get_int("qk_output", Schema::qk_output); qk != Schema::qk_output)
    fail("attribute qk_output=", qk, " is not supported (no output_qk)");
  c.sliding_window_cache = read_flag(attrs, "sliding_window_cache", Schema::sliding_window_cache != 0);
  if (const std::string q = attrs.get_string("k_quant_type", Schema::k_quant_type); q != Schema::k_quant_type)
    fail("attribute k_quant_type='", q, "' is not supported (float32 KV cache only)");
  if (const std::string q = attrs.get_string("v_quant_type", Schema::v_quant_type); q != Schema::v_quant_type)
    fail("attribute v_quant_type='", q, "' is not supported (float32 KV cache only)");
  if (const int64_t bits = attrs.get_int("kv_cache_bit_width", Schema::kv_cache_bit_width); bits != Schema::kv_cache_bit_width)
    fail("attribute kv_cache_bit_width=", bits, " is not supported (float32 KV cache only)");
  c.selection = read_selection_attributes(attrs, gqa_selection_defaults());
  c.selection.verify_keys = read_flag(attrs, "verify_keys", Schema::verify_keys != 0);
  return c;
}

template <typename T>
attention::TensorView<T> view(Ort::KernelContext& context, size_t index, ONNXTensorElementDataType type) {
  attention::TensorView<T> t;
  if (index >= context.GetInputCount()) return t;
  Ort::ConstValue value = context.GetInput(index);
  if (!value) return t;
  auto info = value.GetTensorTypeAndShapeInfo();
  if (info.GetElementType() != type)
    fail("input ", kInputNames[index], " has element type ", static_cast<int>(info.GetElementType()), ", expected ",
         static_cast<int>(type));
  t.shape = info.GetShape();
  t.data = value.GetTensorData<T>();
  t.given = true;
  return t;
}

class PopcountGroupQueryAttentionKernel : public KernelBase<PopcountGroupQueryAttentionKernel> {
 public:
  static constexpr const char* kOpName = "PopcountGroupQueryAttention";
  static std::vector<InputSpec> inputs() {
    constexpr auto kFloat = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, kInt32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32,
                   kInt64 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
    return {{kFloat, false}, {kFloat, true},  {kFloat, true}, {kFloat, true}, {kFloat, true},  {kInt32, false},
            {kInt32, false}, {kFloat, true},  {kFloat, true}, {kInt64, true}, {kFloat, true},  {kFloat, true},
            {kFloat, true},  {kFloat, true},  {kFloat, true}, {kFloat, true}, {kInt32, true}};
  }
  static size_t output_count() { return 3; }

  PopcountGroupQueryAttentionKernel(const OrtApi&, const OrtKernelInfo* info) : KernelBase(kOpName, info) {
    // Inputs this op does not implement: refused when the node wires them, at session creation.
    Ort::ConstKernelInfo kernel_info(info);
    for (size_t i = kKScale; i < kernel_info.GetInputCount() && i < kInputCount; ++i)
      if (!kernel_info.GetInputName(i).empty())
        fail("input ", i, " (", kInputNames[i], ") is not supported: leave it empty");
    const attention::GqaConfig config = read_config(Attributes(info));
    const kernels::KernelSet& kernels = kernel_set_or_fail();
    attention_ = std::make_unique<attention::GroupQueryAttention>(config, kernels);
    metrics_ = metrics_slot(kOpName, node(), describe_attention);
    metrics_->set_constant(kEnabled, config.selection.select == attention::Selector::kNone ? 0.0 : 1.0);
    metrics_->set_constant(kMode, static_cast<double>(static_cast<int>(config.selection.mode)));
    metrics_->set_constant(kPopcnt, static_cast<double>(static_cast<int>(kernels.popcnt_path)));
    metrics_->set_constant(kSelect, static_cast<double>(static_cast<int>(config.selection.select)));
  }

  void Compute(OrtKernelContext* raw_context) {
    Ort::KernelContext context(raw_context);
    constexpr auto kFloat = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, kInt32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
    attention::GqaInputs in;
    in.query = view<float>(context, kQuery, kFloat);
    in.key = view<float>(context, kKey, kFloat);
    in.value = view<float>(context, kValue, kFloat);
    in.past_key = view<float>(context, kPastKey, kFloat);
    in.past_value = view<float>(context, kPastValue, kFloat);
    in.seqlens_k = view<int32_t>(context, kSeqlensK, kInt32);
    in.total_sequence_length = view<int32_t>(context, kTotalSequenceLength, kInt32);
    in.cos_cache = view<float>(context, kCosCache, kFloat);
    in.sin_cache = view<float>(context, kSinCache, kFloat);
    in.position_ids = view<int64_t>(context, kPositionIds, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64);
    in.attention_bias = view<float>(context, kAttentionBias, kFloat);
    in.head_sink = view<float>(context, kHeadSink, kFloat);
    for (size_t i = kKScale; i < context.GetInputCount() && i < kInputCount; ++i)
      if (context.GetInput(i)) fail("input ", i, " (", kInputNames[i], ") is not supported: leave it empty");
    const attention::GqaPlan plan = attention_->plan(in);
    attention::GqaOutputs out;
    out.output = context.GetOutput(0, plan.output_shape).GetTensorMutableData<float>();
    out.present_key = context.GetOutput(1, plan.present_shape).GetTensorMutableData<float>();
    out.present_value = context.GetOutput(2, plan.present_shape).GetTensorMutableData<float>();
    count_attention(*metrics_, attention_->run(in, plan, out, OrtTaskRunner(raw_context)));
  }

 private:
  std::unique_ptr<attention::GroupQueryAttention> attention_;
  std::shared_ptr<MetricsSlot> metrics_;
};

}  // namespace

const OrtCustomOp* popcount_group_query_attention_op() {
  static const OpAdapter<PopcountGroupQueryAttentionKernel> op;
  return &op;
}

}  // namespace ortsparse::ort
