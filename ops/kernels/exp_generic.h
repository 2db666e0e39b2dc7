// exp(x - shift) the same way on every ISA: n = round(t · log2 e), r = t - n·ln 2 (two-part ln 2),
// exp(r) by a degree-7 polynomial (Cephes' expf), times 2^n. Every step is an exactly rounded
// operation (fma, multiply, add, round to nearest even, scaling by a power of two), so the scalar
// twin and the SIMD variants give the same bits; relative error <= 2 ulp. t < -87 (where exp(t)
// is below the smallest normal float): 0, so -inf gives 0; NaN stays NaN; meant for t <= 0 (a
// softmax shifted by its max). Included by each ISA file (internal linkage: each keeps its own copy).
#pragma once

#include <cmath>
#include <cstddef>

namespace ortsparse::kernels::generic {
namespace {

constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kExpC0 = 1.9875691500e-4f, kExpC1 = 1.3981999507e-3f, kExpC2 = 8.3334519073e-3f,
                kExpC3 = 4.1665795894e-2f, kExpC4 = 1.6666665459e-1f, kExpC5 = 5.0000001201e-1f;
constexpr float kExpMin = -87.0f;

inline float exp_scalar(float t) {
  if (t < kExpMin) return 0.0f;
  const float n = std::nearbyint(t * kLog2e);
  float r = std::fma(n, -kLn2Hi, t);
  r = std::fma(n, -kLn2Lo, r);
  float p = std::fma(kExpC0, r, kExpC1);
  p = std::fma(p, r, kExpC2);
  p = std::fma(p, r, kExpC3);
  p = std::fma(p, r, kExpC4);
  p = std::fma(p, r, kExpC5);
  p = std::fma(p, r * r, r);
  p = p + 1.0f;
  return std::ldexp(p, static_cast<int>(std::fmax(std::fmin(n, 127.0f), -126.0f)));
}

// silu(g) * u, silu(g) = g * sigmoid(g) with sigmoid from e = exp(-|g|): (g >= 0 ? 1 : e) / (1 + e).
inline float silu_times(float g, float u) {
  const float e = exp_scalar(-std::fabs(g));
  const float sigmoid = (g >= 0.0f ? 1.0f : e) / (1.0f + e);
  return (g * sigmoid) * u;
}

inline double exp_sub(const float* x, size_t n, float shift, float* out) {
  double sum = 0.0;
  for (size_t i = 0; i < n; ++i) {
    out[i] = exp_scalar(x[i] - shift);
    sum += out[i];
  }
  return sum;
}

}  // namespace
}  // namespace ortsparse::kernels::generic
