// AVX2 + FMA kernels. Compiled with -mavx2 -mfma; only called when the CPU has them.
#include <immintrin.h>

#include <cmath>

#include "kernels/exp_avx2.h"
#include "kernels/exp_generic.h"
#include "kernels/matmul_kernels.h"
#include "kernels/order_key.h"

namespace ortsparse::kernels {
namespace {

inline size_t row_of(const int32_t* rows, size_t i) { return rows ? static_cast<size_t>(rows[i]) : i; }

// Lane mask for the first `count` (< 8) floats, for maskload/maskstore tails.
inline __m256i tail_mask(size_t count) {
  alignas(32) static const int32_t ramp[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ramp + 8 - count));
}

template <int R>
inline void gemv_group(const float* const* wr, const float* a, float* y, size_t n) {
  __m256 av[R];
  for (int r = 0; r < R; ++r) av[r] = _mm256_set1_ps(a[r]);
  size_t j = 0;
  for (; j + 16 <= n; j += 16) {
    __m256 y0 = _mm256_loadu_ps(y + j);
    __m256 y1 = _mm256_loadu_ps(y + j + 8);
    for (int r = 0; r < R; ++r) {
      y0 = _mm256_fmadd_ps(av[r], _mm256_loadu_ps(wr[r] + j), y0);
      y1 = _mm256_fmadd_ps(av[r], _mm256_loadu_ps(wr[r] + j + 8), y1);
    }
    _mm256_storeu_ps(y + j, y0);
    _mm256_storeu_ps(y + j + 8, y1);
  }
  for (; j + 8 <= n; j += 8) {
    __m256 y0 = _mm256_loadu_ps(y + j);
    for (int r = 0; r < R; ++r) y0 = _mm256_fmadd_ps(av[r], _mm256_loadu_ps(wr[r] + j), y0);
    _mm256_storeu_ps(y + j, y0);
  }
  if (j < n) {
    const __m256i m = tail_mask(n - j);
    __m256 y0 = _mm256_maskload_ps(y + j, m);
    for (int r = 0; r < R; ++r) y0 = _mm256_fmadd_ps(av[r], _mm256_maskload_ps(wr[r] + j, m), y0);
    _mm256_maskstore_ps(y + j, m, y0);
  }
}

void gemv_rows_avx2(const float* w, size_t ldw, const int32_t* rows, const float* xv, size_t nrows,
                    float* y, size_t n, bool accumulate) {
  if (!accumulate) {
    for (size_t j = 0; j < n; ++j) y[j] = 0.0f;
  }
  const float* wr[16];
  size_t i = 0;
  for (; i + 16 <= nrows; i += 16) {
    for (int r = 0; r < 16; ++r) wr[r] = w + row_of(rows, i + r) * ldw;
    gemv_group<16>(wr, xv + i, y, n);
  }
  for (; i + 8 <= nrows; i += 8) {
    for (int r = 0; r < 8; ++r) wr[r] = w + row_of(rows, i + r) * ldw;
    gemv_group<8>(wr, xv + i, y, n);
  }
  if (i + 4 <= nrows) {
    for (int r = 0; r < 4; ++r) wr[r] = w + row_of(rows, i + r) * ldw;
    gemv_group<4>(wr, xv + i, y, n);
    i += 4;
  }
  for (; i < nrows; ++i) {
    wr[0] = w + row_of(rows, i) * ldw;
    gemv_group<1>(wr, xv + i, y, n);
  }
}

// Four tokens x 16 columns in 8 named registers (an array of __m256 accumulators gets spilled).
template <bool kRowList>
void gemm_chunk(const float* w, size_t ldw, const int32_t* rows, const float* xv, size_t nrows,
                float* y, size_t ldy, size_t ncols, bool accumulate) {
  const __m256i m0 = ncols >= 8 ? _mm256_set1_epi32(-1) : tail_mask(ncols);
  const __m256i m1 = ncols >= 16 ? _mm256_set1_epi32(-1) : (ncols > 8 ? tail_mask(ncols - 8) : _mm256_setzero_si256());
#define ORTSPARSE_LOAD_ACC(t)                                                                 \
  __m256 c##t##0 = accumulate ? _mm256_maskload_ps(y + t * ldy, m0) : _mm256_setzero_ps();   \
  __m256 c##t##1 = accumulate ? _mm256_maskload_ps(y + t * ldy + 8, m1) : _mm256_setzero_ps();
  ORTSPARSE_LOAD_ACC(0)
  ORTSPARSE_LOAD_ACC(1)
  ORTSPARSE_LOAD_ACC(2)
  ORTSPARSE_LOAD_ACC(3)
#undef ORTSPARSE_LOAD_ACC
  for (size_t i = 0; i < nrows; ++i) {
    const float* wr = w + (kRowList ? static_cast<size_t>(rows[i]) : i) * ldw;
    const __m256 w0 = _mm256_maskload_ps(wr, m0);
    const __m256 w1 = _mm256_maskload_ps(wr + 8, m1);
    const float* a = xv + i * kTokenTile;
#define ORTSPARSE_FMA_TOKEN(t)                 \
  {                                            \
    const __m256 at = _mm256_broadcast_ss(a + t); \
    c##t##0 = _mm256_fmadd_ps(at, w0, c##t##0); \
    c##t##1 = _mm256_fmadd_ps(at, w1, c##t##1); \
  }
    ORTSPARSE_FMA_TOKEN(0)
    ORTSPARSE_FMA_TOKEN(1)
    ORTSPARSE_FMA_TOKEN(2)
    ORTSPARSE_FMA_TOKEN(3)
#undef ORTSPARSE_FMA_TOKEN
  }
#define ORTSPARSE_STORE_ACC(t)                          \
  _mm256_maskstore_ps(y + t * ldy, m0, c##t##0);        \
  _mm256_maskstore_ps(y + t * ldy + 8, m1, c##t##1);
  ORTSPARSE_STORE_ACC(0)
  ORTSPARSE_STORE_ACC(1)
  ORTSPARSE_STORE_ACC(2)
  ORTSPARSE_STORE_ACC(3)
#undef ORTSPARSE_STORE_ACC
}

static_assert(kTokenTile == 4, "gemm_chunk holds exactly four tokens");

void gemm_rows_avx2(const float* w, size_t ldw, const int32_t* rows, const float* xv, size_t nrows,
                    float* y, size_t ldy, size_t n, bool accumulate) {
  for (size_t j = 0; j < n; j += 16) {
    const size_t width = n - j < 16 ? n - j : 16;
    if (rows) {
      gemm_chunk<true>(w + j, ldw, rows, xv, nrows, y + j, ldy, width, accumulate);
    } else {
      gemm_chunk<false>(w + j, ldw, rows, xv, nrows, y + j, ldy, width, accumulate);
    }
  }
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256 abs_ps(__m256 v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v); }

template <bool kSquare>
void block_reduce(const float* x, size_t k, size_t block, float* out) {
  if (block == 1) {
    size_t j = 0;
    for (; j + 8 <= k; j += 8) {
      const __m256 v = _mm256_loadu_ps(x + j);
      _mm256_storeu_ps(out + j, kSquare ? _mm256_mul_ps(v, v) : abs_ps(v));
    }
    for (; j < k; ++j) out[j] = kSquare ? x[j] * x[j] : std::fabs(x[j]);
    return;
  }
  for (size_t b = 0, start = 0; start < k; ++b, start += block) {
    const size_t end = start + block < k ? start + block : k;
    __m256 acc = _mm256_setzero_ps();
    size_t j = start;
    for (; j + 8 <= end; j += 8) {
      const __m256 v = _mm256_loadu_ps(x + j);
      acc = kSquare ? _mm256_fmadd_ps(v, v, acc) : _mm256_add_ps(acc, abs_ps(v));
    }
    if (j < end) {
      const __m256 v = _mm256_maskload_ps(x + j, tail_mask(end - j));
      acc = kSquare ? _mm256_fmadd_ps(v, v, acc) : _mm256_add_ps(acc, abs_ps(v));
    }
    out[b] = hsum(acc);
  }
}

void block_sumsq_avx2(const float* x, size_t k, size_t block, float* out) { block_reduce<true>(x, k, block, out); }
void block_sumabs_avx2(const float* x, size_t k, size_t block, float* out) { block_reduce<false>(x, k, block, out); }

inline __m256i order_keys8(__m256i bits) {
  const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  bits = _mm256_andnot_si256(_mm256_cmpeq_epi32(bits, sign), bits);  // -0 -> +0
  const __m256i negative = _mm256_srai_epi32(bits, 31);
  const __m256i key = _mm256_xor_si256(bits, _mm256_or_si256(negative, sign));
  // NaN: magnitude above the +inf pattern (signed compare is fine: magnitudes are < 2^31).
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF)),
                                         _mm256_set1_epi32(0x7F800000));
  return _mm256_or_si256(key, nan);
}

void order_keys_avx2(const float* values, size_t n, uint32_t* keys, uint32_t* min_key, uint32_t* max_key) {
  __m256i lo = _mm256_set1_epi32(-1), hi = _mm256_setzero_si256();
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i k = order_keys8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(values + i)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(keys + i), k);
    lo = _mm256_min_epu32(lo, k);
    hi = _mm256_max_epu32(hi, k);
  }
  alignas(32) uint32_t lanes_lo[8], lanes_hi[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes_lo), lo);
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes_hi), hi);
  uint32_t low = 0xFFFFFFFFu, high = 0;
  for (int l = 0; l < 8; ++l) {
    low = lanes_lo[l] < low ? lanes_lo[l] : low;
    high = lanes_hi[l] > high ? lanes_hi[l] : high;
  }
  for (; i < n; ++i) {
    keys[i] = order_key(values[i]);
    low = keys[i] < low ? keys[i] : low;
    high = keys[i] > high ? keys[i] : high;
  }
  *min_key = low;
  *max_key = high;
}

// Unsigned a >= b on 32-bit lanes: max(a, b) == a.
inline __m256i cmpge_epu32(__m256i a, __m256i b) { return _mm256_cmpeq_epi32(_mm256_max_epu32(a, b), a); }

size_t count_at_least_avx2(const uint32_t* keys, size_t n, uint32_t t) {
  const __m256i tv = _mm256_set1_epi32(static_cast<int>(t));
  size_t count = 0;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i ge = cmpge_epu32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(keys + i)), tv);
    count += __builtin_popcount(_mm256_movemask_ps(_mm256_castsi256_ps(ge)));
  }
  for (; i < n; ++i) count += keys[i] >= t;
  return count;
}

size_t indices_in_range_avx2(const uint32_t* keys, size_t n, uint32_t lo, uint32_t hi, int32_t* out) {
  const __m256i lov = _mm256_set1_epi32(static_cast<int>(lo));
  const __m256i hiv = _mm256_set1_epi32(static_cast<int>(hi));
  size_t count = 0;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(keys + i));
    const __m256i in = _mm256_and_si256(cmpge_epu32(v, lov), cmpge_epu32(hiv, v));
    unsigned bits = static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(in)));
    while (bits) {
      out[count++] = static_cast<int32_t>(i + __builtin_ctz(bits));
      bits &= bits - 1;
    }
  }
  for (; i < n; ++i)
    if (keys[i] >= lo && keys[i] <= hi) out[count++] = static_cast<int32_t>(i);
  return count;
}

// generic::silu_times on 8 lanes (-|g| by setting the sign bit, as -fabs); the tail is the scalar twin.
void silu_glu_avx2(const float* gate, const float* up, size_t n, float* out) {
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = avx2::exp8(_mm256_or_ps(g, sign));
    const __m256 nonneg = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_GE_OQ);
    const __m256 sigmoid = _mm256_div_ps(_mm256_blendv_ps(e, one, nonneg), _mm256_add_ps(one, e));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(g, sigmoid), _mm256_loadu_ps(up + i)));
  }
  for (; i < n; ++i) out[i] = generic::silu_times(gate[i], up[i]);
}

}  // namespace

const MatMulKernels& matmul_kernels_avx2() {
  static const MatMulKernels table{gemv_rows_avx2, gemm_rows_avx2, block_sumsq_avx2, block_sumabs_avx2,
                                   silu_glu_avx2};
  return table;
}

const SelectKernels& select_kernels_avx2() {
  static const SelectKernels table{order_keys_avx2, count_at_least_avx2, indices_in_range_avx2};
  return table;
}

}  // namespace ortsparse::kernels
