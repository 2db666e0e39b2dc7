#include "attention/gqa_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/error.h"

namespace ortsparse::attention {

namespace {

void check_dims(const char* name, const std::vector<int64_t>& shape, size_t rank, const char* layout) {
  if (shape.size() != rank) fail("input ", name, " must be ", rank, "-D ", layout, ", got shape ", shape_string(shape));
  for (int64_t v : shape)
    if (v < 0) fail("input ", name, " has a negative dimension: ", shape_string(shape));
}

PopcountAttentionConfig engine_config(const GqaConfig& c) {
  PopcountAttentionConfig e = c.selection;
  e.scale = c.scale;  // 0 is resolved per call from D, the way onnxruntime rounds it
  e.causal = c.causal;
  e.softcap = c.softcap;
  e.local_window = c.local_window_size;  // >= 0: the last W keys of the causal prefix (onnxruntime 1.32)
  e.smooth_softmax = c.smooth_softmax;
  return e;
}

}  // namespace

GroupQueryAttention::GroupQueryAttention(const GqaConfig& config, const kernels::KernelSet& kernels)
    : config_(config), kernels_(&kernels), attention_(engine_config(config), kernels) {
  if (config.num_heads <= 0) fail("attribute num_heads=", config.num_heads, " must be > 0");
  if (config.kv_num_heads <= 0) fail("attribute kv_num_heads=", config.kv_num_heads, " must be > 0");
  if (config.num_heads % config.kv_num_heads != 0)
    fail("attribute num_heads=", config.num_heads, " must be a multiple of kv_num_heads=", config.kv_num_heads);
  if (config.local_window_size < -1)
    fail("attribute local_window_size=", config.local_window_size, " must be -1 (none) or >= 0");
  if (!config.causal && config.local_window_size >= 0)
    fail("attribute local_window_size=", config.local_window_size, " needs causal=1");
  if (config.sliding_window_cache && config.local_window_size <= 0)
    fail("attribute sliding_window_cache=1 needs local_window_size > 0, got ", config.local_window_size);
}

namespace {

// Query, key, value: batch, sequence, head size, packed or not.
void plan_qkv(const GqaInputs& in, size_t h, size_t hkv, GqaPlan& p) {
  check_dims("query", in.query.shape, 3, "[batch, sequence, hidden]");
  p.b = static_cast<size_t>(in.query.shape[0]);
  p.s = static_cast<size_t>(in.query.shape[1]);
  if (p.s == 0) fail("query has sequence length 0 (shape ", shape_string(in.query.shape), ")");
  const size_t hidden = static_cast<size_t>(in.query.shape[2]);
  if (in.key.present() != in.value.present())
    fail("inputs key and value must both be given (separate Q, K, V) or both be empty (packed QKV in query)");
  p.packed = !in.key.present();
  if (p.packed) {
    const size_t width = h + 2 * hkv;
    if (hidden % width != 0 || hidden == 0)
      fail("packed QKV: query hidden size ", hidden, " is not (num_heads + 2·kv_num_heads)·head_size = ", width,
           "·D for any D > 0 (query ", shape_string(in.query.shape), ")");
    p.d = hidden / width;
  } else {
    if (hidden % h != 0 || hidden == 0)
      fail("query hidden size ", hidden, " is not num_heads=", h, " times a head size > 0 (query ",
           shape_string(in.query.shape), ")");
    p.d = hidden / h;
    check_dims("key", in.key.shape, 3, "[batch, sequence, kv_hidden]");
    check_dims("value", in.value.shape, 3, "[batch, sequence, kv_hidden]");
    const std::vector<int64_t> want{static_cast<int64_t>(p.b), static_cast<int64_t>(p.s), static_cast<int64_t>(hkv * p.d)};
    if (in.key.shape != want || in.value.shape != want)
      fail("key ", shape_string(in.key.shape), " and value ", shape_string(in.value.shape), " must be [batch, sequence, ",
           "kv_num_heads·head_size] = ", shape_string(want), " (query ", shape_string(in.query.shape), ", num_heads=", h,
           ", kv_num_heads=", hkv, ")");
  }
}

// past_key / past_value rows, seqlens_k and total_sequence_length; returns the total.
int64_t plan_lengths(const GqaInputs& in, size_t hkv, GqaPlan& p) {
  if (in.past_key.present() != in.past_value.present())
    fail("inputs past_key and past_value must both be given or both be empty");
  if (in.past_key.present()) {
    check_dims("past_key", in.past_key.shape, 4, "[batch, kv_num_heads, buffer, head_size]");
    check_dims("past_value", in.past_value.shape, 4, "[batch, kv_num_heads, buffer, head_size]");
    const std::vector<int64_t>& pk = in.past_key.shape;
    if (pk[0] != static_cast<int64_t>(p.b) || pk[1] != static_cast<int64_t>(hkv) || pk[3] != static_cast<int64_t>(p.d))
      fail("past_key ", shape_string(pk), " must be [batch=", p.b, ", kv_num_heads=", hkv, ", buffer, head_size=", p.d, "]");
    if (in.past_value.shape != pk)
      fail("past_value ", shape_string(in.past_value.shape), " must have past_key's shape ", shape_string(pk));
    p.past_rows = static_cast<size_t>(pk[2]);
  }
  if (!in.seqlens_k.present() || in.seqlens_k.shape.size() != 1 || in.seqlens_k.shape[0] != static_cast<int64_t>(p.b))
    fail("input seqlens_k must be int32 [batch] = [", p.b, "], got shape ", shape_string(in.seqlens_k.shape));
  int64_t total_count = 1;
  for (int64_t v : in.total_sequence_length.shape) total_count *= v;
  if (!in.total_sequence_length.present() || total_count != 1)
    fail("input total_sequence_length must be one int32, got shape ", shape_string(in.total_sequence_length.shape));
  const int64_t total = in.total_sequence_length.data[0];
  if (total < 1) fail("total_sequence_length=", total, " must be >= 1");
  p.present_rows = std::max(static_cast<size_t>(total), p.past_rows);
  return total;
}

// cos_cache / sin_cache with do_rotary: the rotated pairs per row; returns the cache's positions.
size_t plan_rotary(const GqaConfig& config, const GqaInputs& in, GqaPlan& p) {
  if (in.cos_cache.present() != in.sin_cache.present())
    fail("inputs cos_cache and sin_cache must both be given or both be empty");
  size_t cos_rows = 0;
  if (config.do_rotary) {
    if (!in.cos_cache.present()) fail("do_rotary=1 needs the cos_cache and sin_cache inputs");
    check_dims("cos_cache", in.cos_cache.shape, 2, "[positions, rotary_dim / 2]");
    if (in.sin_cache.shape != in.cos_cache.shape)
      fail("sin_cache ", shape_string(in.sin_cache.shape), " must have cos_cache's shape ", shape_string(in.cos_cache.shape));
    p.rotary_half = static_cast<size_t>(in.cos_cache.shape[1]);
    cos_rows = static_cast<size_t>(in.cos_cache.shape[0]);
    if (p.rotary_half == 0 || 2 * p.rotary_half > p.d)
      fail("cos_cache ", shape_string(in.cos_cache.shape), ": rotary_dim = 2·", p.rotary_half, " must be in [2, head_size=",
           p.d, "]");
  }

  return cos_rows;
}

// Per batch entry: its past rows, keys and each new row's rotary position.
void plan_positions(const GqaConfig& config, const GqaInputs& in, int64_t total, size_t cos_rows, GqaPlan& p) {
  // Phases as onnxruntime defines them: the first prompt has S == total_sequence_length (every
  // entry starts at position 0, right-padded to S); otherwise S == 1 (token) or batch 1 (a later
  // prompt chunk), and entry b's new rows start at seqlens_k[b] + 1 - S.
  p.first_prompt = p.s == static_cast<size_t>(total);
  if (!p.first_prompt && p.s > 1 && p.b != 1)
    fail("sequence length ", p.s, " != total_sequence_length=", total, " (a prompt after a past) needs batch 1, got ",
         p.b);
  const bool custom_positions = in.position_ids.present();
  if (custom_positions) {
    const std::vector<int64_t> want{static_cast<int64_t>(p.b), static_cast<int64_t>(p.s)};
    if (in.position_ids.shape != want)
      fail("input position_ids ", shape_string(in.position_ids.shape), " must be int64 [batch, sequence] = ",
           shape_string(want));
  }
  p.past.resize(p.b);
  p.keys.resize(p.b);
  p.rotary_position.resize(p.b * p.s);
  for (size_t b = 0; b < p.b; ++b) {
    const int64_t sk = in.seqlens_k.data[b];
    // A window-sized buffer holds the last rows of a longer sequence (plan_window checks it).
    if (sk < 0 || (!config.sliding_window_cache && sk >= static_cast<int64_t>(p.present_rows)))
      fail("seqlens_k[", b, "]=", sk, " is outside the KV buffer: it must be in [0, ", p.present_rows,
           ") (present rows = max(total_sequence_length=", total, ", past buffer=", p.past_rows, "))");
    if (sk + 1 > total)
      fail("total_sequence_length=", total, " is smaller than seqlens_k[", b, "] + 1 = ", sk + 1);
    const size_t keys = static_cast<size_t>(sk) + 1;
    size_t past = 0;
    if (!p.first_prompt) {
      if (keys < p.s) fail("seqlens_k[", b, "]=", sk, " is too small for ", p.s, " new rows (seqlens_k + 1 >= S)");
      past = keys - p.s;
      if (past > p.past_rows && !config.sliding_window_cache)
        fail("seqlens_k[", b, "]=", sk, " needs ", past, " past rows but past_key holds ", p.past_rows,
             p.past_rows ? "" : " (no past_key/past_value given)");
    }
    p.past[b] = past;
    p.keys[b] = keys;
    for (size_t s = 0; s < p.s; ++s) {
      // onnxruntime: the first prompt rotates row s by position_ids[0] + s, later calls by
      // position_ids[b, s]; without position_ids, by its position in the sequence.
      int64_t pos = static_cast<int64_t>(past + s);
      if (custom_positions)
        pos = p.first_prompt ? in.position_ids.data[0] + static_cast<int64_t>(s) : in.position_ids.data[b * p.s + s];
      if (config.do_rotary && (pos < 0 || pos >= static_cast<int64_t>(cos_rows)))
        fail("cos_cache/sin_cache have ", cos_rows, " positions but batch entry ", b, " rotates row ", s,
             " by position ", pos, custom_positions ? " (from position_ids)" : "");
      p.rotary_position[b * p.s + s] = static_cast<size_t>(std::max<int64_t>(pos, 0));
    }
  }
}

// The optional attention_bias and head_sink inputs' shapes.
void check_bias_and_sink(const GqaInputs& in, size_t h, int64_t total, GqaPlan& p) {
  if (in.attention_bias.present()) {
    check_dims("attention_bias", in.attention_bias.shape, 4, "[batch | 1, num_heads | 1, sequence, total_sequence_length]");
    const std::vector<int64_t>& a = in.attention_bias.shape;
    if ((a[0] != 1 && a[0] != static_cast<int64_t>(p.b)) || (a[1] != 1 && a[1] != static_cast<int64_t>(h)) ||
        a[2] != static_cast<int64_t>(p.s) || a[3] != total)
      fail("attention_bias ", shape_string(a), " must be [batch=", p.b, " or 1, num_heads=", h, " or 1, sequence=", p.s,
           ", total_sequence_length=", total, "]");
  }
  if (in.head_sink.present() && (in.head_sink.shape.size() != 1 || in.head_sink.shape[0] != static_cast<int64_t>(h)))
    fail("input head_sink ", shape_string(in.head_sink.shape), " must be [num_heads] = [", h, "]");
}

}  // namespace

GqaPlan GroupQueryAttention::plan(const GqaInputs& in) const {
  GqaPlan p;
  const size_t h = static_cast<size_t>(config_.num_heads), hkv = static_cast<size_t>(config_.kv_num_heads);
  p.h = h;
  p.hkv = hkv;
  plan_qkv(in, h, hkv, p);
  const int64_t total = plan_lengths(in, hkv, p);
  const size_t cos_rows = plan_rotary(config_, in, p);
  plan_positions(config_, in, total, cos_rows, p);
  check_bias_and_sink(in, h, total, p);
  if (config_.sliding_window_cache) plan_window(in, p);
  p.output_shape = {static_cast<int64_t>(p.b), static_cast<int64_t>(p.s), static_cast<int64_t>(h * p.d)};
  p.present_shape = {static_cast<int64_t>(p.b), static_cast<int64_t>(hkv), static_cast<int64_t>(p.present_rows),
                     static_cast<int64_t>(p.d)};
  return p;
}

AttentionStats GroupQueryAttention::run(const GqaInputs& in, const GqaPlan& p, const GqaOutputs& out,
                                        const TaskRunner& runner) const {
  if (p.windowed) return run_windowed(in, p, out, runner);
  const size_t B = p.b, S = p.s, H = p.h, Hkv = p.hkv, D = p.d, R = p.present_rows, P = p.past_rows;
  if (B * S * H * D == 0 && B * Hkv * R * D == 0) return AttentionStats{};
  const bool shared_k = in.past_key.present() && out.present_key == in.past_key.data;
  const bool shared_v = in.past_value.present() && out.present_value == in.past_value.data;
  if ((shared_k || shared_v) && P != R)
    fail("present_key/present_value share past's memory but have ", R, " rows per head against past's ", P,
         " (a shared buffer must have one shape)");
  // A present buffer that overlaps past without being it would be read while written.
  auto overlaps = [](const float* a, size_t na, const float* b, size_t nb) { return a < b + nb && b < a + na; };
  const size_t kv_count = B * Hkv * R * D, past_count = B * Hkv * P * D;
  if (in.past_key.present() && !shared_k && overlaps(out.present_key, kv_count, in.past_key.data, past_count))
    fail("present_key overlaps past_key without being the same buffer");
  if (in.past_value.present() && !shared_v && overlaps(out.present_value, kv_count, in.past_value.data, past_count))
    fail("present_value overlaps past_value without being the same buffer");

  // Where the new K/V rows and the queries are in the inputs: row (b, head, s).
  const size_t width = p.packed ? (H + 2 * Hkv) * D : H * D;
  const RowStrides q_in{S * width, D, width};
  const float* k_src = p.packed ? in.query.data + H * D : in.key.data;
  const float* v_src = p.packed ? in.query.data + (H + Hkv) * D : in.value.data;
  const RowStrides kv_in = p.packed ? q_in : RowStrides{S * Hkv * D, D, Hkv * D};
  const RowStrides present{Hkv * R * D, R * D, D};
  const kernels::AttentionKernels& attn = *kernels_->attention;
  const size_t half = config_.do_rotary ? p.rotary_half : 0;
  const bool interleaved = config_.rotary_interleaved;
  const float* cos = in.cos_cache.data;
  const float* sin = in.sin_cache.data;
  // Row x at position pos -> out: the first 2·half entries rotated, the rest copied.
  auto place = [&](const float* x, size_t pos, float* dst) {
    if (half == 0) {
      std::memcpy(dst, x, D * sizeof(float));
      return;
    }
    attn.rotate(x, cos + pos * half, sin + pos * half, half, interleaved ? 1 : 0, dst);
    std::memcpy(dst + 2 * half, x + 2 * half, (D - 2 * half) * sizeof(float));
  };

  // Present K and V: one task per (b, kv head).
  runner.run(B * Hkv, [&](size_t task) {
    const size_t b = task / Hkv, j = task % Hkv, past = p.past[b];
    float* kd = out.present_key + present.at(b, j, 0);
    float* vd = out.present_value + present.at(b, j, 0);
    if (!shared_k) {
      if (past) std::memcpy(kd, in.past_key.data + (b * Hkv + j) * P * D, past * D * sizeof(float));
      std::fill(kd + (past + S) * D, kd + R * D, 0.0f);
    }
    if (!shared_v) {
      if (past) std::memcpy(vd, in.past_value.data + (b * Hkv + j) * P * D, past * D * sizeof(float));
      std::fill(vd + (past + S) * D, vd + R * D, 0.0f);
    }
    for (size_t s = 0; s < S; ++s) {
      place(k_src + kv_in.at(b, j, s), p.rotary_position[b * S + s], kd + (past + s) * D);
      std::memcpy(vd + (past + s) * D, v_src + kv_in.at(b, j, s), D * sizeof(float));
    }
  });

  // Queries: rotated into a scratch copy [B, S, H, D] (one task per (b, s)), or read in place.
  std::vector<float> q_rotated;
  const float* q = in.query.data;
  RowStrides q_rows = q_in;
  if (half > 0) {
    q_rotated.resize(B * S * H * D);
    q_rows = RowStrides{S * H * D, D, H * D};
    float* qr = q_rotated.data();
    runner.run(B * S, [&, qr](size_t task) {
      const size_t b = task / S, s = task % S;
      for (size_t hh = 0; hh < H; ++hh) place(q + q_in.at(b, hh, s), p.rotary_position[b * S + s], qr + q_rows.at(b, hh, s));
    });
    q = q_rotated.data();
  }

  AttentionCall call;
  call.dims = AttentionDims{B, H, Hkv, S, R, D, D};
  call.q = q;
  call.k = out.present_key;
  call.v = out.present_value;
  call.y = out.output;
  call.q_rows = q_rows;
  call.k_rows = present;
  call.v_rows = present;
  call.y_rows = RowStrides{S * H * D, D, H * D};
  call.kv_len = p.keys;
  call.q_pos0.assign(p.past.begin(), p.past.end());
  if (in.attention_bias.present()) {
    const std::vector<int64_t>& a = in.attention_bias.shape;
    const size_t T = static_cast<size_t>(a[3]);
    call.mask.add = in.attention_bias.data;
    call.mask.stride[0] = a[0] == 1 ? 0 : static_cast<size_t>(a[1]) * S * T;
    call.mask.stride[1] = a[1] == 1 ? 0 : S * T;
    call.mask.stride[2] = T;
    call.mask.stride[3] = 1;
  }
  call.head_sink = in.head_sink.present() ? in.head_sink.data : nullptr;

  KeyProvenance provenance;
  provenance.previous = shared_k ? static_cast<const void*>(out.present_key) : in.past_key.data;
  provenance.previous_rows = shared_k ? R : P;
  provenance.current = out.present_key;
  provenance.current_rows = R;
  provenance.unchanged = p.unchanged.empty() ? p.past : p.unchanged;
  if (config_.scale > 0.0f || D == 0) return attention_.run(call, runner, &provenance);
  // scale 0: onnxruntime's 1/sqrt(D) in float; the engine takes it per call.
  return attention_.run(call, runner, &provenance, 1.0f / std::sqrt(static_cast<float>(D)));
}

}  // namespace ortsparse::attention
