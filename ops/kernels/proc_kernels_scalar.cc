// Reference kernels of the proc backend: plain loops, the definition the SIMD twins must match.
#include <algorithm>

#include "kernels/proc_kernels.h"

namespace ortsparse::kernels {
namespace {

inline float delta_at(const float* d, size_t i) { return d[i]; }
inline float delta_at(const uint16_t* d, size_t i) { return half_to_float(d[i]); }

template <typename D>
size_t units_impl(const ProcPacked& p, const float* const* x, size_t count, const uint8_t* mask, size_t n0,
                  size_t n1, const float* bias, float* const* y) {
  const D* deltas = static_cast<const D*>(p.deltas);
  const bool hashed = p.base_scale != 0.0f;
  size_t computed = 0;
  for (size_t j = n0; j < n1; ++j) {
    float acc[kProcTokenTile] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (size_t f = 0; f < p.fanout; ++f) {
      const size_t b = p.index[j * p.fanout + f];
      if (mask && !mask[b]) continue;
      ++computed;
      const size_t start = b * p.block, len = std::min(p.block, p.k - start);
      const D* d = deltas + (j * p.fanout + f) * p.block;
      for (size_t r = 0; r < len; ++r) {
        float w = delta_at(d, r);
        if (hashed) w = proc_base(p.seed, p.base_scale, j, start + r) + w;
        for (size_t t = 0; t < count; ++t) acc[t] += w * x[t][start + r];
      }
    }
    for (size_t t = 0; t < count; ++t) y[t][j] = acc[t] + (bias ? bias[j] : 0.0f);
  }
  return computed;
}

size_t units_scalar(const ProcPacked& p, const float* const* x, size_t count, const uint8_t* mask, size_t n0,
                    size_t n1, const float* bias, float* const* y) {
  return p.delta_type == DeltaType::kF16 ? units_impl<uint16_t>(p, x, count, mask, n0, n1, bias, y)
                                         : units_impl<float>(p, x, count, mask, n0, n1, bias, y);
}

void base_values_scalar(uint64_t seed, float scale, uint64_t n, uint64_t k0, size_t count, float* out) {
  for (size_t i = 0; i < count; ++i) out[i] = proc_base(seed, scale, n, k0 + i);
}

}  // namespace

const ProcKernels& proc_kernels_scalar() {
  static const ProcKernels table{units_scalar, base_values_scalar};
  return table;
}

}  // namespace ortsparse::kernels
