// AVX2+FMA; only called when the CPU has them.
#include <immintrin.h>

#include <algorithm>

#include "kernels/attention_kernels.h"
#include "kernels/exp_generic.h"
#include "kernels/exp_avx2.h"
#include "kernels/flash_generic.h"
#include "kernels/rotary_generic.h"

namespace ortsparse::kernels {

namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Four rows per step (q loaded once for the four; the four accumulators reduced together with
// horizontal adds). The tail of d (d % 8) goes through a zero-padded copy of q.
inline __m128 reduce4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
  const __m256 s = _mm256_hadd_ps(ab, cd);  // per 128-bit half: [a, b, c, d] partial sums
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

void dot_rows_avx2(const float* q, const float* k, size_t ldk, size_t d, const int32_t* rows, size_t n, float* out) {
  constexpr size_t kAhead = 8;  // rows of a gathered list: prefetch ahead (no stride to predict)
  auto row = [&](size_t i) { return k + (rows ? static_cast<size_t>(rows[i]) : i) * ldk; };
  const size_t full = d / 8 * 8;
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    if (rows && i + kAhead + 4 <= n) {
      for (size_t r = 0; r < 4; ++r) {
        const char* next = reinterpret_cast<const char*>(row(i + kAhead + r));
        for (size_t b = 0; b < d * sizeof(float); b += 64) _mm_prefetch(next + b, _MM_HINT_T0);
      }
    }
    const float *k0 = row(i), *k1 = row(i + 1), *k2 = row(i + 2), *k3 = row(i + 3);
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (size_t j = 0; j < full; j += 8) {
      const __m256 qv = _mm256_loadu_ps(q + j);
      a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + j), a0);
      a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + j), a1);
      a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + j), a2);
      a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + j), a3);
    }
    alignas(16) float sums[4];
    _mm_store_ps(sums, reduce4(a0, a1, a2, a3));
    for (size_t j = full; j < d; ++j) {
      sums[0] += q[j] * k0[j];
      sums[1] += q[j] * k1[j];
      sums[2] += q[j] * k2[j];
      sums[3] += q[j] * k3[j];
    }
    std::copy_n(sums, 4, out + i);
  }
  for (; i < n; ++i) {
    const float* kr = row(i);
    __m256 a0 = _mm256_setzero_ps();
    for (size_t j = 0; j < full; j += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), _mm256_loadu_ps(kr + j), a0);
    // Reduced in reduce4's order, so a row's dot does not depend on where it falls in the list: equal
    // keys score equal (ties go to the lower key) and a page bound is the same bits alone or in a list.
    const __m256 zero = _mm256_setzero_ps();
    float s = _mm_cvtss_f32(reduce4(a0, zero, zero, zero));
    for (size_t j = full; j < d; ++j) s += q[j] * kr[j];
    out[i] = s;
  }
}

double exp_sub_avx2(const float* x, size_t n, float shift, float* out) {
  const __m256 s = _mm256_set1_ps(shift);
  __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = avx2::exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), s));
    _mm256_storeu_ps(out + i, e);
    acc0 = _mm256_add_pd(acc0, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
    acc1 = _mm256_add_pd(acc1, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(acc0, acc1));
  double sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  for (; i < n; ++i) {
    out[i] = generic::exp_scalar(x[i] - shift);
    sum += out[i];
  }
  return sum;
}

inline __m256d abs_sum_pd(__m256 a, __m256d acc) {
  acc = _mm256_add_pd(acc, _mm256_cvtps_pd(_mm256_castps256_ps128(a)));
  return _mm256_add_pd(acc, _mm256_cvtps_pd(_mm256_extractf128_ps(a, 1)));
}

// 8 entries per compare, movemask gives the bits; the tail goes through a zero-padded copy (0 is
// never active in any mode, eps >= 0).
float pack_row_avx2(const float* x, size_t d, int mode, float eps, uint64_t* out, size_t stride, uint64_t* bits_set) {
  const size_t words = (d + 63) / 64;
  const __m256 zero = _mm256_setzero_ps(), veps = _mm256_set1_ps(eps), vneg = _mm256_set1_ps(-eps);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256d sum = _mm256_setzero_pd();
  uint64_t active = 0;
  alignas(32) float tail[8];
  for (size_t w = 0; w < words; ++w) {
    uint64_t pos = 0, neg = 0;
    for (size_t c = 0; c < 8; ++c) {
      const size_t i = w * 64 + c * 8;
      if (i >= d) break;
      __m256 v;
      if (d - i >= 8) {
        v = _mm256_loadu_ps(x + i);
      } else {
        for (size_t t = 0; t < 8; ++t) tail[t] = i + t < d ? x[i + t] : 0.0f;
        v = _mm256_load_ps(tail);
      }
      const __m256 a = _mm256_and_ps(v, abs_mask);
      unsigned p, n = 0;
      if (mode == 1) {
        p = static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(v, zero, _CMP_GT_OQ)));
        sum = abs_sum_pd(a, sum);
      } else {
        __m256 act;
        if (mode == 2) {
          act = _mm256_cmp_ps(a, veps, _CMP_GT_OQ);
          p = static_cast<unsigned>(_mm256_movemask_ps(act));
        } else {
          const __m256 pm = _mm256_cmp_ps(v, veps, _CMP_GT_OQ), nm = _mm256_cmp_ps(v, vneg, _CMP_LT_OQ);
          p = static_cast<unsigned>(_mm256_movemask_ps(pm));
          n = static_cast<unsigned>(_mm256_movemask_ps(nm));
          act = _mm256_or_ps(pm, nm);
        }
        sum = abs_sum_pd(_mm256_and_ps(a, act), sum);
        active += static_cast<uint64_t>(__builtin_popcount(p | n));
      }
      pos |= static_cast<uint64_t>(p) << (8 * c);
      neg |= static_cast<uint64_t>(n) << (8 * c);
    }
    out[w * stride] = pos;
    if (mode == 3) out[(words + w) * stride] = neg;
    *bits_set += static_cast<uint64_t>(__builtin_popcountll(pos) + __builtin_popcountll(neg));
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, sum);
  const double total = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  if (mode == 1) return d ? static_cast<float>(total / static_cast<double>(d)) : 0.0f;
  return active ? static_cast<float>(total / static_cast<double>(active)) : eps;
}

// NH over 8 words per step (see the AVX-512 twin); the tail goes through a zero-padded copy.
void row_hash_avx2(const float* x, size_t d, const uint32_t* key, uint64_t* out) {
  const uint32_t* m = reinterpret_cast<const uint32_t*>(x);
  const size_t padded = (d + 1) / 2 * 2;
  for (size_t p = 0; p < d; p += 16)  // see the AVX-512 twin: 2 KiB ahead keeps the row stream fed
    _mm_prefetch(reinterpret_cast<const char*>(m + p) + 2048, _MM_HINT_T0);
  __m256i h0 = _mm256_setzero_si256(), h1 = _mm256_setzero_si256();
  auto step = [&](__m256i w, __m256i k0, __m256i k1) {
    const __m256i a0 = _mm256_add_epi32(w, k0), a1 = _mm256_add_epi32(w, k1);
    h0 = _mm256_add_epi64(h0, _mm256_mul_epu32(a0, _mm256_srli_epi64(a0, 32)));
    h1 = _mm256_add_epi64(h1, _mm256_mul_epu32(a1, _mm256_srli_epi64(a1, 32)));
  };
  size_t i = 0;
  for (; i + 8 <= d; i += 8)
    step(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(m + i)),
         _mm256_loadu_si256(reinterpret_cast<const __m256i*>(key + i)),
         _mm256_loadu_si256(reinterpret_cast<const __m256i*>(key + i + 2)));
  if (i < padded) {
    alignas(32) uint32_t w[8] = {}, k0[8] = {}, k1[8] = {};
    for (size_t j = i; j < d; ++j) w[j - i] = m[j];
    for (size_t j = i; j < padded; ++j) {
      k0[j - i] = key[j];
      k1[j - i] = key[j + 2];
    }
    step(_mm256_load_si256(reinterpret_cast<const __m256i*>(w)), _mm256_load_si256(reinterpret_cast<const __m256i*>(k0)),
         _mm256_load_si256(reinterpret_cast<const __m256i*>(k1)));
  }
  alignas(32) uint64_t lanes0[4], lanes1[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes0), h0);
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes1), h1);
  out[0] = lanes0[0] + lanes0[1] + lanes0[2] + lanes0[3];
  out[1] = lanes1[0] + lanes1[1] + lanes1[2] + lanes1[3];
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Lanes [0, count) of 8 set (count clamped to [0, 8]), as a maskload/maskstore mask.
inline __m256i lane_mask(size_t at, size_t end) {
  const int count = at >= end ? 0 : static_cast<int>(std::min<size_t>(8, end - at));
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// The tiled prompt step, two query rows at a time: q·k in two 32-key halves (8 accumulators),
// the softmax update, P·V in 32-wide column chunks (8 accumulators, one V row load for both rows).
template <size_t R>
void flash_rows_avx2(const FlashTile& t, size_t r0) {
  constexpr size_t K = kFlashKeys, NV = 4;
  static_assert(K == 64, "kFlashKeys is two halves of four AVX2 vectors");
  const float* q = t.q + r0 * t.d;
  for (size_t h = 0; h < K; h += 32) {
    __m256 acc[R][NV];
    for (size_t i = 0; i < R; ++i)
      for (size_t v = 0; v < NV; ++v) acc[i][v] = _mm256_setzero_ps();
    for (size_t c = 0; c < t.d; ++c) {
      const float* kr = t.kt + c * K + h;
      const __m256 k0 = _mm256_loadu_ps(kr), k1 = _mm256_loadu_ps(kr + 8), k2 = _mm256_loadu_ps(kr + 16),
                   k3 = _mm256_loadu_ps(kr + 24);
      for (size_t i = 0; i < R; ++i) {
        const __m256 qb = _mm256_broadcast_ss(q + i * t.d + c);
        acc[i][0] = _mm256_fmadd_ps(qb, k0, acc[i][0]);
        acc[i][1] = _mm256_fmadd_ps(qb, k1, acc[i][1]);
        acc[i][2] = _mm256_fmadd_ps(qb, k2, acc[i][2]);
        acc[i][3] = _mm256_fmadd_ps(qb, k3, acc[i][3]);
      }
    }
    for (size_t i = 0; i < R; ++i)
      for (size_t v = 0; v < NV; ++v) _mm256_storeu_ps(t.scores + (r0 + i) * K + h + 8 * v, acc[i][v]);
  }
  const bool generic_scores = t.softcap > 0.0f || t.bias != nullptr;
  const __m256 iota = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 neg_inf = _mm256_set1_ps(generic::kFlashNegInf);
  float alpha[R];
  for (size_t i = 0; i < R; ++i) {
    const size_t r = r0 + i;
    float* s = t.scores + r * K;
    __m256 sv[K / 8];
    if (generic_scores) {
      generic::flash_finish_scores(t, r, s);
      for (size_t v = 0; v < K / 8; ++v) sv[v] = _mm256_loadu_ps(s + 8 * v);
    } else {
      const size_t lo = t.lo ? static_cast<size_t>(t.lo[r]) : 0;
      const size_t hi = std::min(t.n, t.lo ? static_cast<size_t>(t.hi[r]) : t.n);
      const __m256 vlo = _mm256_set1_ps(static_cast<float>(lo)), vhi = _mm256_set1_ps(static_cast<float>(hi));
      const __m256 scale = _mm256_set1_ps(t.scale);
      for (size_t v = 0; v < K / 8; ++v) {
        const __m256 j = _mm256_add_ps(iota, _mm256_set1_ps(static_cast<float>(8 * v)));
        const __m256 in = _mm256_and_ps(_mm256_cmp_ps(j, vlo, _CMP_GE_OQ), _mm256_cmp_ps(j, vhi, _CMP_LT_OQ));
        sv[v] = _mm256_blendv_ps(neg_inf, _mm256_mul_ps(_mm256_loadu_ps(s + 8 * v), scale), in);
      }
    }
    __m256 mx = sv[0];
    for (size_t v = 1; v < K / 8; ++v) mx = _mm256_max_ps(mx, sv[v]);
    const float new_max = generic::flash_new_max(t, r, hmax(mx));
    if (new_max == generic::kFlashNegInf) {
      alpha[i] = 1.0f;
      std::fill(s, s + K, 0.0f);
      continue;
    }
    alpha[i] = generic::exp_scalar(t.row_max[r] - new_max);
    const __m256 shift = _mm256_set1_ps(new_max);
    __m256 sum = _mm256_setzero_ps();
    for (size_t v = 0; v < K / 8; ++v) {
      const __m256 e = avx2::exp8(_mm256_sub_ps(sv[v], shift));
      _mm256_storeu_ps(s + 8 * v, e);
      sum = _mm256_add_ps(sum, e);
    }
    t.row_sum[r] = t.row_sum[r] * alpha[i] + hsum(sum);
    t.row_max[r] = new_max;
  }

  for (size_t c0 = 0; c0 < t.dv; c0 += 32) {
    __m256i mk[NV];
    for (size_t v = 0; v < NV; ++v) mk[v] = lane_mask(c0 + 8 * v, t.dv);
    __m256 o[R][NV];
    for (size_t i = 0; i < R; ++i) {
      const __m256 a = _mm256_set1_ps(alpha[i]);
      float* orow = t.o + (r0 + i) * t.dv + c0;
      for (size_t v = 0; v < NV; ++v) o[i][v] = _mm256_mul_ps(_mm256_maskload_ps(orow + 8 * v, mk[v]), a);
    }
    const float* p = t.scores + r0 * K;
    for (size_t j = 0; j < t.n; ++j) {
      const float* vr = t.v + j * t.ldv + c0;
      const __m256 v0 = _mm256_maskload_ps(vr, mk[0]), v1 = _mm256_maskload_ps(vr + 8, mk[1]),
                   v2 = _mm256_maskload_ps(vr + 16, mk[2]), v3 = _mm256_maskload_ps(vr + 24, mk[3]);
      for (size_t i = 0; i < R; ++i) {
        const __m256 pb = _mm256_broadcast_ss(p + i * K + j);
        o[i][0] = _mm256_fmadd_ps(pb, v0, o[i][0]);
        o[i][1] = _mm256_fmadd_ps(pb, v1, o[i][1]);
        o[i][2] = _mm256_fmadd_ps(pb, v2, o[i][2]);
        o[i][3] = _mm256_fmadd_ps(pb, v3, o[i][3]);
      }
    }
    for (size_t i = 0; i < R; ++i) {
      float* orow = t.o + (r0 + i) * t.dv + c0;
      for (size_t v = 0; v < NV; ++v) _mm256_maskstore_ps(orow + 8 * v, mk[v], o[i][v]);
    }
  }
}

void flash_tile_avx2(const FlashTile& t) {
  size_t r = 0;
  for (; r + 2 <= t.m; r += 2) flash_rows_avx2<2>(t, r);
  for (; r < t.m; ++r) flash_rows_avx2<1>(t, r);
}

}  // namespace

const AttentionKernels& attention_kernels_avx2() {
  static const AttentionKernels table{dot_rows_avx2, pack_row_avx2, row_hash_avx2, generic::rotate, exp_sub_avx2,
                                      flash_tile_avx2};
  return table;
}

}  // namespace ortsparse::kernels
