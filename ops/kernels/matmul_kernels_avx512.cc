// AVX-512 (F/BW/VL/DQ) kernels. Compiled with -mavx512*; only called when the CPU has them.
#include <immintrin.h>

#include <cmath>

#include "kernels/exp_avx512.h"
#include "kernels/matmul_kernels.h"
#include "kernels/order_key.h"

namespace ortsparse::kernels {
namespace {

inline size_t row_of(const int32_t* rows, size_t i) { return rows ? static_cast<size_t>(rows[i]) : i; }
inline __mmask16 tail_mask(size_t count) { return static_cast<__mmask16>((1u << count) - 1u); }

// R rows at once: y is loaded and stored once per R rows, the W rows stream side by side.
// 16 rows measured best out of cache (1536x576, M=1: 0.80x ORT at 8 rows, 0.94x at 16, 0.51x at 32).
template <int R>
inline void gemv_group(const float* const* wr, const float* a, float* y, size_t n) {
  __m512 av[R];
  for (int r = 0; r < R; ++r) av[r] = _mm512_set1_ps(a[r]);
  size_t j = 0;
  for (; j + 32 <= n; j += 32) {
    __m512 y0 = _mm512_loadu_ps(y + j);
    __m512 y1 = _mm512_loadu_ps(y + j + 16);
    for (int r = 0; r < R; ++r) {
      y0 = _mm512_fmadd_ps(av[r], _mm512_loadu_ps(wr[r] + j), y0);
      y1 = _mm512_fmadd_ps(av[r], _mm512_loadu_ps(wr[r] + j + 16), y1);
    }
    _mm512_storeu_ps(y + j, y0);
    _mm512_storeu_ps(y + j + 16, y1);
  }
  for (; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? static_cast<__mmask16>(0xFFFF) : tail_mask(n - j);
    __m512 y0 = _mm512_maskz_loadu_ps(m, y + j);
    for (int r = 0; r < R; ++r) y0 = _mm512_fmadd_ps(av[r], _mm512_maskz_loadu_ps(m, wr[r] + j), y0);
    _mm512_mask_storeu_ps(y + j, m, y0);
  }
}

void gemv_rows_avx512(const float* w, size_t ldw, const int32_t* rows, const float* xv, size_t nrows,
                      float* y, size_t n, bool accumulate) {
  if (!accumulate) {
    size_t j = 0;
    for (; j + 16 <= n; j += 16) _mm512_storeu_ps(y + j, _mm512_setzero_ps());
    if (j < n) _mm512_mask_storeu_ps(y + j, tail_mask(n - j), _mm512_setzero_ps());
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

// Four tokens x 64 columns in 16 named registers over the whole row list (GCC spills an array
// of __m512 accumulators to the stack every iteration, 3x slower).
template <bool kRowList>
void gemm_chunk(const float* w, size_t ldw, const int32_t* rows, const float* xv, size_t nrows, float* y,
                size_t ldy, size_t ncols, bool accumulate) {
  auto mask_for = [ncols](size_t start) -> __mmask16 {
    return ncols >= start + 16 ? static_cast<__mmask16>(0xFFFF)
                               : (ncols > start ? tail_mask(ncols - start) : static_cast<__mmask16>(0));
  };
  const __mmask16 m0 = mask_for(0), m1 = mask_for(16), m2 = mask_for(32), m3 = mask_for(48);
#define ORTSPARSE_LOAD_ACC(t)                                                                     \
  __m512 c##t##0 = accumulate ? _mm512_maskz_loadu_ps(m0, y + t * ldy) : _mm512_setzero_ps();      \
  __m512 c##t##1 = accumulate ? _mm512_maskz_loadu_ps(m1, y + t * ldy + 16) : _mm512_setzero_ps(); \
  __m512 c##t##2 = accumulate ? _mm512_maskz_loadu_ps(m2, y + t * ldy + 32) : _mm512_setzero_ps(); \
  __m512 c##t##3 = accumulate ? _mm512_maskz_loadu_ps(m3, y + t * ldy + 48) : _mm512_setzero_ps();
  ORTSPARSE_LOAD_ACC(0)
  ORTSPARSE_LOAD_ACC(1)
  ORTSPARSE_LOAD_ACC(2)
  ORTSPARSE_LOAD_ACC(3)
#undef ORTSPARSE_LOAD_ACC
  for (size_t i = 0; i < nrows; ++i) {
    const float* wr = w + (kRowList ? static_cast<size_t>(rows[i]) : i) * ldw;
    const __m512 w0 = _mm512_maskz_loadu_ps(m0, wr), w1 = _mm512_maskz_loadu_ps(m1, wr + 16);
    const __m512 w2 = _mm512_maskz_loadu_ps(m2, wr + 32), w3 = _mm512_maskz_loadu_ps(m3, wr + 48);
    const float* a = xv + i * kTokenTile;
#define ORTSPARSE_FMA_TOKEN(t)                 \
  {                                            \
    const __m512 at = _mm512_set1_ps(a[t]);    \
    c##t##0 = _mm512_fmadd_ps(at, w0, c##t##0); \
    c##t##1 = _mm512_fmadd_ps(at, w1, c##t##1); \
    c##t##2 = _mm512_fmadd_ps(at, w2, c##t##2); \
    c##t##3 = _mm512_fmadd_ps(at, w3, c##t##3); \
  }
    ORTSPARSE_FMA_TOKEN(0)
    ORTSPARSE_FMA_TOKEN(1)
    ORTSPARSE_FMA_TOKEN(2)
    ORTSPARSE_FMA_TOKEN(3)
#undef ORTSPARSE_FMA_TOKEN
  }
#define ORTSPARSE_STORE_ACC(t)                                 \
  _mm512_mask_storeu_ps(y + t * ldy, m0, c##t##0);             \
  _mm512_mask_storeu_ps(y + t * ldy + 16, m1, c##t##1);        \
  _mm512_mask_storeu_ps(y + t * ldy + 32, m2, c##t##2);        \
  _mm512_mask_storeu_ps(y + t * ldy + 48, m3, c##t##3);
  ORTSPARSE_STORE_ACC(0)
  ORTSPARSE_STORE_ACC(1)
  ORTSPARSE_STORE_ACC(2)
  ORTSPARSE_STORE_ACC(3)
#undef ORTSPARSE_STORE_ACC
}

static_assert(kTokenTile == 4, "gemm_chunk holds exactly four tokens");

void gemm_rows_avx512(const float* w, size_t ldw, const int32_t* rows, const float* xv, size_t nrows,
                      float* y, size_t ldy, size_t n, bool accumulate) {
  for (size_t j = 0; j < n; j += 64) {
    const size_t width = n - j < 64 ? n - j : 64;
    if (rows) {
      gemm_chunk<true>(w + j, ldw, rows, xv, nrows, y + j, ldy, width, accumulate);
    } else {
      gemm_chunk<false>(w + j, ldw, rows, xv, nrows, y + j, ldy, width, accumulate);
    }
  }
}

void block_sumsq_avx512(const float* x, size_t k, size_t block, float* out) {
  if (block == 1) {
    size_t j = 0;
    for (; j + 16 <= k; j += 16) {
      const __m512 v = _mm512_loadu_ps(x + j);
      _mm512_storeu_ps(out + j, _mm512_mul_ps(v, v));
    }
    if (j < k) {
      const __mmask16 m = tail_mask(k - j);
      const __m512 v = _mm512_maskz_loadu_ps(m, x + j);
      _mm512_mask_storeu_ps(out + j, m, _mm512_mul_ps(v, v));
    }
    return;
  }
  for (size_t b = 0, start = 0; start < k; ++b, start += block) {
    const size_t end = start + block < k ? start + block : k;
    __m512 acc = _mm512_setzero_ps();
    size_t j = start;
    for (; j + 16 <= end; j += 16) {
      const __m512 v = _mm512_loadu_ps(x + j);
      acc = _mm512_fmadd_ps(v, v, acc);
    }
    if (j < end) {
      const __m512 v = _mm512_maskz_loadu_ps(tail_mask(end - j), x + j);
      acc = _mm512_fmadd_ps(v, v, acc);
    }
    out[b] = _mm512_reduce_add_ps(acc);
  }
}

void block_sumabs_avx512(const float* x, size_t k, size_t block, float* out) {
  if (block == 1) {
    size_t j = 0;
    for (; j + 16 <= k; j += 16) _mm512_storeu_ps(out + j, _mm512_abs_ps(_mm512_loadu_ps(x + j)));
    if (j < k) {
      const __mmask16 m = tail_mask(k - j);
      _mm512_mask_storeu_ps(out + j, m, _mm512_abs_ps(_mm512_maskz_loadu_ps(m, x + j)));
    }
    return;
  }
  for (size_t b = 0, start = 0; start < k; ++b, start += block) {
    const size_t end = start + block < k ? start + block : k;
    __m512 acc = _mm512_setzero_ps();
    size_t j = start;
    for (; j + 16 <= end; j += 16) acc = _mm512_add_ps(acc, _mm512_abs_ps(_mm512_loadu_ps(x + j)));
    if (j < end) acc = _mm512_add_ps(acc, _mm512_abs_ps(_mm512_maskz_loadu_ps(tail_mask(end - j), x + j)));
    out[b] = _mm512_reduce_add_ps(acc);
  }
}

// order_key, 16 lanes at a time (same selects as the scalar definition).
inline __m512i order_keys16(__m512i bits) {
  const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(bits, sign), _mm512_setzero_si512());
  const __mmask16 negative = _mm512_test_epi32_mask(bits, sign);
  __m512i key = _mm512_mask_mov_epi32(_mm512_or_si512(bits, sign), negative,
                                      _mm512_xor_si512(bits, _mm512_set1_epi32(-1)));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF)),
                                                _mm512_set1_epi32(0x7F800000));
  return _mm512_mask_mov_epi32(key, nan, _mm512_set1_epi32(-1));
}

void order_keys_avx512(const float* values, size_t n, uint32_t* keys, uint32_t* min_key, uint32_t* max_key) {
  __m512i lo = _mm512_set1_epi32(-1), hi = _mm512_setzero_si512();
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i k = order_keys16(_mm512_loadu_si512(values + i));
    _mm512_storeu_si512(keys + i, k);
    lo = _mm512_min_epu32(lo, k);
    hi = _mm512_max_epu32(hi, k);
  }
  if (i < n) {
    const __mmask16 m = tail_mask(n - i);
    const __m512i k = order_keys16(_mm512_maskz_loadu_epi32(m, values + i));
    _mm512_mask_storeu_epi32(keys + i, m, k);
    lo = _mm512_mask_min_epu32(lo, m, lo, k);
    hi = _mm512_mask_max_epu32(hi, m, hi, k);
  }
  *min_key = static_cast<uint32_t>(_mm512_reduce_min_epu32(lo));
  *max_key = static_cast<uint32_t>(_mm512_reduce_max_epu32(hi));
}

size_t count_at_least_avx512(const uint32_t* keys, size_t n, uint32_t t) {
  const __m512i tv = _mm512_set1_epi32(static_cast<int>(t));
  size_t count = 0;
  size_t i = 0;
  for (; i + 16 <= n; i += 16)
    count += __builtin_popcount(_mm512_cmpge_epu32_mask(_mm512_loadu_si512(keys + i), tv));
  if (i < n) {
    const __mmask16 m = tail_mask(n - i);
    count += __builtin_popcount(_mm512_mask_cmpge_epu32_mask(m, _mm512_maskz_loadu_epi32(m, keys + i), tv));
  }
  return count;
}

size_t indices_in_range_avx512(const uint32_t* keys, size_t n, uint32_t lo, uint32_t hi, int32_t* out) {
  const __m512i lov = _mm512_set1_epi32(static_cast<int>(lo));
  const __m512i hiv = _mm512_set1_epi32(static_cast<int>(hi));
  __m512i index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  size_t count = 0;
  for (size_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? static_cast<__mmask16>(0xFFFF) : tail_mask(n - i);
    const __m512i v = _mm512_maskz_loadu_epi32(m, keys + i);
    const __mmask16 hit = _mm512_mask_cmple_epu32_mask(_mm512_mask_cmpge_epu32_mask(m, v, lov), v, hiv);
    // Compress in a register and store all 16 lanes: compress-to-memory is microcoded and slow
    // on some CPUs (AMD Zen 4). Hence the 16 entries of slack the caller provides.
    _mm512_storeu_si512(out + count, _mm512_maskz_compress_epi32(hit, index));
    count += __builtin_popcount(hit);
    index = _mm512_add_epi32(index, step);
  }
  return count;
}

// generic::silu_times on 16 lanes; -|g| by setting the sign bit (as -fabs: -0 for 0, NaN stays NaN).
void silu_glu_avx512(const float* gate, const float* up, size_t n, float* out) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512i sign = _mm512_set1_epi32(INT32_MIN);
  for (size_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? static_cast<__mmask16>(0xFFFF) : tail_mask(n - i);
    const __m512 g = _mm512_maskz_loadu_ps(m, gate + i);
    const __m512 e = avx512::exp16(_mm512_castsi512_ps(_mm512_or_epi32(_mm512_castps_si512(g), sign)));
    const __mmask16 nonneg = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_GE_OQ);
    const __m512 sigmoid = _mm512_div_ps(_mm512_mask_blend_ps(nonneg, e, one), _mm512_add_ps(one, e));
    _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(_mm512_mul_ps(g, sigmoid), _mm512_maskz_loadu_ps(m, up + i)));
  }
}

}  // namespace

const MatMulKernels& matmul_kernels_avx512() {
  static const MatMulKernels table{gemv_rows_avx512, gemm_rows_avx512, block_sumsq_avx512, block_sumabs_avx512,
                                   silu_glu_avx512};
  return table;
}

const SelectKernels& select_kernels_avx512() {
  static const SelectKernels table{order_keys_avx512, count_at_least_avx512, indices_in_range_avx512};
  return table;
}

}  // namespace ortsparse::kernels
