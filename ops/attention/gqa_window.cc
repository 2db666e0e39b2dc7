// GroupQueryAttention with window-sized KV buffers (sliding_window_cache = 1), in onnxruntime's
// layout so a buffer passes between its op and this one: for a buffer of C rows per head and a
// window of W keys, rows [0, L(T)) of batch entry b hold its L(T) most recent positions
// T - L(T) .. T - 1 (T = seqlens_k[b] + 1), where L(T) = T up to C and past C the buffer drops
// G = C - W + 1 rows at once, so L sawtooths in [W, C] and a decode step moves memory once every G
// steps. A call runs as an ordinary one in buffer-relative rows (causal and window masks depend only
// on query-key distances; rotary keeps the absolute positions):
// - no row evicted, or evicted rows that no query of the call reads (every decode step): the kept
//   rows move to the front of present and the new rows are appended after them;
// - otherwise (a prompt step longer than the slack above the window): the call runs on a staging
//   copy of the resident and the new rows, and the last L(T) of them are written back.
#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "attention/gqa_attention.h"
#include "common/error.h"

namespace ortsparse::attention {

size_t window_resident_rows(size_t total, size_t capacity, size_t window) {
  if (total <= capacity) return total;
  const size_t evict_block = capacity - window + 1;
  return total - evict_block * ((total - capacity + evict_block - 1) / evict_block);
}

void GroupQueryAttention::plan_window(const GqaInputs& in, GqaPlan& p) const {
  const size_t window = static_cast<size_t>(config_.local_window_size), capacity = p.past_rows;
  if (!in.past_key.present())
    fail("sliding_window_cache=1 needs the past_key / past_value inputs (buffers of at least local_window_size=",
         window, " rows per head)");
  if (capacity < window)
    fail("sliding_window_cache=1: past_key holds ", capacity, " rows per head, fewer than local_window_size=", window);
  p.windowed = true;
  p.present_rows = capacity;
  p.resident_before.resize(p.b);
  p.resident_after.resize(p.b);
  for (size_t b = 0; b < p.b; ++b) {
    const size_t before = window_resident_rows(p.past[b], capacity, window);
    const size_t after = window_resident_rows(p.keys[b], capacity, window);
    const size_t fresh = p.keys[b] - p.past[b];  // new positions (a right-padded first prompt: fewer than S)
    const size_t evicted = before + fresh - after;
    p.resident_before[b] = before;
    p.resident_after[b] = after;
    // In place needs every evicted row to lie before the window of the call's first query (its own
    // row is `before`) and room for all S written rows after the kept ones.
    if ((evicted > 0 && evicted + window > before + 1) || before - std::min(before, evicted) + p.s > capacity)
      p.staged = true;
  }
  if (in.attention_bias.present()) {  // its columns are absolute positions: one shift for the whole call
    for (size_t b = 1; b < p.b; ++b) {
      const size_t first0 = p.staged ? p.past[0] - p.resident_before[0] : p.keys[0] - p.resident_after[0];
      const size_t first = p.staged ? p.past[b] - p.resident_before[b] : p.keys[b] - p.resident_after[b];
      if (first != first0)
        fail("attention_bias with sliding_window_cache=1 needs the batch entries' windows to start at one position "
             "(entry 0 at ", first0, ", entry ", b, " at ", first, ")");
    }
  }
}

AttentionStats GroupQueryAttention::run_windowed(const GqaInputs& in, const GqaPlan& p, const GqaOutputs& out,
                                                 const TaskRunner& runner) const {
  const size_t B = p.b, S = p.s, Hkv = p.hkv, D = p.d, C = p.present_rows;
  const bool shared = out.present_key == in.past_key.data && out.present_value == in.past_value.data;
  if (!shared) {  // a present buffer that overlaps past without being it would be read while written
    const size_t count = B * Hkv * C * D;
    auto overlaps = [count](const float* a, const float* b) { return a < b + count && b < a + count; };
    if (overlaps(out.present_key, in.past_key.data) || overlaps(out.present_key, in.past_value.data) ||
        overlaps(out.present_value, in.past_key.data) || overlaps(out.present_value, in.past_value.data))
      fail("sliding_window_cache=1: present_key/present_value must be past's buffers or separate from them");
  }
  // The ordinary call over buffer-relative rows: entry b's queries start at row inner.past[b].
  GqaPlan inner = p;
  inner.windowed = inner.staged = false;
  inner.unchanged.assign(B, 0);
  GqaInputs rows = in;
  bool evicts = false;
  for (size_t b = 0; b < B; ++b) {
    const size_t before = p.resident_before[b], fresh = p.keys[b] - p.past[b];
    if (p.staged) {
      inner.past[b] = before;
      inner.keys[b] = before + fresh;
    } else {
      const size_t evicted = before + fresh - p.resident_after[b];
      evicts = evicts || evicted > 0;
      inner.past[b] = before - evicted;
      inner.keys[b] = p.resident_after[b];
      if (evicted == 0) inner.unchanged[b] = before;
    }
  }
  if (in.attention_bias.present()) rows.attention_bias.data += p.keys[0] - inner.keys[0];

  if (!p.staged) {
    // No eviction into separate buffers: the ordinary path (past rows copied, the rest zeroed).
    if (!shared && !evicts) return run(rows, inner, out, runner);
    // Kept rows to the front of present (memmove: in place when past is present), then the
    // ordinary call with present as its own past. Moved rows are new to the key cache.
    runner.run(B * Hkv, [&](size_t task) {
      const size_t b = task / Hkv, head = (task % Hkv), offset = (b * Hkv + head) * C * D;
      const size_t kept = inner.past[b], evicted = p.resident_before[b] - kept;
      for (auto [src, dst] : {std::pair{in.past_key.data + offset, out.present_key + offset},
                              std::pair{in.past_value.data + offset, out.present_value + offset}}) {
        if (evicted > 0 || src != dst) std::memmove(dst, src + evicted * D, kept * D * sizeof(float));
        if (!shared) std::fill(dst + (kept + S) * D, dst + C * D, 0.0f);
      }
    });
    if (!shared) std::fill(inner.unchanged.begin(), inner.unchanged.end(), size_t{0});
    rows.past_key.data = out.present_key;
    rows.past_value.data = out.present_value;
    return run(rows, inner, out, runner);
  }

  // Staged: resident + new rows in a scratch buffer, attention there, the last L(T) rows written back.
  size_t staging_rows = 0;
  for (size_t b = 0; b < B; ++b) staging_rows = std::max(staging_rows, p.resident_before[b] + S);
  inner.present_rows = staging_rows;
  inner.present_shape = {static_cast<int64_t>(B), static_cast<int64_t>(Hkv), static_cast<int64_t>(staging_rows),
                         static_cast<int64_t>(D)};
  std::vector<float> stage_k(B * Hkv * staging_rows * D), stage_v(stage_k.size());
  const AttentionStats stats = run(rows, inner, GqaOutputs{out.output, stage_k.data(), stage_v.data()}, runner);
  runner.run(B * Hkv, [&](size_t task) {
    const size_t b = task / Hkv, head = task % Hkv, after = p.resident_after[b];
    const size_t first = inner.keys[b] - after;
    const float* sk = stage_k.data() + ((b * Hkv + head) * staging_rows + first) * D;
    const float* sv = stage_v.data() + ((b * Hkv + head) * staging_rows + first) * D;
    float* dk = out.present_key + (b * Hkv + head) * C * D;
    float* dv = out.present_value + (b * Hkv + head) * C * D;
    std::memcpy(dk, sk, after * D * sizeof(float));
    std::memcpy(dv, sv, after * D * sizeof(float));
    if (!shared) {
      std::fill(dk + after * D, dk + C * D, 0.0f);
      std::fill(dv + after * D, dv + C * D, 0.0f);
    }
  });
  return stats;
}

}  // namespace ortsparse::attention
