#include <algorithm>
#include <cmath>

#include "kernels/attention_kernels.h"
#include "kernels/exp_generic.h"
#include "kernels/flash_generic.h"
#include "kernels/rotary_generic.h"

namespace ortsparse::kernels {
namespace {

void dot_rows_scalar(const float* q, const float* k, size_t ldk, size_t d, const int32_t* rows, size_t n, float* out) {
  for (size_t i = 0; i < n; ++i) {
    const float* kr = k + (rows ? static_cast<size_t>(rows[i]) : i) * ldk;
    float s = 0.0f;
    for (size_t j = 0; j < d; ++j) s += q[j] * kr[j];
    out[i] = s;
  }
}

float pack_row_scalar(const float* x, size_t d, int mode, float eps, uint64_t* out, size_t stride, uint64_t* bits_set) {
  const size_t words = (d + 63) / 64;
  double sum = 0.0;
  size_t active = 0;
  for (size_t w = 0; w < words; ++w) {
    uint64_t pos = 0, neg = 0;
    const size_t end = std::min(d, (w + 1) * 64);
    for (size_t i = w * 64; i < end; ++i) {
      const float v = x[i];
      const double a = std::fabs(static_cast<double>(v));
      const unsigned shift = static_cast<unsigned>(i - w * 64);
      if (mode == 1) {
        pos |= static_cast<uint64_t>(v > 0.0f) << shift;
        sum += a;
      } else {
        const bool p = mode == 2 ? std::fabs(v) > eps : v > eps;
        const bool n = mode == 3 && v < -eps;
        pos |= static_cast<uint64_t>(p) << shift;
        neg |= static_cast<uint64_t>(n) << shift;
        if (p || n) {
          sum += a;
          ++active;
        }
      }
    }
    out[w * stride] = pos;
    if (mode == 3) out[(words + w) * stride] = neg;
    *bits_set += static_cast<uint64_t>(__builtin_popcountll(pos) + __builtin_popcountll(neg));
  }
  if (mode == 1) return d ? static_cast<float>(sum / static_cast<double>(d)) : 0.0f;
  return active ? static_cast<float>(sum / static_cast<double>(active)) : eps;
}

}  // namespace

// NH (UMAC): sum over word pairs of (m0 + k0 mod 2^32) * (m1 + k1 mod 2^32) mod 2^64. An odd word
// count pads with a zero word.
void row_hash_scalar(const float* x, size_t d, const uint32_t* key, uint64_t* out) {
  const uint32_t* m = reinterpret_cast<const uint32_t*>(x);
  uint64_t h0 = 0, h1 = 0;
  size_t i = 0;
  for (; i + 2 <= d; i += 2) {
    h0 += static_cast<uint64_t>(m[i] + key[i]) * static_cast<uint64_t>(m[i + 1] + key[i + 1]);
    h1 += static_cast<uint64_t>(m[i] + key[i + 2]) * static_cast<uint64_t>(m[i + 1] + key[i + 3]);
  }
  if (i < d) {
    h0 += static_cast<uint64_t>(m[i] + key[i]) * static_cast<uint64_t>(key[i + 1]);
    h1 += static_cast<uint64_t>(m[i] + key[i + 2]) * static_cast<uint64_t>(key[i + 3]);
  }
  out[0] = h0;
  out[1] = h1;
}

// The reference of the tiled prompt step: one row at a time, sums in index order.
void flash_tile_scalar(const FlashTile& t) {
  for (size_t r = 0; r < t.m; ++r) {
    float* s = t.scores + r * kFlashKeys;
    const float* q = t.q + r * t.d;
    for (size_t j = 0; j < t.n; ++j) {
      float dot = 0.0f;
      for (size_t c = 0; c < t.d; ++c) dot += q[c] * t.kt[c * kFlashKeys + j];
      s[j] = dot;
    }
    generic::flash_finish_scores(t, r, s);
    float tile_max = generic::kFlashNegInf;
    for (size_t j = 0; j < t.n; ++j) tile_max = std::max(tile_max, s[j]);
    const float new_max = generic::flash_new_max(t, r, tile_max);
    if (new_max == generic::kFlashNegInf) continue;
    const float alpha = generic::exp_scalar(t.row_max[r] - new_max);
    float sum = 0.0f;
    for (size_t j = 0; j < t.n; ++j) {
      s[j] = generic::exp_scalar(s[j] - new_max);
      sum += s[j];
    }
    t.row_sum[r] = t.row_sum[r] * alpha + sum;
    t.row_max[r] = new_max;
    float* o = t.o + r * t.dv;
    for (size_t c = 0; c < t.dv; ++c) o[c] *= alpha;
    for (size_t j = 0; j < t.n; ++j) {
      const float* v = t.v + j * t.ldv;
      for (size_t c = 0; c < t.dv; ++c) o[c] += s[j] * v[c];
    }
  }
}

const AttentionKernels& attention_kernels_scalar() {
  static const AttentionKernels table{dot_rows_scalar, pack_row_scalar, row_hash_scalar, generic::rotate, generic::exp_sub,
                                      flash_tile_scalar};
  return table;
}

}  // namespace ortsparse::kernels
