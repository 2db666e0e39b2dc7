// Pieces of the tiled prompt kernel (FlashTile, attention_kernels.h) every ISA shares: the
// scalar twin's score post-processing (scale, soft-cap, bias, key range) and the online-softmax
// update of one row. The SIMD variants use them for the rare paths (soft-cap, bias) and compute
// the dot products, exp and P·V themselves. Included by each ISA file (internal linkage).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>

#include "kernels/attention_kernels.h"

namespace ortsparse::kernels::generic {
namespace {

constexpr float kFlashNegInf = -std::numeric_limits<float>::infinity();

// s[0:kFlashKeys] holds row r's q·k (columns >= n: anything); makes them the row's scores:
// cap(s·scale) + bias, -inf outside the row's key range and at j >= n.
inline void flash_finish_scores(const FlashTile& t, size_t r, float* s) {
  for (size_t j = 0; j < t.n; ++j) s[j] *= t.scale;
  if (t.softcap > 0.0f) {
    const float inv = 1.0f / t.softcap;
    for (size_t j = 0; j < t.n; ++j) s[j] = t.softcap * std::tanh(s[j] * inv);
  }
  if (t.bias)
    for (size_t j = 0; j < t.n; ++j) s[j] += t.bias[r * t.ldb + j];
  const size_t lo = t.lo ? static_cast<size_t>(t.lo[r]) : 0, hi = t.lo ? static_cast<size_t>(t.hi[r]) : t.n;
  for (size_t j = 0; j < kFlashKeys; ++j)
    if (j < lo || j >= hi || j >= t.n) s[j] = kFlashNegInf;
}

// The new running max of row r given its tile max, or -inf when the row has no finite score yet
// (then nothing is updated). NaN scores do not move the max (they reach the sum through exp).
inline float flash_new_max(const FlashTile& t, size_t r, float tile_max) {
  return std::max(t.row_max[r], tile_max);
}

}  // namespace
}  // namespace ortsparse::kernels::generic
