// AVX-512F; only called when the CPU has it.
#include <immintrin.h>

#include <algorithm>

#include "kernels/attention_kernels.h"
#include "kernels/exp_generic.h"
#include "kernels/exp_avx512.h"
#include "kernels/flash_generic.h"
#include "kernels/rotary_generic.h"

namespace ortsparse::kernels {

namespace {

inline __mmask16 tail_mask(size_t count) { return static_cast<__mmask16>((1u << count) - 1u); }

// Four rows per step: q is loaded once for the four, and the four accumulators are reduced
// together (two lane shuffles and two in-lane adds per four rows instead of a full reduction per row).
inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  __m512 s = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  s = _mm512_add_ps(s, _mm512_permute_ps(s, 0xB1));
  s = _mm512_add_ps(s, _mm512_permute_ps(s, 0x4E));
  return _mm512_castps512_ps128(_mm512_maskz_compress_ps(0x1111, s));
}

void dot_rows_avx512(const float* q, const float* k, size_t ldk, size_t d, const int32_t* rows, size_t n, float* out) {
  constexpr size_t kAhead = 16;  // rows prefetched ahead
  auto row = [&](size_t i) { return k + (rows ? static_cast<size_t>(rows[i]) : i) * ldk; };
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    // Rows ahead into L1: a gathered list has no stride to predict, and a strided stream of short
    // rows (a KV-cache head) outruns the hardware prefetcher.
    if (i + kAhead + 4 <= n) {
      for (size_t r = 0; r < 4; ++r) {
        const char* next = reinterpret_cast<const char*>(row(i + kAhead + r));
        for (size_t b = 0; b < d * sizeof(float); b += 64) _mm_prefetch(next + b, _MM_HINT_T0);
      }
    }
    const float *k0 = row(i), *k1 = row(i + 1), *k2 = row(i + 2), *k3 = row(i + 3);
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    for (size_t j = 0; j < d; j += 16) {
      const __mmask16 m = d - j >= 16 ? static_cast<__mmask16>(0xFFFF) : tail_mask(d - j);
      const __m512 qv = _mm512_maskz_loadu_ps(m, q + j);
      a0 = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(m, k0 + j), a0);
      a1 = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(m, k1 + j), a1);
      a2 = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(m, k2 + j), a2);
      a3 = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(m, k3 + j), a3);
    }
    _mm_storeu_ps(out + i, reduce4(a0, a1, a2, a3));
  }
  for (; i < n; ++i) {
    const float* kr = row(i);
    __m512 a0 = _mm512_setzero_ps();
    for (size_t j = 0; j < d; j += 16) {
      const __mmask16 m = d - j >= 16 ? static_cast<__mmask16>(0xFFFF) : tail_mask(d - j);
      a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q + j), _mm512_maskz_loadu_ps(m, kr + j), a0);
    }
    // Reduced in reduce4's order, so a row's dot does not depend on where it falls in the list: equal
    // keys score equal (ties go to the lower key) and a page bound is the same bits alone or in a list.
    const __m512 zero = _mm512_setzero_ps();
    out[i] = _mm_cvtss_f32(reduce4(a0, zero, zero, zero));
  }
}

double exp_sub_avx512(const float* x, size_t n, float shift, float* out) {
  const __m512 s = _mm512_set1_ps(shift);
  __m512d acc0 = _mm512_setzero_pd(), acc1 = _mm512_setzero_pd();
  for (size_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? static_cast<__mmask16>(0xFFFF) : tail_mask(n - i);
    const __m512 e = avx512::exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + i), s));
    _mm512_mask_storeu_ps(out + i, m, e);
    const __m512 z = _mm512_maskz_mov_ps(m, e);
    acc0 = _mm512_add_pd(acc0, _mm512_cvtps_pd(_mm512_castps512_ps256(z)));
    acc1 = _mm512_add_pd(acc1, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(z), 1))));
  }
  return _mm512_reduce_add_pd(_mm512_add_pd(acc0, acc1));
}

inline __m512d abs_sum_pd(__m512 a, __m512d acc) {
  acc = _mm512_add_pd(acc, _mm512_cvtps_pd(_mm512_castps512_ps256(a)));
  return _mm512_add_pd(acc, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1))));
}

// 16 entries per compare: the compare masks are the bits. Padding lanes load as 0, which is never
// active in any mode (eps >= 0).
float pack_row_avx512(const float* x, size_t d, int mode, float eps, uint64_t* out, size_t stride, uint64_t* bits_set) {
  const size_t words = (d + 63) / 64;
  const __m512 zero = _mm512_setzero_ps(), veps = _mm512_set1_ps(eps), vneg = _mm512_set1_ps(-eps);
  __m512d sum = _mm512_setzero_pd();
  uint64_t active = 0;
  for (size_t w = 0; w < words; ++w) {
    uint64_t pos = 0, neg = 0;
    for (size_t c = 0; c < 4; ++c) {
      const size_t i = w * 64 + c * 16;
      if (i >= d) break;
      const __mmask16 m = d - i >= 16 ? static_cast<__mmask16>(0xFFFF) : tail_mask(d - i);
      const __m512 v = _mm512_maskz_loadu_ps(m, x + i);
      const __m512 a = _mm512_abs_ps(v);
      __mmask16 p, n = 0;
      if (mode == 1) {
        p = _mm512_cmp_ps_mask(v, zero, _CMP_GT_OQ);
        sum = abs_sum_pd(a, sum);
      } else {
        if (mode == 2) {
          p = _mm512_cmp_ps_mask(a, veps, _CMP_GT_OQ);
        } else {
          p = _mm512_cmp_ps_mask(v, veps, _CMP_GT_OQ);
          n = _mm512_cmp_ps_mask(v, vneg, _CMP_LT_OQ);
        }
        sum = abs_sum_pd(_mm512_maskz_mov_ps(static_cast<__mmask16>(p | n), a), sum);
        active += static_cast<uint64_t>(__builtin_popcount(static_cast<unsigned>(p | n)));
      }
      pos |= static_cast<uint64_t>(p) << (16 * c);
      neg |= static_cast<uint64_t>(n) << (16 * c);
    }
    out[w * stride] = pos;
    if (mode == 3) out[(words + w) * stride] = neg;
    *bits_set += static_cast<uint64_t>(__builtin_popcountll(pos) + __builtin_popcountll(neg));
  }
  const double total = _mm512_reduce_add_pd(sum);
  if (mode == 1) return d ? static_cast<float>(total / static_cast<double>(d)) : 0.0f;
  return active ? static_cast<float>(total / static_cast<double>(active)) : eps;
}

// NH over 16 words per step: (m + k) as 8 64-bit lanes of word pairs, one 32x32->64 multiply of
// each lane's low and high halves. Full 16-word chunks load unmasked; the tail loads words past d
// as 0 from x and past the padded pair as 0 from the key, so masked-off pairs add 0 exactly like
// the scalar loop's zero padding.
void nh_step_avx512(__m512i w, __m512i k0, __m512i k1, __m512i& h0, __m512i& h1) {
  const __m512i a0 = _mm512_add_epi32(w, k0), a1 = _mm512_add_epi32(w, k1);
  h0 = _mm512_add_epi64(h0, _mm512_mul_epu32(a0, _mm512_srli_epi64(a0, 32)));
  h1 = _mm512_add_epi64(h1, _mm512_mul_epu32(a1, _mm512_srli_epi64(a1, 32)));
}

// Lanes summed as unsigned (mod 2^64) in registers: GCC's _mm512_reduce_add_epi64 adds signed
// long longs, whose wrap-around is undefined behaviour (UBSan reports it).
uint64_t lane_sum_u64(__m512i h) {
  const __m256i s = _mm256_add_epi64(_mm512_castsi512_si256(h), _mm512_extracti64x4_epi64(h, 1));
  const __m128i t = _mm_add_epi64(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  return static_cast<uint64_t>(_mm_cvtsi128_si64(t)) + static_cast<uint64_t>(_mm_extract_epi64(t, 1));
}

// The key cache hashes K rows one after another: prefetching the bytes 2 KiB ahead (8 rows of
// D = 64) keeps the stream at memory bandwidth (3.7x faster on 3 MiB of out-of-cache rows than
// without; a prefetch never faults, so reading past the buffer's end is harmless).
constexpr size_t kHashPrefetchBytes = 2048;

void row_hash_avx512(const float* x, size_t d, const uint32_t* key, uint64_t* out) {
  const uint32_t* m = reinterpret_cast<const uint32_t*>(x);
  const size_t padded = (d + 1) / 2 * 2;
  for (size_t p = 0; p < d; p += 16)
    _mm_prefetch(reinterpret_cast<const char*>(m + p) + kHashPrefetchBytes, _MM_HINT_T0);
  __m512i h0 = _mm512_setzero_si512(), h1 = _mm512_setzero_si512();
  size_t i = 0;
  for (; i + 16 <= d; i += 16)
    nh_step_avx512(_mm512_loadu_si512(m + i), _mm512_loadu_si512(key + i), _mm512_loadu_si512(key + i + 2), h0, h1);
  if (i < padded) {
    const __mmask16 mm = static_cast<__mmask16>((1u << (d - i)) - 1u);
    const __mmask16 mk = static_cast<__mmask16>((1u << (padded - i)) - 1u);
    nh_step_avx512(_mm512_maskz_loadu_epi32(mm, m + i), _mm512_maskz_loadu_epi32(mk, key + i),
                   _mm512_maskz_loadu_epi32(mk, key + i + 2), h0, h1);
  }
  out[0] = lane_sum_u64(h0);
  out[1] = lane_sum_u64(h1);
}

// The tiled prompt step for R query rows: their q·k for the tile's 64 keys (4·R accumulators, one
// K^T row load serves the R rows), the softmax update, then their P·V in 64-wide column chunks
// (4·R accumulators, one V row load serves the R rows).
template <size_t R>
void flash_rows_avx512(const FlashTile& t, size_t r0) {
  constexpr size_t K = kFlashKeys, NV = K / 16;
  static_assert(NV == 4, "kFlashKeys is four AVX-512 vectors");
  __m512 acc[R][NV];
  for (size_t i = 0; i < R; ++i)
    for (size_t v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
  const float* q = t.q + r0 * t.d;
  for (size_t c = 0; c < t.d; ++c) {
    const float* kr = t.kt + c * K;
    const __m512 k0 = _mm512_loadu_ps(kr), k1 = _mm512_loadu_ps(kr + 16), k2 = _mm512_loadu_ps(kr + 32),
                 k3 = _mm512_loadu_ps(kr + 48);
    for (size_t i = 0; i < R; ++i) {
      const __m512 qb = _mm512_set1_ps(q[i * t.d + c]);
      acc[i][0] = _mm512_fmadd_ps(qb, k0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(qb, k1, acc[i][1]);
      acc[i][2] = _mm512_fmadd_ps(qb, k2, acc[i][2]);
      acc[i][3] = _mm512_fmadd_ps(qb, k3, acc[i][3]);
    }
  }
  const bool generic_scores = t.softcap > 0.0f || t.bias != nullptr;
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 neg_inf = _mm512_set1_ps(generic::kFlashNegInf);
  float alpha[R];
  bool live[R];
  for (size_t i = 0; i < R; ++i) {
    const size_t r = r0 + i;
    float* s = t.scores + r * K;
    __m512 sv[NV];
    if (generic_scores) {
      for (size_t v = 0; v < NV; ++v) _mm512_storeu_ps(s + 16 * v, acc[i][v]);
      generic::flash_finish_scores(t, r, s);
      for (size_t v = 0; v < NV; ++v) sv[v] = _mm512_loadu_ps(s + 16 * v);
    } else {
      const size_t lo = t.lo ? static_cast<size_t>(t.lo[r]) : 0;
      const size_t hi = std::min(t.n, t.lo ? static_cast<size_t>(t.hi[r]) : t.n);
      const __m512 vlo = _mm512_set1_ps(static_cast<float>(lo)), vhi = _mm512_set1_ps(static_cast<float>(hi));
      const __m512 scale = _mm512_set1_ps(t.scale);
      for (size_t v = 0; v < NV; ++v) {
        const __m512 j = _mm512_add_ps(iota, _mm512_set1_ps(static_cast<float>(16 * v)));
        const __mmask16 in = _mm512_cmp_ps_mask(j, vlo, _CMP_GE_OQ) & _mm512_cmp_ps_mask(j, vhi, _CMP_LT_OQ);
        sv[v] = _mm512_mask_mul_ps(neg_inf, in, acc[i][v], scale);
      }
    }
    const float tile_max =
        _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(sv[0], sv[1]), _mm512_max_ps(sv[2], sv[3])));
    const float new_max = generic::flash_new_max(t, r, tile_max);
    live[i] = new_max != generic::kFlashNegInf;
    if (!live[i]) {
      alpha[i] = 1.0f;
      continue;
    }
    alpha[i] = generic::exp_scalar(t.row_max[r] - new_max);
    const __m512 shift = _mm512_set1_ps(new_max);
    __m512 sum = _mm512_setzero_ps();
    for (size_t v = 0; v < NV; ++v) {
      const __m512 e = avx512::exp16(_mm512_sub_ps(sv[v], shift));
      _mm512_storeu_ps(s + 16 * v, e);
      sum = _mm512_add_ps(sum, e);
    }
    t.row_sum[r] = t.row_sum[r] * alpha[i] + _mm512_reduce_add_ps(sum);
    t.row_max[r] = new_max;
  }
  for (size_t i = 0; i < R; ++i)
    if (!live[i]) std::fill(t.scores + (r0 + i) * K, t.scores + (r0 + i + 1) * K, 0.0f);

  // P·V: o = o·alpha + sum_j p_j v_j, 64 output columns at a time (the last chunk masked).
  for (size_t c0 = 0; c0 < t.dv; c0 += 64) {
    __mmask16 mk[NV];
    for (size_t v = 0; v < NV; ++v) {
      const size_t at = c0 + 16 * v;
      mk[v] = at >= t.dv ? 0 : t.dv - at >= 16 ? static_cast<__mmask16>(0xFFFF) : tail_mask(t.dv - at);
    }
    __m512 o[R][NV];
    for (size_t i = 0; i < R; ++i) {
      const __m512 a = _mm512_set1_ps(alpha[i]);
      float* orow = t.o + (r0 + i) * t.dv + c0;
      for (size_t v = 0; v < NV; ++v) o[i][v] = _mm512_mul_ps(_mm512_maskz_loadu_ps(mk[v], orow + 16 * v), a);
    }
    const float* p = t.scores + r0 * K;
    for (size_t j = 0; j < t.n; ++j) {
      const float* vr = t.v + j * t.ldv + c0;
      const __m512 v0 = _mm512_maskz_loadu_ps(mk[0], vr), v1 = _mm512_maskz_loadu_ps(mk[1], vr + 16),
                   v2 = _mm512_maskz_loadu_ps(mk[2], vr + 32), v3 = _mm512_maskz_loadu_ps(mk[3], vr + 48);
      for (size_t i = 0; i < R; ++i) {
        const __m512 pb = _mm512_set1_ps(p[i * K + j]);
        o[i][0] = _mm512_fmadd_ps(pb, v0, o[i][0]);
        o[i][1] = _mm512_fmadd_ps(pb, v1, o[i][1]);
        o[i][2] = _mm512_fmadd_ps(pb, v2, o[i][2]);
        o[i][3] = _mm512_fmadd_ps(pb, v3, o[i][3]);
      }
    }
    for (size_t i = 0; i < R; ++i) {
      float* orow = t.o + (r0 + i) * t.dv + c0;
      for (size_t v = 0; v < NV; ++v) _mm512_mask_storeu_ps(orow + 16 * v, mk[v], o[i][v]);
    }
  }
}

// Six rows per step (24 accumulators of 32 registers: one K^T / V row load serves six rows); the
// last m % 6 rows in one step of their own.
void flash_tile_avx512(const FlashTile& t) {
  size_t r = 0;
  for (; r + 6 <= t.m; r += 6) flash_rows_avx512<6>(t, r);
  switch (t.m - r) {
    case 5: flash_rows_avx512<5>(t, r); break;
    case 4: flash_rows_avx512<4>(t, r); break;
    case 3: flash_rows_avx512<3>(t, r); break;
    case 2: flash_rows_avx512<2>(t, r); break;
    case 1: flash_rows_avx512<1>(t, r); break;
    default: break;
  }
}

}  // namespace

const AttentionKernels& attention_kernels_avx512() {
  static const AttentionKernels table{dot_rows_avx512, pack_row_avx512, row_hash_avx512, generic::rotate, exp_sub_avx512,
                                      flash_tile_avx512};
  return table;
}

}  // namespace ortsparse::kernels
