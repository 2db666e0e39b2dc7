// Generated from graph_rewrite/op_schema.json by graph_rewrite/op_schema.py; do not edit.
// Regenerate: python scripts/op_schema_header.py
#pragma once

#include <cstdint>

namespace ortsparse::ort::schema {

struct KwtaBlockMatMul {
  static constexpr float k_frac = 0x1.0000000000000p-1f /* 0.5 */;  // settings
  static constexpr int64_t k_abs = 0;  // settings
  static constexpr const char* score = "l2";  // settings
  static constexpr float threshold = 0x0.0p+0f /* 0.0 */;  // settings
  static constexpr float temp = 0x1.0000000000000p+0f /* 1.0 */;  // settings
  static constexpr int64_t duty = 1;  // settings
  static constexpr const char* duty_mode = "dense";  // settings
  static constexpr int64_t renorm = 0;  // settings
  static constexpr int64_t block = 1;  // settings
  static constexpr int64_t max_gated_rows = 0;  // settings
  static constexpr const char* pack_mode = "none";  // settings
  static constexpr float pack_eps = 0x0.0p+0f /* 0.0 */;  // settings
  static constexpr float pack_density_max = 0x1.3333340000000p-3f /* 0.15 */;  // settings
  static constexpr const char* glu = "none";  // from_graph
  static constexpr int64_t K = 0;  // from_graph
  static constexpr int64_t N = 0;  // from_graph
  static constexpr int64_t bits = 0;  // from_graph
  static constexpr int64_t block_size = 0;  // from_graph
  static constexpr int64_t accuracy_level = 0;  // from_graph
};

struct ProcSparseMatMul {
  static constexpr int64_t block = 32;  // settings
  static constexpr int64_t seed = 0;  // settings
  static constexpr float base_scale = 0x0.0p+0f /* 0.0 */;  // settings
  static constexpr float kwta_k_frac = 0x1.0000000000000p+0f /* 1.0 */;  // settings
  static constexpr int64_t kwta_k_abs = 0;  // settings
  static constexpr const char* kwta_score = "l2";  // settings
  static constexpr float kwta_threshold = 0x0.0p+0f /* 0.0 */;  // settings
  static constexpr float kwta_temp = 0x1.0000000000000p+0f /* 1.0 */;  // settings
  static constexpr int64_t kwta_duty = 1;  // settings
  static constexpr const char* kwta_duty_mode = "dense";  // settings
  static constexpr int64_t kwta_renorm = 0;  // settings
  // kwta_block: int, settings; absent: the value of block
  static constexpr int64_t kwta_max_gated_rows = 0;  // settings
  static constexpr int64_t K = 0;  // from_graph
  static constexpr int64_t N = 0;  // from_graph
  static constexpr int64_t fanout = -1;  // built
};

struct TTMatMul {
  static constexpr int64_t nan_guard = 1;  // settings
  static constexpr int64_t order = -1;  // settings
  // in_modes: ints, built; absent: the node is refused
  // out_modes: ints, built; absent: the node is refused
  // ranks: ints, built; absent: the node is refused
  static constexpr float gap = -0x1.0000000000000p+0f /* -1.0 */;  // built
};

struct EventDrivenMatMul {
  static constexpr const char* axis = "sequence";  // settings
  static constexpr float topk = 0x1.99999a0000000p-2f /* 0.4 */;  // settings
  static constexpr float delta_theta = 0x1.47ae140000000p-7f /* 0.01 */;  // settings
  static constexpr float stale_beta = 0x1.0000000000000p+0f /* 1.0 */;  // settings
  static constexpr float stale_lambda = 0x0.0p+0f /* 0.0 */;  // settings
  static constexpr int64_t age_max = 0;  // settings
  static constexpr float budget_ms = 0x0.0p+0f /* 0.0 */;  // settings
  static constexpr float quorum = 0x1.3333340000000p-1f /* 0.6 */;  // settings
  static constexpr int64_t gap_every = 64;  // settings
  static constexpr float gap_tol = 0x1.eb851e0000000p-6f /* 0.03 */;  // settings
  static constexpr float kwta_k = 0x0.0p+0f /* 0.0 */;  // settings
  static constexpr int64_t block = 1;  // settings
  static constexpr int64_t max_gated_rows = 0;  // settings
};

struct PopcountAttention {
  static constexpr const char* mode = "sign";  // settings
  static constexpr const char* select = "popcount";  // settings
  static constexpr int64_t topk = 256;  // settings
  static constexpr int64_t min_keys = 1024;  // settings
  static constexpr float eps = 0x1.a36e2e0000000p-14f /* 0.0001 */;  // settings
  static constexpr float density_max = 0x1.3333340000000p-3f /* 0.15 */;  // settings
  static constexpr float candidates = 0x1.0000000000000p+0f /* 1.0 */;  // settings
  static constexpr int64_t keep_first = 0;  // settings
  static constexpr int64_t keep_recent = 0;  // settings
  static constexpr int64_t pack_cache = 1;  // settings
  static constexpr int64_t center = 1;  // settings
  static constexpr int64_t proj_bits = 0;  // settings
  static constexpr int64_t page_size = 16;  // settings
  static constexpr float mass_eps = 0x0.0p+0f /* 0.0 */;  // settings
  static constexpr int64_t prefill_rows = 16;  // settings
  static constexpr const char* prefill_select = "exact";  // settings
  static constexpr float prefill_eps = 0x1.0624de0000000p-10f /* 0.001 */;  // settings
  static constexpr int64_t prefill_budget = 1024;  // settings
  static constexpr int64_t event = 0;  // settings
  static constexpr float event_topk = 0x1.0000000000000p+0f /* 1.0 */;  // settings
  static constexpr int64_t event_age_max = 8;  // settings
  static constexpr int64_t event_gap_every = 64;  // settings
  static constexpr float event_gap_tol = 0x1.eb851e0000000p-6f /* 0.03 */;  // settings
  static constexpr int64_t reuse_rows = 0;  // settings
  static constexpr float reuse_tol = 0x0.0p+0f /* 0.0 */;  // settings
  static constexpr float scale = 0x0.0p+0f /* 0.0 */;  // from_graph
  static constexpr int64_t is_causal = 0;  // from_graph
};

struct PopcountGroupQueryAttention {
  static constexpr const char* mode = "sign";  // settings
  static constexpr const char* select = "pages";  // settings
  static constexpr int64_t topk = 256;  // settings
  static constexpr int64_t min_keys = 2048;  // settings
  static constexpr float eps = 0x1.a36e2e0000000p-14f /* 0.0001 */;  // settings
  static constexpr float density_max = 0x1.3333340000000p-3f /* 0.15 */;  // settings
  static constexpr float candidates = 0x1.8000000000000p+1f /* 3.0 */;  // settings
  static constexpr int64_t keep_first = 4;  // settings
  static constexpr int64_t keep_recent = 256;  // settings
  static constexpr int64_t pack_cache = 1;  // settings
  static constexpr int64_t center = 1;  // settings
  static constexpr int64_t proj_bits = 0;  // settings
  static constexpr int64_t page_size = 16;  // settings
  static constexpr float mass_eps = 0x0.0p+0f /* 0.0 */;  // settings
  static constexpr int64_t prefill_rows = 16;  // settings
  static constexpr const char* prefill_select = "exact";  // settings
  static constexpr float prefill_eps = 0x1.0624de0000000p-10f /* 0.001 */;  // settings
  static constexpr int64_t prefill_budget = 1024;  // settings
  static constexpr int64_t verify_keys = 0;  // settings
  static constexpr int64_t event = 0;  // settings
  static constexpr float event_topk = 0x1.0000000000000p+0f /* 1.0 */;  // settings
  static constexpr int64_t event_age_max = 8;  // settings
  static constexpr int64_t event_gap_every = 64;  // settings
  static constexpr float event_gap_tol = 0x1.eb851e0000000p-6f /* 0.03 */;  // settings
  static constexpr int64_t num_heads = 0;  // from_graph
  static constexpr int64_t kv_num_heads = 0;  // from_graph
  static constexpr float scale = 0x0.0p+0f /* 0.0 */;  // from_graph
  static constexpr float softcap = 0x0.0p+0f /* 0.0 */;  // from_graph
  static constexpr int64_t local_window_size = -1;  // from_graph
  static constexpr int64_t do_rotary = 0;  // from_graph
  static constexpr int64_t rotary_interleaved = 0;  // from_graph
  static constexpr int64_t causal = 1;  // from_graph
  static constexpr int64_t smooth_softmax = 0;  // from_graph
  static constexpr int64_t sliding_window_cache = 0;  // from_graph
  static constexpr int64_t qk_output = 0;  // refused
  static constexpr const char* k_quant_type = "NONE";  // refused
  static constexpr const char* v_quant_type = "NONE";  // refused
  static constexpr int64_t kv_cache_bit_width = 0;  // refused
  static constexpr int kInputCount = 17;
  static constexpr const char* kInputNames[kInputCount] = {"query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length", "cos_cache", "sin_cache", "position_ids", "attention_bias", "head_sink", "k_scale", "v_scale", "q_norm_weight", "k_norm_weight", "query_seqlens"};
};

}  // namespace ortsparse::ort::schema
