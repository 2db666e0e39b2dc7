// Exact attention over a list of keys: scores q·k · scale (+ soft-cap, + mask) and y = softmax · V.
// The selective path calls these on the keys it kept; select = none calls them on every key.
#pragma once

#include <cstddef>
#include <cstdint>

#include "attention/attention_call.h"
#include "kernels/kernel_set.h"

namespace ortsparse::attention {

// One query row's view of the mask: value(j) is what is added to the scaled score of key j.
struct MaskRow {
  const uint8_t* keep = nullptr;
  const float* add = nullptr;
  size_t stride = 0;
  float value(size_t j) const {
    if (keep) return keep[j * stride] ? 0.0f : kNegInf;
    if (add) return add[j * stride];
    return 0.0f;
  }
  bool any() const { return keep != nullptr || add != nullptr; }
};

MaskRow mask_row(const MaskView& mask, size_t b, size_t h, size_t i);

// s[j] += mask value of key lo + j, for j < n.
void add_mask(const MaskRow& m, size_t lo, float* s, size_t n);

struct ScoreParams {
  float scale = 1.0f;
  float softcap = 0.0f;  // > 0: s = softcap * tanh(s / softcap) before the mask
};

// Exact scores of keys lo + rows[i] (rows == nullptr: keys lo .. lo + n - 1) of one head whose
// rows start at `khead` with stride ldk: s = cap(q·k * scale) + mask.
void exact_scores(const kernels::KernelSet& kernels, const ScoreParams& p, const float* q, size_t d,
                  const float* khead, size_t ldk, const MaskRow& m, size_t lo, const int32_t* rows, size_t n, float* s);

// y[0:dv] = softmax(s) · V[lo + rows] (rows == nullptr: V[lo .. lo + n - 1]); s is overwritten by the
// probabilities. sink > -inf: the logit of one more key whose V row is zero (smooth softmax / an
// attention sink: it takes part in the normaliser only). No key: y = 0; every score -inf: y = 0·V (NaN
// where V is not finite); a NaN score: y = NaN.
void softmax_pv(const kernels::KernelSet& kernels, float* s, const float* vhead, size_t ldv, size_t dv, size_t lo,
                const int32_t* rows, size_t n, float* y, float sink = kNegInf);

}  // namespace ortsparse::attention
