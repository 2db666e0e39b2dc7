// AVX2 + FMA + F16C kernels of the proc backend. AVX2 has no 64-bit multiply: the splitmix64
// multiplies are built from three 32x32->64 products (the high half of lo*lo is all that is needed).
#include <immintrin.h>

#include <algorithm>

#include "kernels/proc_kernels.h"

namespace ortsparse::kernels {
namespace {

inline __m256i mullo64(__m256i a, uint64_t b) {
  const __m256i b_lo = _mm256_set1_epi64x(static_cast<long long>(b & 0xFFFFFFFFull));
  const __m256i b_hi = _mm256_set1_epi64x(static_cast<long long>(b >> 32));
  const __m256i lo = _mm256_mul_epu32(a, b_lo);
  const __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(a, 32), b_lo), _mm256_mul_epu32(a, b_hi));
  return _mm256_add_epi64(lo, _mm256_slli_epi64(cross, 32));
}

inline __m256i mix4(__m256i z) {
  z = _mm256_xor_si256(z, _mm256_srli_epi64(z, 30));
  z = mullo64(z, kProcMix1);
  z = _mm256_xor_si256(z, _mm256_srli_epi64(z, 27));
  z = mullo64(z, kProcMix2);
  z = _mm256_xor_si256(z, _mm256_srli_epi64(z, 31));
  return _mm256_srli_epi64(z, 40);
}

struct Hasher {
  uint64_t seed;
  __m256 scale;
  __m256i steps, step4, pack;
  Hasher(uint64_t seed_, float scale_) : seed(seed_), scale(_mm256_set1_ps(scale_)) {
    steps = _mm256_setr_epi64x(0, static_cast<long long>(kProcGolden), static_cast<long long>(2 * kProcGolden),
                               static_cast<long long>(3 * kProcGolden));
    step4 = _mm256_set1_epi64x(static_cast<long long>(4 * kProcGolden));
    pack = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  }
  // base(n, k0 + i), i < 8. Each hash fits 24 bits, so the low 32-bit words carry it.
  __m256 base8(uint64_t n, uint64_t k0) const {
    const uint64_t s0 = seed + kProcGolden * (((n << 32) | k0) + 1);
    const __m256i z0 = _mm256_add_epi64(_mm256_set1_epi64x(static_cast<long long>(s0)), steps);
    const __m256i z1 = _mm256_add_epi64(z0, step4);
    const __m256i a = _mm256_permutevar8x32_epi32(mix4(z0), pack);
    const __m256i b = _mm256_permutevar8x32_epi32(mix4(z1), pack);
    const __m256 v = _mm256_cvtepi32_ps(_mm256_permute2x128_si256(a, b, 0x20));
    const __m256 u = _mm256_sub_ps(_mm256_mul_ps(v, _mm256_set1_ps(1.0f / 8388608.0f)), _mm256_set1_ps(1.0f));
    return _mm256_mul_ps(scale, u);
  }
};

inline __m256i lane_mask(size_t count) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<size_t>(count, 8))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// Tails (count < 8): masked load (f32).
inline __m256 load_delta(const float* d, size_t count) {
  return count >= 8 ? _mm256_loadu_ps(d) : _mm256_maskload_ps(d, lane_mask(count));
}
// fp16 has no masked load in AVX2: read 8 halves (the layout is padded by kProcDeltaPad bytes, so
// this stays in bounds) and clear the lanes past `count` (a copy through memory stalls store
// forwarding: 9 ns per weight at block 1).
inline __m256 load_delta(const uint16_t* d, size_t count) {
  const __m256 w = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d)));
  return count >= 8 ? w : _mm256_and_ps(w, _mm256_castsi256_ps(lane_mask(count)));
}
inline __m256 load_x(const float* x, size_t count) {
  return count >= 8 ? _mm256_loadu_ps(x) : _mm256_maskload_ps(x, lane_mask(count));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <typename D, int T, bool kHashed>
size_t units_t(const ProcPacked& p, const float* const* x, const uint8_t* mask, size_t n0, size_t n1,
               const float* bias, float* const* y) {
  constexpr int C = T == 1 ? 4 : (T == 2 ? 2 : 1);
  const D* deltas = static_cast<const D*>(p.deltas);
  const Hasher hasher(p.seed, p.base_scale);
  const float* xs[T];
  for (int t = 0; t < T; ++t) xs[t] = x[t];
  const size_t fanout = p.fanout, block = p.block, k = p.k;
  size_t computed = 0;
  for (size_t j = n0; j < n1; ++j) {
    __m256 acc[T][C];
    for (int t = 0; t < T; ++t)
      for (int c = 0; c < C; ++c) acc[t][c] = _mm256_setzero_ps();
    const uint16_t* idx = p.index + j * fanout;
    const D* dj = deltas + j * fanout * block;
    for (size_t f = 0; f < fanout; ++f) {
      const size_t b = idx[f];
      if (mask && !mask[b]) continue;
      ++computed;
      const size_t start = b * block, len = std::min(block, k - start);
      const D* d = dj + f * block;
      for (size_t r = 0; r < len; r += 8) {
        const size_t count = len - r;
        __m256 w = load_delta(d + r, count);
        if (kHashed) {
          // Lanes past the block's end: x loads 0 there; the base is masked too so w is the block's.
          const __m256 base = hasher.base8(j, start + r);
          w = _mm256_add_ps(count >= 8 ? base : _mm256_and_ps(base, _mm256_castsi256_ps(lane_mask(count))), w);
        }
        for (int t = 0; t < T; ++t) {
          const __m256 next = _mm256_fmadd_ps(w, load_x(xs[t] + start + r, count), acc[t][0]);
          for (int c = 0; c + 1 < C; ++c) acc[t][c] = acc[t][c + 1];
          acc[t][C - 1] = next;
        }
      }
    }
    const float bj = bias ? bias[j] : 0.0f;
    for (int t = 0; t < T; ++t) {
      __m256 s = acc[t][0];
      for (int c = 1; c < C; ++c) s = _mm256_add_ps(s, acc[t][c]);
      y[t][j] = hsum(s) + bj;
    }
  }
  return computed;
}

inline __m256 load_delta_full(const float* d) { return _mm256_loadu_ps(d); }
inline __m256 load_delta_full(const uint16_t* d) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d)));
}

// Blocks of kC * 8 rows, whole except a short last one: unmasked chunk loads, one accumulator per
// chunk (x kSets sets at M = 1), as in the AVX-512 twin. Only where the accumulators fit the 16
// ymm registers with room for loads (T * kC * kSets <= 8); the general loop covers the rest.
template <typename D, int T, bool kHashed, int kC>
size_t units_whole(const ProcPacked& p, const float* const* x, const uint8_t* mask, size_t n0, size_t n1,
                   const float* bias, float* const* y) {
  constexpr int kSets = (T == 1 && kC <= 2) ? 2 : 1;
  static_assert(T * kC * kSets <= 8, "accumulators must fit the registers");
  const D* deltas = static_cast<const D*>(p.deltas);
  const Hasher hasher(p.seed, p.base_scale);
  const float* xs[T];
  for (int t = 0; t < T; ++t) xs[t] = x[t];
  const size_t fanout = p.fanout, block = p.block, k = p.k;
  const size_t short_block = k % block ? p.num_blocks - 1 : p.num_blocks;
  size_t computed = 0;
  for (size_t j = n0; j < n1; ++j) {
    __m256 acc[kSets][T][kC];
    for (int s = 0; s < kSets; ++s)
      for (int t = 0; t < T; ++t)
        for (int c = 0; c < kC; ++c) acc[s][t][c] = _mm256_setzero_ps();
    const uint16_t* idx = p.index + j * fanout;
    const D* dj = deltas + j * fanout * block;
    auto one = [&](size_t f, __m256 (&a)[T][kC]) __attribute__((always_inline)) {
      const size_t b = idx[f];
      if (mask && !mask[b]) return;
      ++computed;
      const size_t start = b * block;
      const D* d = dj + f * block;
      if (b == short_block) {
        const size_t len = k - start;
        for (size_t r = 0; r < len; r += 8) {
          const size_t count = len - r;
          __m256 w = load_delta(d + r, count);
          if (kHashed) {
            const __m256 base = hasher.base8(j, start + r);
            w = _mm256_add_ps(count >= 8 ? base : _mm256_and_ps(base, _mm256_castsi256_ps(lane_mask(count))), w);
          }
          for (int t = 0; t < T; ++t) a[t][0] = _mm256_fmadd_ps(w, load_x(xs[t] + start + r, count), a[t][0]);
        }
        return;
      }
#pragma GCC unroll 8
      for (int c = 0; c < kC; ++c) {
        __m256 w = load_delta_full(d + 8 * c);
        if (kHashed) w = _mm256_add_ps(hasher.base8(j, start + 8 * c), w);
        for (int t = 0; t < T; ++t) a[t][c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xs[t] + start + 8 * c), a[t][c]);
      }
    };
    size_t f = 0;
    for (; f + kSets <= fanout; f += kSets) {
#pragma GCC unroll 2
      for (int e = 0; e < kSets; ++e) one(f + e, acc[e]);
    }
    for (; f < fanout; ++f) one(f, acc[0]);
    const float bj = bias ? bias[j] : 0.0f;
    for (int t = 0; t < T; ++t) {
      __m256 s = _mm256_setzero_ps();
      for (int e = 0; e < kSets; ++e)
        for (int c = 0; c < kC; ++c) s = _mm256_add_ps(s, acc[e][t][c]);
      y[t][j] = hsum(s) + bj;
    }
  }
  return computed;
}

template <typename D, int T, bool kHashed>
size_t units_dispatch(const ProcPacked& p, const float* const* x, const uint8_t* mask, size_t n0, size_t n1,
                      const float* bias, float* const* y) {
  if constexpr (T <= 4) {
    if (p.block == 16) return units_whole<D, T, kHashed, 2>(p, x, mask, n0, n1, bias, y);
  }
  if constexpr (T <= 2) {
    if (p.block == 32) return units_whole<D, T, kHashed, 4>(p, x, mask, n0, n1, bias, y);
  }
  if constexpr (T == 1) {
    if (p.block == 64) return units_whole<D, T, kHashed, 8>(p, x, mask, n0, n1, bias, y);
  }
  return units_t<D, T, kHashed>(p, x, mask, n0, n1, bias, y);
}

template <typename D, bool kHashed>
size_t units_tokens(const ProcPacked& p, const float* const* x, size_t count, const uint8_t* mask, size_t n0,
                    size_t n1, const float* bias, float* const* y) {
  switch (count) {
    case 1: return units_dispatch<D, 1, kHashed>(p, x, mask, n0, n1, bias, y);
    case 2: return units_dispatch<D, 2, kHashed>(p, x, mask, n0, n1, bias, y);
    case 3: return units_dispatch<D, 3, kHashed>(p, x, mask, n0, n1, bias, y);
    default: return units_dispatch<D, 4, kHashed>(p, x, mask, n0, n1, bias, y);
  }
}

size_t units_avx2(const ProcPacked& p, const float* const* x, size_t count, const uint8_t* mask, size_t n0,
                  size_t n1, const float* bias, float* const* y) {
  const bool hashed = p.base_scale != 0.0f;
  if (p.delta_type == DeltaType::kF16)
    return hashed ? units_tokens<uint16_t, true>(p, x, count, mask, n0, n1, bias, y)
                  : units_tokens<uint16_t, false>(p, x, count, mask, n0, n1, bias, y);
  return hashed ? units_tokens<float, true>(p, x, count, mask, n0, n1, bias, y)
                : units_tokens<float, false>(p, x, count, mask, n0, n1, bias, y);
}

void base_values_avx2(uint64_t seed, float scale, uint64_t n, uint64_t k0, size_t count, float* out) {
  const Hasher hasher(seed, scale);
  for (size_t i = 0; i < count; i += 8) {
    alignas(32) float tmp[8];
    _mm256_store_ps(tmp, hasher.base8(n, k0 + i));
    for (size_t l = 0; l < 8 && i + l < count; ++l) out[i + l] = tmp[l];
  }
}

}  // namespace

const ProcKernels& proc_kernels_avx2() {
  static const ProcKernels table{units_avx2, base_values_avx2};
  return table;
}

}  // namespace ortsparse::kernels
