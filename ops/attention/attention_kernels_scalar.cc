#include <algorithm>
#include <cmath>

#include "attention/attention_kernels.h"

namespace ortsparse::attention {
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

const AttentionKernels& attention_kernels_scalar() {
  static const AttentionKernels table{"scalar", dot_rows_scalar, pack_row_scalar};
  return table;
}

const AttentionKernels& attention_kernels_for(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return attention_kernels_avx512();
    case Isa::kAvx2: return attention_kernels_avx2();
    default: return attention_kernels_scalar();
  }
}

}  // namespace ortsparse::attention
