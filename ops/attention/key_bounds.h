// Upper bounds of q·k over a group of keys from per-dim bounds of K (the page selector's pages,
// the tiled prompt path's key tiles): max_k q·k <= sum_d max(q_d·min_d, q_d·max_d) = dot of the
// split query [max(q, 0), min(q, 0)] with the group's [max K (D), min K (D)], plus rounding slack,
// mapped to score space. Shared so every selector bounds the same way, bit for bit.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>

#include "attention/exact_attention.h"

namespace ortsparse::attention {

// Rounding slack of a bound: both the bound (a dot of length 2D) and an exact q·k (length D) are
// float sums whose error is at most (length)·2^-24·sum|terms|, and every term is at most
// |q_d|·max|k| of the group; (4D + 16)·2^-24·|q|_1·max|k| covers both with room.
inline float bound_slack(size_t d, float q_abs_sum) {
  return static_cast<float>((4.0 * static_cast<double>(d) + 16.0) * 0x1.0p-24) * q_abs_sum;
}

// q split by sign into [max(q, 0) (D), min(q, 0) (D)], the query side of a bound (a dot with a
// group's [max K (D), min K (D)]); returns |q|_1 (non-finite: q holds a non-finite value).
inline float split_query(const float* q, size_t d, float* qsplit) {
  float q_abs = 0.0f;
  for (size_t i = 0; i < d; ++i) {
    qsplit[i] = std::max(q[i], 0.0f);
    qsplit[d + i] = std::min(q[i], 0.0f);
    q_abs += std::fabs(q[i]);
  }
  return q_abs;
}

// A group's raw bound (its dot with the split query) in score space: rounding slack (absmax: the
// group's max |k|), scale, soft-cap (all monotone, so the order of bounds is the order of the
// keys' best possible scores).
inline float score_space_bound(float raw, float absmax, float slack, const ScoreParams& sp) {
  float b = (raw + slack * absmax) * sp.scale;
  if (sp.softcap > 0.0f) b = sp.softcap * std::tanh(b / sp.softcap);
  return b;
}

}  // namespace ortsparse::attention
