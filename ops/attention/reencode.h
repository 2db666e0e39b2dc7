// Re-encoding (PopcountAttention reuse_rows = 1): the same encoder re-run on a slowly changing
// input (a document being edited, a window over a stream). Between calls of one node the previous
// call's Q, K, V rows, mask, outputs and each query row's softmax state (running max m, sum
// l = sum_j e^{s_j - m} and numerator N = sum_j e^{s_j - m} v_j) are kept. On a new call of the
// same shapes, per query row (b, h, i):
//   - Q row and mask row unchanged, no attended K/V row changed: the previous output is reused;
//   - Q row and mask row unchanged, a few attended K/V rows changed: corrected in place — the old
//     keys' e^{s-m}·v leave N and l, the new keys' enter (m raised first when a new score exceeds
//     it, N and l rescaled): exact up to rounding. The row is recomputed instead when the change
//     touches more than a quarter of its keys (recomputing is then cheaper), when its softmax has
//     no finite weight, or when cancellation could lose precision: the mass that went through the
//     row's running sum since its last full computation must stay within kMaxAmplification times
//     the sum (a float rounding error of the full computation is amplified at most that much);
//   - anything else: recomputed (flash tiles, as the tiled prompt path).
// Every call leaves the state describing its own inputs and outputs. With tol > 0 (approximate), a
// Q, K or V row whose largest change from the state's row is at most tol times the state row's
// largest entry counts as unchanged and the state keeps its old row: every output is then exact
// attention over the state's rows, each within tol of this call's (the error does not accumulate
// over calls: a row drifting past tol is refreshed). Exact attention only: the
// caller decides eligibility (select = none or a call the selector does not run), and a call with
// a non-finite input, mask value NaN / +inf, or a non-finite output is left to the caller's full
// computation (the state is then rebuilt on the next call). See docs/ops.md#re-encoding.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

#include "attention/attention_call.h"
#include "attention/popcount_attention.h"
#include "common/task_runner.h"
#include "kernels/kernel_set.h"

namespace ortsparse::attention {

struct ReencodeStats {
  bool applied = false;  // false: the caller computes the call in full (y untouched)
  bool busy = false;     // not applied because another call held the state
  bool reset = false;    // the state was (re)built: first call, new shapes or after a fallback
  uint64_t rows_reused = 0, rows_corrected = 0, rows_recomputed = 0;
  uint64_t keys_attended = 0;  // keys in the query rows' ranges, summed over rows
  uint64_t keys_scored = 0;    // keys scored: recomputed rows' ranges + corrections (old and new)
};

// What fixes the meaning of a call besides its inputs: a change resets the state.
struct ReencodeParams {
  float scale = 1.0f;
  bool causal = false;
  size_t mask_elements = 0;  // elements of the mask buffer (0: no mask)
  float tol = 0.0f;          // > 0: a Q/K/V row within tol (max-abs, relative) of the state's counts as unchanged
};

// Whether a call with `keys` keys per entry is exact attention under `config` (select = none, or
// the selector does not run: fewer keys than min_keys or at most topk): only those are re-encoded.
bool reencode_applies(const PopcountAttentionConfig& config, size_t keys);

class Reencoder {
 public:
  // Precision guard of a correction (see above): mass through the running sum <= this x the sum.
  static constexpr double kMaxAmplification = 8.0;
  // A row with more changed keys than this fraction of its range is recomputed, not corrected.
  static constexpr double kMaxCorrectedFraction = 0.25;

  // Computes y of every row of `call` (4-D contiguous layout, kv_len / q_pos0 empty, H a multiple
  // of Hkv, D and Dv >= 1) from the previous call's state, or returns applied = false (y
  // untouched) when the call is not eligible or another thread holds the state (busy: concurrent
  // calls never share or half-update the state; the caller computes them in full).
  ReencodeStats run(const AttentionCall& call, const ReencodeParams& params, const kernels::KernelSet& kernels,
                    const TaskRunner& runner);

 private:
  struct Pass;        // one call's plan and its rows' kinds (reencode.cc)
  struct HeadCounts;  // what one (b, kv head) task did
  struct RowScratch;  // a task's work buffers

  ReencodeStats run_locked(const AttentionCall& call, const ReencodeParams& params, const kernels::KernelSet& kernels,
                           const TaskRunner& runner);
  bool same_call(const AttentionCall& call, const ReencodeParams& params) const;
  void reset_state(const AttentionDims& dims, size_t mask_bytes);
  bool classify_head(Pass& pass, size_t head) const;
  void update_head(const Pass& pass, size_t head, HeadCounts& counts);
  bool correct_row(const Pass& pass, size_t head, size_t g, size_t i, RowScratch& scratch, HeadCounts& counts);
  void store_head_inputs(const Pass& pass, size_t head);
  void recompute_rows(const Pass& pass, size_t head, const std::vector<size_t>& redo, HeadCounts& counts);
  void keep_call(const AttentionCall& call, const ReencodeParams& params, const Pass& pass);

  std::mutex mutex_;
  // The previous call (valid only when `valid`).
  bool valid_ = false;
  AttentionDims dims_;
  ReencodeParams params_;
  bool mask_keep_ = false, mask_add_ = false;
  size_t mask_stride_[4] = {0, 0, 0, 0};
  std::vector<float> q_, k_, v_, y_;
  std::vector<uint8_t> mask_;  // the mask buffer's bytes
  std::vector<float> row_max_;                 // m per row [B, H, Sq]
  std::vector<double> row_sum_, row_through_;  // l, and the mass through l since its last full computation
  std::vector<float> numer_;                   // N per row, [B, H, Sq, Dv]
};

}  // namespace ortsparse::attention
