// AVX2 + FMA GEMM for the TT contraction. Compiled with -mavx2 -mfma; only called when the CPU has them.
#include <immintrin.h>

#include "kernels/tt_kernels.h"

namespace ortsparse::kernels {
namespace {

inline __m256i tail_mask(size_t count) {
  alignas(32) static const int32_t ramp[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ramp + 8 - (count > 8 ? 8 : count)));
}

// R rows of C x 16 columns (two ymm, masked at the right edge) over kc steps of the depth.
// kFull: a whole 16-column panel (plain loads; vmaskmovps costs extra uops in the inner loop).
template <int R, bool kFull>
void micro(const float* a, size_t lda, const float* b, size_t ldb, float* c, size_t ldc, size_t kc, __m256i m0,
           __m256i m1, bool first) {
  __m256 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) {
    acc0[r] = first ? _mm256_setzero_ps() : _mm256_maskload_ps(c + r * ldc, m0);
    acc1[r] = first ? _mm256_setzero_ps() : _mm256_maskload_ps(c + r * ldc + 8, m1);
  }
  for (size_t p = 0; p < kc; ++p) {
    const __m256 b0 = kFull ? _mm256_loadu_ps(b + p * ldb) : _mm256_maskload_ps(b + p * ldb, m0);
    const __m256 b1 = kFull ? _mm256_loadu_ps(b + p * ldb + 8) : _mm256_maskload_ps(b + p * ldb + 8, m1);
    for (int r = 0; r < R; ++r) {
      const __m256 av = _mm256_broadcast_ss(a + r * lda + p);
      acc0[r] = _mm256_fmadd_ps(av, b0, acc0[r]);
      acc1[r] = _mm256_fmadd_ps(av, b1, acc1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_maskstore_ps(c + r * ldc, m0, acc0[r]);
    _mm256_maskstore_ps(c + r * ldc + 8, m1, acc1[r]);
  }
}

// Few rows (decode, m <= 2): four vectors (32 columns) per row keep 4 FMA chains in flight, so the
// loop is bound by loading B rather than by the FMA latency of one row's two accumulators.
template <int R>
void micro_wide(const float* a, size_t lda, const float* b, size_t ldb, float* c, size_t ldc, size_t kc,
                const __m256i* mask, bool full, bool first) {
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v)
      acc[r][v] = first ? _mm256_setzero_ps() : _mm256_maskload_ps(c + r * ldc + 8 * v, mask[v]);
  if (full) {
    for (size_t p = 0; p < kc; ++p) {
      __m256 bv[4];
      for (int v = 0; v < 4; ++v) bv[v] = _mm256_loadu_ps(b + p * ldb + 8 * v);
      for (int r = 0; r < R; ++r) {
        const __m256 av = _mm256_broadcast_ss(a + r * lda + p);
        for (int v = 0; v < 4; ++v) acc[r][v] = _mm256_fmadd_ps(av, bv[v], acc[r][v]);
      }
    }
  } else {
    for (size_t p = 0; p < kc; ++p) {
      __m256 bv[4];
      for (int v = 0; v < 4; ++v) bv[v] = _mm256_maskload_ps(b + p * ldb + 8 * v, mask[v]);
      for (int r = 0; r < R; ++r) {
        const __m256 av = _mm256_broadcast_ss(a + r * lda + p);
        for (int v = 0; v < 4; ++v) acc[r][v] = _mm256_fmadd_ps(av, bv[v], acc[r][v]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) _mm256_maskstore_ps(c + r * ldc + 8 * v, mask[v], acc[r][v]);
}

constexpr size_t kRows = 4;
constexpr size_t kWideRows = 2;
constexpr size_t kWidePanel = 32;

template <bool kFull>
void panel_rows(const float* a, size_t lda, const float* bp, size_t ldb, float* c, size_t ldc, size_t m, size_t k0,
                size_t kc, __m256i m0, __m256i m1, bool first) {
  size_t i = 0;
  for (; i + kRows <= m; i += kRows) micro<4, kFull>(a + i * lda + k0, lda, bp, ldb, c + i * ldc, ldc, kc, m0, m1, first);
  switch (m - i) {
    case 3: micro<3, kFull>(a + i * lda + k0, lda, bp, ldb, c + i * ldc, ldc, kc, m0, m1, first); break;
    case 2: micro<2, kFull>(a + i * lda + k0, lda, bp, ldb, c + i * ldc, ldc, kc, m0, m1, first); break;
    case 1: micro<1, kFull>(a + i * lda + k0, lda, bp, ldb, c + i * ldc, ldc, kc, m0, m1, first); break;
    default: break;
  }
}

void gemm_avx2(const float* a, size_t lda, const float* b, size_t ldb, float* c, size_t ldc, size_t m, size_t k,
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
        __m256i mask[4];
        for (size_t v = 0; v < 4; ++v) mask[v] = width > 8 * v ? tail_mask(width - 8 * v) : _mm256_setzero_si256();
        if (m == 2) {
          micro_wide<2>(a + k0, lda, b + k0 * ldb + j, ldb, c + j, ldc, kc, mask, width == kWidePanel, k0 == 0);
        } else {
          micro_wide<1>(a + k0, lda, b + k0 * ldb + j, ldb, c + j, ldc, kc, mask, width == kWidePanel, k0 == 0);
        }
      }
    }
    return;
  }
  for (size_t k0 = 0; k0 < k; k0 += kTTDepthBlock) {
    const size_t kc = k - k0 < kTTDepthBlock ? k - k0 : kTTDepthBlock;
    const bool first = k0 == 0;
    for (size_t j = 0; j < n; j += kTTPanel) {
      const size_t width = n - j < kTTPanel ? n - j : kTTPanel;
      const __m256i m0 = tail_mask(width);
      const __m256i m1 = width > 8 ? tail_mask(width - 8) : _mm256_setzero_si256();
      const float* bp = b + k0 * ldb + j;
      if (width == kTTPanel) {
        panel_rows<true>(a, lda, bp, ldb, c + j, ldc, m, k0, kc, m0, m1, first);
      } else {
        panel_rows<false>(a, lda, bp, ldb, c + j, ldc, m, k0, kc, m0, m1, first);
      }
    }
  }
}

}  // namespace

const TTKernels& tt_kernels_avx2() {
  static const TTKernels table{gemm_avx2};
  return table;
}

}  // namespace ortsparse::kernels
