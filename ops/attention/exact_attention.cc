#include "attention/exact_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace ortsparse::attention {

MaskRow mask_row(const MaskView& mask, size_t b, size_t h, size_t i) {
  MaskRow m;
  const size_t at = b * mask.stride[0] + h * mask.stride[1] + i * mask.stride[2];
  m.keep = mask.keep ? mask.keep + at : nullptr;
  m.add = mask.add ? mask.add + at : nullptr;
  m.stride = mask.stride[3];
  return m;
}

// Branches hoisted so the loops vectorise.
void add_mask(const MaskRow& m, size_t lo, float* s, size_t n) {
  if (m.add) {
    const float* add = m.add + lo * m.stride;
    if (m.stride == 1) {
      for (size_t j = 0; j < n; ++j) s[j] += add[j];
    } else {
      for (size_t j = 0; j < n; ++j) s[j] += add[j * m.stride];
    }
  } else if (m.keep) {
    // False adds -inf, as the additive mask and onnxruntime's Attention (which converts it so): a
    // masked-out key's NaN or +inf score gives NaN, not -inf.
    const uint8_t* keep = m.keep + lo * m.stride;
    for (size_t j = 0; j < n; ++j) s[j] = keep[j * m.stride] ? s[j] : s[j] + kNegInf;
  }
}

void exact_scores(const kernels::KernelSet& kernels, const ScoreParams& p, const float* q, size_t d,
                  const float* khead, size_t ldk, const MaskRow& m, size_t lo, const int32_t* rows, size_t n, float* s) {
  kernels.attention->dot_rows(q, khead + lo * ldk, ldk, d, rows, n, s);
  for (size_t i = 0; i < n; ++i) s[i] *= p.scale;
  if (p.softcap > 0.0f) {
    const float inv = 1.0f / p.softcap;
    for (size_t i = 0; i < n; ++i) s[i] = p.softcap * std::tanh(s[i] * inv);
  }
  if (rows == nullptr) {
    add_mask(m, lo, s, n);
  } else if (m.any()) {
    for (size_t i = 0; i < n; ++i) s[i] += m.value(lo + static_cast<size_t>(rows[i]));
  }
}

void softmax_pv(const kernels::KernelSet& kernels, float* s, const float* vhead, size_t ldv, size_t dv, size_t lo,
                const int32_t* rows, size_t n, float* y, float sink) {
  float mx = kNegInf;
  for (size_t i = 0; i < n; ++i) mx = std::max(mx, s[i]);
  if (n == 0 || mx == kNegInf) {
    // std::max skips NaN: scores that are all NaN or -inf with a NaN (a NaN q, an all-NaN bias row)
    // give NaN, as onnxruntime's softmax does. Every score -inf: the keys' weights are 0, y = 0·V
    // (0, or NaN in a column holding a NaN/Inf V entry: onnxruntime multiplies them); no key: 0.
    // A NaN or +inf sink: exp(inf - inf) in the normaliser, NaN as on the path with a key.
    const bool nan = !(sink < kPosInf) || std::any_of(s, s + n, [](float v) { return std::isnan(v); });
    std::fill(y, y + dv, nan ? std::numeric_limits<float>::quiet_NaN() : 0.0f);
    if (!nan && n > 0) {
      std::fill(s, s + n, 0.0f);
      kernels.matmul->gemv_rows(vhead + lo * ldv, ldv, rows, s, n, y, dv, false);
    }
    return;
  }
  mx = std::max(mx, sink);
  double sum = sink == kNegInf ? 0.0 : std::exp(static_cast<double>(sink - mx));
  sum += kernels.attention->exp_sub(s, n, mx, s);
  const float inv = static_cast<float>(1.0 / sum);
  for (size_t i = 0; i < n; ++i) s[i] *= inv;
  kernels.matmul->gemv_rows(vhead + lo * ldv, ldv, rows, s, n, y, dv, false);
}

}  // namespace ortsparse::attention
