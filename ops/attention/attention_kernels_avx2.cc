// AVX2+FMA; only called when the CPU has them.
#include <immintrin.h>

#include "attention/attention_kernels.h"

namespace ortsparse::attention {
namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

void dot_rows_avx2(const float* q, const float* k, size_t ldk, size_t d, const int32_t* rows, size_t n, float* out) {
  for (size_t i = 0; i < n; ++i) {
    const float* kr = k + (rows ? static_cast<size_t>(rows[i]) : i) * ldk;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    size_t j = 0;
    for (; j + 16 <= d; j += 16) {
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), _mm256_loadu_ps(kr + j), a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + j + 8), _mm256_loadu_ps(kr + j + 8), a1);
    }
    for (; j + 8 <= d; j += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), _mm256_loadu_ps(kr + j), a0);
    float s = hsum(_mm256_add_ps(a0, a1));
    for (; j < d; ++j) s += q[j] * kr[j];
    out[i] = s;
  }
}

}  // namespace

const AttentionKernels& attention_kernels_avx2() {
  static const AttentionKernels table{"avx2", dot_rows_avx2};
  return table;
}

}  // namespace ortsparse::attention
