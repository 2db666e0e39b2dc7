// AVX-512 GEMM for the TT contraction. Compiled with -mavx512f (+bw/vl/dq) -mfma; only called when
// the CPU and OS support it.
#include <immintrin.h>

#include "kernels/tt_kernels.h"

namespace ortsparse::kernels {
namespace {

inline __mmask16 tail_mask(size_t count) {
  return count >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << count) - 1u);
}

// R rows of C x 32 columns (two zmm, masked at the right edge) over kc steps of the depth.
template <int R>
void micro(const float* a, size_t lda, const float* b, size_t ldb, float* c, size_t ldc, size_t kc, __mmask16 m0,
           __mmask16 m1, bool first) {
  __m512 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) {
    acc0[r] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m0, c + r * ldc);
    acc1[r] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m1, c + r * ldc + 16);
  }
  for (size_t p = 0; p < kc; ++p) {
    const __m512 b0 = _mm512_maskz_loadu_ps(m0, b + p * ldb);
    const __m512 b1 = _mm512_maskz_loadu_ps(m1, b + p * ldb + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 av = _mm512_set1_ps(a[r * lda + p]);
      acc0[r] = _mm512_fmadd_ps(av, b0, acc0[r]);
      acc1[r] = _mm512_fmadd_ps(av, b1, acc1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_mask_storeu_ps(c + r * ldc, m0, acc0[r]);
    _mm512_mask_storeu_ps(c + r * ldc + 16, m1, acc1[r]);
  }
}

// Few rows (decode, m <= 2): one row has only its own accumulators, and with two of them the FMA
// latency chain (4 cycles) bounds the loop. Four vectors (64 columns) per row keep 4 chains in
// flight per row, so the loop is bound by loading B instead.
template <int R>
void micro_wide(const float* a, size_t lda, const float* b, size_t ldb, float* c, size_t ldc, size_t kc,
                const __mmask16* mask, bool first) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v)
      acc[r][v] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask[v], c + r * ldc + 16 * v);
  for (size_t p = 0; p < kc; ++p) {
    __m512 bv[4];
    for (int v = 0; v < 4; ++v) bv[v] = _mm512_maskz_loadu_ps(mask[v], b + p * ldb + 16 * v);
    for (int r = 0; r < R; ++r) {
      const __m512 av = _mm512_set1_ps(a[r * lda + p]);
      for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_fmadd_ps(av, bv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) _mm512_mask_storeu_ps(c + r * ldc + 16 * v, mask[v], acc[r][v]);
}

constexpr size_t kRows = 6;
constexpr size_t kWideRows = 2;
constexpr size_t kWidePanel = 64;
constexpr size_t kPanel = 2 * kTTPanel;

void gemm_avx512(const float* a, size_t lda, const float* b, size_t ldb, float* c, size_t ldc, size_t m, size_t k,
                 size_t n) {
  if (k == 0) {
    for (size_t i = 0; i < m; ++i)
      for (size_t j = 0; j < n; ++j) c[i * ldc + j] = 0.0f;
    return;
  }
  if (m <= kWideRows) {
    for (size_t k0 = 0; k0 < k; k0 += kTTDepthBlock) {
      const size_t kc = k - k0 < kTTDepthBlock ? k - k0 : kTTDepthBlock;
      for (size_t j = 0; j < n; j += kWidePanel) {
        const size_t width = n - j < kWidePanel ? n - j : kWidePanel;
        __mmask16 mask[4];
        for (size_t v = 0; v < 4; ++v) mask[v] = width > 16 * v ? tail_mask(width - 16 * v) : static_cast<__mmask16>(0);
        if (m == 2) {
          micro_wide<2>(a + k0, lda, b + k0 * ldb + j, ldb, c + j, ldc, kc, mask, k0 == 0);
        } else {
          micro_wide<1>(a + k0, lda, b + k0 * ldb + j, ldb, c + j, ldc, kc, mask, k0 == 0);
        }
      }
    }
    return;
  }
  for (size_t k0 = 0; k0 < k; k0 += kTTDepthBlock) {
    const size_t kc = k - k0 < kTTDepthBlock ? k - k0 : kTTDepthBlock;
    const bool first = k0 == 0;
    for (size_t j = 0; j < n; j += kPanel) {
      const size_t width = n - j < kPanel ? n - j : kPanel;
      const __mmask16 m0 = tail_mask(width);
      const __mmask16 m1 = width > 16 ? tail_mask(width - 16) : static_cast<__mmask16>(0);
      const float* bp = b + k0 * ldb + j;
      size_t i = 0;
      for (; i + kRows <= m; i += kRows) micro<6>(a + i * lda + k0, lda, bp, ldb, c + i * ldc + j, ldc, kc, m0, m1, first);
      switch (m - i) {
        case 5: micro<5>(a + i * lda + k0, lda, bp, ldb, c + i * ldc + j, ldc, kc, m0, m1, first); break;
        case 4: micro<4>(a + i * lda + k0, lda, bp, ldb, c + i * ldc + j, ldc, kc, m0, m1, first); break;
        case 3: micro<3>(a + i * lda + k0, lda, bp, ldb, c + i * ldc + j, ldc, kc, m0, m1, first); break;
        case 2: micro<2>(a + i * lda + k0, lda, bp, ldb, c + i * ldc + j, ldc, kc, m0, m1, first); break;
        case 1: micro<1>(a + i * lda + k0, lda, bp, ldb, c + i * ldc + j, ldc, kc, m0, m1, first); break;
        default: break;
      }
    }
  }
}

}  // namespace

const TTKernels& tt_kernels_avx512() {
  static const TTKernels table{gemm_avx512};
  return table;
}

}  // namespace ortsparse::kernels
