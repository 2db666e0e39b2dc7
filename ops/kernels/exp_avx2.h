// exp_generic.h's algorithm on 8 lanes, for files compiled with -mavx2 -mfma (each includes its own
// copy, internal linkage). Same bits as generic::exp_scalar: tests/ops/test_gqa_op.py (exp_sub) and
// tests/ops/test_kernels.py (silu_glu) compare every ISA with the scalar twin.
#pragma once

#include <immintrin.h>

#include "kernels/exp_generic.h"

namespace ortsparse::kernels::avx2 {
namespace {

// exp_generic.h's algorithm on 8 lanes; 2^n built in the exponent field (n in [-126, 127]: normal),
// one rounding in the final multiply, as ldexp.
inline __m256 exp8(__m256 t) {
  using namespace generic;
  const __m256 small = _mm256_cmp_ps(t, _mm256_set1_ps(kExpMin), _CMP_LT_OQ);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(t, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Hi), t);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Lo), r);
  __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(kExpC0), r, _mm256_set1_ps(kExpC1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpC2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpC3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpC4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpC5));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r);
  p = _mm256_add_ps(p, _mm256_set1_ps(1.0f));
  const __m256 e = _mm256_max_ps(_mm256_min_ps(n, _mm256_set1_ps(127.0f)), _mm256_set1_ps(-126.0f));
  // n is NaN for a NaN t: keep p (NaN) instead of a garbage power of two.
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(e), _mm256_set1_epi32(127)), 23);
  const __m256 scaled = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
  const __m256 nan = _mm256_cmp_ps(t, t, _CMP_UNORD_Q);
  return _mm256_andnot_ps(small, _mm256_blendv_ps(scaled, p, nan));
}

}  // namespace
}  // namespace ortsparse::kernels::avx2
