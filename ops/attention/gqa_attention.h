// PopcountAttention in the GroupQueryAttention form: com.microsoft.GroupQueryAttention's inputs and
// outputs (query [B, S, H·D] or packed QKV [B, S, (H + 2·Hkv)·D], past/present K and V
// [B, Hkv, S_buf, D], seqlens_k, total_sequence_length, cos/sin caches) on the PopcountAttention
// engine. This layer validates a call's shapes and lengths (every row it touches is inside its
// buffer), applies rotary embedding to Q and the new K rows, writes the new rows into present K/V
// (only those rows when present shares past's buffer; past copied and the rest zeroed otherwise, as
// onnxruntime does), and runs the engine over the strided rows with per-batch key counts. It also
// tells the key cache which rows are unchanged since the previous call (KeyProvenance).
// See docs/ops.md#popcountgroupqueryattention.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "attention/popcount_attention.h"
#include "common/task_runner.h"
#include "kernels/kernel_set.h"

namespace ortsparse::attention {

struct GqaConfig {
  int64_t num_heads = 0, kv_num_heads = 0;
  float scale = 0.0f;              // 0: 1/sqrt(D) (computed in float, as onnxruntime does)
  float softcap = 0.0f;            // > 0: scores = softcap · tanh(scores / softcap)
  int64_t local_window_size = -1;  // >= 0: query at position p attends keys (p - W, p] (W keys; 0: none)
  bool do_rotary = false, rotary_interleaved = false;
  bool causal = true;
  bool smooth_softmax = false;     // an extra logit 0 (or head_sink[h]) in every softmax
  // Window-sized KV buffers (onnxruntime's sliding_window_cache=1, gqa_window.cc): past/present
  // hold the most recent positions of each entry at rows [0, L(T)), compacted G = C - W + 1 rows
  // at a time (C the buffer's rows, W local_window_size).
  bool sliding_window_cache = false;
  PopcountAttentionConfig selection;  // select, topk, ...; its scale / causal / softcap / window are set from the above
};

// A tensor as the adapter sees it: given (an optional input may be absent), data and shape.
template <typename T>
struct TensorView {
  const T* data = nullptr;
  std::vector<int64_t> shape;
  bool given = false;
  bool present() const { return given; }
};

// One call's inputs, in the op's input order.
struct GqaInputs {
  TensorView<float> query, key, value, past_key, past_value;
  TensorView<int32_t> seqlens_k, total_sequence_length;
  TensorView<float> cos_cache, sin_cache;
  TensorView<int64_t> position_ids;  // [B, S]: rotary positions (first prompt: position_ids[0] + s)
  TensorView<float> attention_bias;  // [B | 1, H | 1, S, total_sequence_length], added to the scores
  TensorView<float> head_sink;       // [H]: the sink logit of each head's softmax
};

// What a call does, worked out (and bounds-checked) from its inputs.
struct GqaPlan {
  size_t b = 0, s = 0, h = 0, hkv = 0, d = 0;
  bool packed = false;       // K and V inside query
  size_t past_rows = 0;      // rows per head of past_key / past_value (0 without them)
  size_t present_rows = 0;   // rows per head of present_key / present_value
  size_t rotary_half = 0;    // cos/sin columns: pairs rotated per row (0: no rotary)
  bool first_prompt = false; // S == total_sequence_length: every batch entry starts at position 0
  std::vector<size_t> past;  // per batch entry: keys before this call's rows (their first position)
  std::vector<size_t> keys;  // per batch entry: keys attended, seqlens_k + 1
  std::vector<size_t> rotary_position;  // per (b, s): the position row s of entry b is rotated by
  std::vector<int64_t> output_shape, present_shape;
  // Per batch entry: leading K rows unchanged since the previous call (the key cache's provenance);
  // empty: `past`.
  std::vector<size_t> unchanged;
  // sliding_window_cache = 1 (gqa_window.cc): rows resident before / after the call per entry, and
  // whether the call runs on a staging copy (a step that evicts rows its own queries still read).
  bool windowed = false, staged = false;
  std::vector<size_t> resident_before, resident_after;
};

// Rows of a window-sized KV buffer of `capacity` rows resident after `total` positions with a
// window of `window` keys: total up to capacity, then evicted capacity - window + 1 rows at a time
// (onnxruntime's layout, so a buffer passes between its op and this one).
size_t window_resident_rows(size_t total, size_t capacity, size_t window);

struct GqaOutputs {
  float* output = nullptr;
  float* present_key = nullptr;
  float* present_value = nullptr;
};

class GroupQueryAttention {
 public:
  // Throws Error on invalid attributes.
  GroupQueryAttention(const GqaConfig& config, const kernels::KernelSet& kernels);

  const GqaConfig& config() const { return config_; }

  // Validates the inputs (throws Error naming the input and the values) and plans the call.
  GqaPlan plan(const GqaInputs& in) const;

  // Rotary, present K/V, attention. outputs: buffers of plan.output_shape / plan.present_shape;
  // present_key (present_value) may be past_key's (past_value's) buffer: then only the new rows
  // are written.
  AttentionStats run(const GqaInputs& in, const GqaPlan& plan, const GqaOutputs& out, const TaskRunner& runner) const;

 private:
  // sliding_window_cache = 1 (gqa_window.cc): the window checks and row counts of a plan, and a
  // call run as an ordinary one over compacted (or staged) rows.
  void plan_window(const GqaInputs& in, GqaPlan& p) const;
  AttentionStats run_windowed(const GqaInputs& in, const GqaPlan& p, const GqaOutputs& out,
                              const TaskRunner& runner) const;

  GqaConfig config_;
  const kernels::KernelSet* kernels_;
  PopcountAttention attention_;
};

}  // namespace ortsparse::attention
