// AVX-512F; only called when the CPU has it.
#include <immintrin.h>

#include "attention/attention_kernels.h"

namespace ortsparse::attention {
namespace {

inline __mmask16 tail_mask(size_t count) { return static_cast<__mmask16>((1u << count) - 1u); }

void dot_rows_avx512(const float* q, const float* k, size_t ldk, size_t d, const int32_t* rows, size_t n, float* out) {
  for (size_t i = 0; i < n; ++i) {
    const float* kr = k + (rows ? static_cast<size_t>(rows[i]) : i) * ldk;
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    size_t j = 0;
    for (; j + 32 <= d; j += 32) {
      a0 = _mm512_fmadd_ps(_mm512_loadu_ps(q + j), _mm512_loadu_ps(kr + j), a0);
      a1 = _mm512_fmadd_ps(_mm512_loadu_ps(q + j + 16), _mm512_loadu_ps(kr + j + 16), a1);
    }
    for (; j < d; j += 16) {
      const __mmask16 m = d - j >= 16 ? static_cast<__mmask16>(0xFFFF) : tail_mask(d - j);
      a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q + j), _mm512_maskz_loadu_ps(m, kr + j), a0);
    }
    out[i] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
  }
}

}  // namespace

const AttentionKernels& attention_kernels_avx512() {
  static const AttentionKernels table{"avx512", dot_rows_avx512};
  return table;
}

}  // namespace ortsparse::attention
