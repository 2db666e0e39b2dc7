// exp_generic.h's algorithm on 16 lanes, for files compiled with -mavx512f (each includes its own
// copy, internal linkage). Same bits as generic::exp_scalar: tests/ops/test_gqa_op.py (exp_sub) and
// tests/ops/test_kernels.py (silu_glu) compare every ISA with the scalar twin.
#pragma once

#include <immintrin.h>

#include "kernels/exp_generic.h"

namespace ortsparse::kernels::avx512 {
namespace {

// exp_generic.h's algorithm on 16 lanes (scalef does the 2^n: exactly ldexp's rounding).
inline __m512 exp16(__m512 t) {
  using namespace generic;
  const __mmask16 small = _mm512_cmp_ps_mask(t, _mm512_set1_ps(kExpMin), _CMP_LT_OQ);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(t, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Hi), t);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Lo), r);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(kExpC0), r, _mm512_set1_ps(kExpC1));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpC2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpC3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpC4));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpC5));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r);
  p = _mm512_add_ps(p, _mm512_set1_ps(1.0f));
  const __m512 e = _mm512_max_ps(_mm512_min_ps(n, _mm512_set1_ps(127.0f)), _mm512_set1_ps(-126.0f));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~small), _mm512_scalef_ps(p, e));
}

}  // namespace
}  // namespace ortsparse::kernels::avx512
