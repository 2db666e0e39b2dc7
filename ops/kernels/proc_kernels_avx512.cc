// AVX-512 (F/BW/VL/DQ) kernels of the proc backend: 64-bit lane multiplies (vpmullq) hash 8
// weights at once; fp16 deltas widen with vcvtph2ps. Only called when the CPU has AVX-512.
#include <immintrin.h>

#include <algorithm>

#include "kernels/proc_kernels.h"

namespace ortsparse::kernels {
namespace {

inline __mmask16 tail_mask(size_t count) {
  return count >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << count) - 1u);
}

inline __m512i mix8(__m512i z) {
  z = _mm512_xor_si512(z, _mm512_srli_epi64(z, 30));
  z = _mm512_mullo_epi64(z, _mm512_set1_epi64(static_cast<long long>(kProcMix1)));
  z = _mm512_xor_si512(z, _mm512_srli_epi64(z, 27));
  z = _mm512_mullo_epi64(z, _mm512_set1_epi64(static_cast<long long>(kProcMix2)));
  z = _mm512_xor_si512(z, _mm512_srli_epi64(z, 31));
  return _mm512_srli_epi64(z, 40);
}

// base(n, k0 + i) for i < 16: consecutive k are consecutive generator states (state0 + i * G).
struct Hasher {
  uint64_t seed;
  __m512 scale;
  __m512i steps, step8;
  Hasher(uint64_t seed_, float scale_) : seed(seed_), scale(_mm512_set1_ps(scale_)) {
    steps = _mm512_mullo_epi64(_mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0),
                               _mm512_set1_epi64(static_cast<long long>(kProcGolden)));
    step8 = _mm512_set1_epi64(static_cast<long long>(8 * kProcGolden));
  }
  __m512 base16(uint64_t n, uint64_t k0) const {
    const uint64_t s0 = seed + kProcGolden * (((n << 32) | k0) + 1);
    const __m512i z0 = _mm512_add_epi64(_mm512_set1_epi64(static_cast<long long>(s0)), steps);
    const __m512i z1 = _mm512_add_epi64(z0, step8);
    const __m256 f0 = _mm512_cvtepi64_ps(mix8(z0)), f1 = _mm512_cvtepi64_ps(mix8(z1));
    const __m512 v = _mm512_insertf32x8(_mm512_castps256_ps512(f0), f1, 1);
    const __m512 u = _mm512_sub_ps(_mm512_mul_ps(v, _mm512_set1_ps(1.0f / 8388608.0f)), _mm512_set1_ps(1.0f));
    return _mm512_mul_ps(scale, u);
  }
  // base(n, k_i) for 16 arbitrary k (block 1: a unit's kept rows are not consecutive).
  __m512 base_at(uint64_t n, __m512i k32) const {
    const __m512i hi = _mm512_set1_epi64(static_cast<long long>((n << 32) + 1));
    const __m512i golden = _mm512_set1_epi64(static_cast<long long>(kProcGolden));
    const __m512i seed_v = _mm512_set1_epi64(static_cast<long long>(seed));
    const __m512i i0 = _mm512_add_epi64(hi, _mm512_cvtepu32_epi64(_mm512_castsi512_si256(k32)));
    const __m512i i1 = _mm512_add_epi64(hi, _mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64(k32, 1)));
    const __m512i z0 = _mm512_add_epi64(seed_v, _mm512_mullo_epi64(golden, i0));
    const __m512i z1 = _mm512_add_epi64(seed_v, _mm512_mullo_epi64(golden, i1));
    const __m256 f0 = _mm512_cvtepi64_ps(mix8(z0)), f1 = _mm512_cvtepi64_ps(mix8(z1));
    const __m512 v = _mm512_insertf32x8(_mm512_castps256_ps512(f0), f1, 1);
    const __m512 u = _mm512_sub_ps(_mm512_mul_ps(v, _mm512_set1_ps(1.0f / 8388608.0f)), _mm512_set1_ps(1.0f));
    return _mm512_mul_ps(scale, u);
  }
};

inline __m512 load_delta(const float* d, __mmask16 m) { return _mm512_maskz_loadu_ps(m, d); }
inline __m512 load_delta(const uint16_t* d, __mmask16 m) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, d)); }

// T tokens, C independent accumulation chains per token (one chain would wait on FMA latency at
// M = 1: 4 chains keep the loads, not the adder, the limit).
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
    __m512 acc[T][C];
    for (int t = 0; t < T; ++t)
      for (int c = 0; c < C; ++c) acc[t][c] = _mm512_setzero_ps();
    const uint16_t* idx = p.index + j * fanout;
    const D* dj = deltas + j * fanout * block;
    for (size_t f = 0; f < fanout; ++f) {
      const size_t b = idx[f];
      if (mask && !mask[b]) continue;
      ++computed;
      const size_t start = b * block, len = std::min(block, k - start);
      const D* d = dj + f * block;
      for (size_t r = 0; r < len; r += 16) {
        const __mmask16 m = tail_mask(len - r);
        __m512 w = load_delta(d + r, m);
        if (kHashed) w = _mm512_add_ps(hasher.base16(j, start + r), w);
        for (int t = 0; t < T; ++t) {
          const __m512 next = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(m, xs[t] + start + r), acc[t][0]);
          for (int c = 0; c + 1 < C; ++c) acc[t][c] = acc[t][c + 1];
          acc[t][C - 1] = next;
        }
      }
    }
    const float bj = bias ? bias[j] : 0.0f;
    for (int t = 0; t < T; ++t) {
      __m512 s = acc[t][0];
      for (int c = 1; c < C; ++c) s = _mm512_add_ps(s, acc[t][c]);
      y[t][j] = _mm512_reduce_add_ps(s) + bj;
    }
  }
  return computed;
}

inline __m512 load_delta_full(const float* d) { return _mm512_loadu_ps(d); }
inline __m512 load_delta_full(const uint16_t* d) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d)));
}

// Blocks of kC * 16 rows (block 16, 32, 64): every block but a short last one is whole, so its
// chunks load without masks into one accumulator per chunk. At M = 1 the unit's blocks rotate
// over kSets accumulator sets so consecutive blocks do not wait on each other's FMAs. The per
// block cost is then the loads alone (the general loop above was ~2x slower at block 32).
template <typename D, int T, bool kHashed, int kC>
size_t units_whole(const ProcPacked& p, const float* const* x, const uint8_t* mask, size_t n0, size_t n1,
                   const float* bias, float* const* y) {
  constexpr int kSets = T == 1 ? (kC == 1 ? 4 : 2) : 1;
  const D* deltas = static_cast<const D*>(p.deltas);
  const Hasher hasher(p.seed, p.base_scale);
  const float* xs[T];
  for (int t = 0; t < T; ++t) xs[t] = x[t];
  const size_t fanout = p.fanout, block = p.block, k = p.k;
  const size_t short_block = k % block ? p.num_blocks - 1 : p.num_blocks;  // none when K % block == 0
  size_t computed = 0;
  for (size_t j = n0; j < n1; ++j) {
    __m512 acc[kSets][T][kC];
    for (int s = 0; s < kSets; ++s)
      for (int t = 0; t < T; ++t)
        for (int c = 0; c < kC; ++c) acc[s][t][c] = _mm512_setzero_ps();
    const uint16_t* idx = p.index + j * fanout;
    const D* dj = deltas + j * fanout * block;
    // One kept block into accumulator set e (a compile-time index after unrolling: registers).
    auto one = [&](size_t f, __m512 (&a)[T][kC]) __attribute__((always_inline)) {
      const size_t b = idx[f];
      if (mask && !mask[b]) return;
      ++computed;
      const size_t start = b * block;
      const D* d = dj + f * block;
      if (b == short_block) {
        const size_t len = k - start;
        for (size_t r = 0; r < len; r += 16) {
          const __mmask16 m = tail_mask(len - r);
          __m512 w = load_delta(d + r, m);
          if (kHashed) w = _mm512_add_ps(hasher.base16(j, start + r), w);
          for (int t = 0; t < T; ++t) a[t][0] = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(m, xs[t] + start + r), a[t][0]);
        }
        return;
      }
#pragma GCC unroll 4
      for (int c = 0; c < kC; ++c) {
        __m512 w = load_delta_full(d + 16 * c);
        if (kHashed) w = _mm512_add_ps(hasher.base16(j, start + 16 * c), w);
        for (int t = 0; t < T; ++t) a[t][c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(xs[t] + start + 16 * c), a[t][c]);
      }
    };
    size_t f = 0;
    for (; f + kSets <= fanout; f += kSets) {
#pragma GCC unroll 4
      for (int e = 0; e < kSets; ++e) one(f + e, acc[e]);
    }
    for (; f < fanout; ++f) one(f, acc[0]);
    const float bj = bias ? bias[j] : 0.0f;
    for (int t = 0; t < T; ++t) {
      __m512 s = _mm512_setzero_ps();
      for (int e = 0; e < kSets; ++e)
        for (int c = 0; c < kC; ++c) s = _mm512_add_ps(s, acc[e][t][c]);
      y[t][j] = _mm512_reduce_add_ps(s) + bj;
    }
  }
  return computed;
}

// Block 1 (each kept "block" is one row): 16 kept rows at a time, x gathered by index. The gate's
// rows are not checked per row (x is already 0 outside them), so every kept row is computed.
template <typename D, int T, bool kHashed>
size_t units_rows(const ProcPacked& p, const float* const* x, size_t n0, size_t n1, const float* bias,
                  float* const* y) {
  const D* deltas = static_cast<const D*>(p.deltas);
  const Hasher hasher(p.seed, p.base_scale);
  const size_t fanout = p.fanout;
  for (size_t j = n0; j < n1; ++j) {
    __m512 acc[T][2];
    for (int t = 0; t < T; ++t) acc[t][0] = acc[t][1] = _mm512_setzero_ps();
    const uint16_t* idx = p.index + j * fanout;
    const D* d = deltas + j * fanout;
    size_t f = 0;
    auto step = [&](size_t at, __mmask16 m, int slot) __attribute__((always_inline)) {
      const __m512i k32 = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, idx + at));
      __m512 w = load_delta(d + at, m);
      if (kHashed) w = _mm512_maskz_add_ps(m, hasher.base_at(j, k32), w);
      for (int t = 0; t < T; ++t) {
        const __m512 xv = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, k32, x[t], 4);
        acc[t][slot] = _mm512_fmadd_ps(w, xv, acc[t][slot]);
      }
    };
    for (; f + 32 <= fanout; f += 32) {
      step(f, static_cast<__mmask16>(0xFFFF), 0);
      step(f + 16, static_cast<__mmask16>(0xFFFF), 1);
    }
    for (; f < fanout; f += 16) step(f, tail_mask(fanout - f), 0);
    const float bj = bias ? bias[j] : 0.0f;
    for (int t = 0; t < T; ++t) y[t][j] = _mm512_reduce_add_ps(_mm512_add_ps(acc[t][0], acc[t][1])) + bj;
  }
  return (n1 - n0) * fanout;
}

template <typename D, int T, bool kHashed>
size_t units_dispatch(const ProcPacked& p, const float* const* x, const uint8_t* mask, size_t n0, size_t n1,
                      const float* bias, float* const* y) {
  switch (p.block) {
    case 1: return units_rows<D, T, kHashed>(p, x, n0, n1, bias, y);
    case 16: return units_whole<D, T, kHashed, 1>(p, x, mask, n0, n1, bias, y);
    case 32: return units_whole<D, T, kHashed, 2>(p, x, mask, n0, n1, bias, y);
    case 64: return units_whole<D, T, kHashed, 4>(p, x, mask, n0, n1, bias, y);
    default: return units_t<D, T, kHashed>(p, x, mask, n0, n1, bias, y);
  }
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

size_t units_avx512(const ProcPacked& p, const float* const* x, size_t count, const uint8_t* mask, size_t n0,
                    size_t n1, const float* bias, float* const* y) {
  const bool hashed = p.base_scale != 0.0f;
  if (p.delta_type == DeltaType::kF16)
    return hashed ? units_tokens<uint16_t, true>(p, x, count, mask, n0, n1, bias, y)
                  : units_tokens<uint16_t, false>(p, x, count, mask, n0, n1, bias, y);
  return hashed ? units_tokens<float, true>(p, x, count, mask, n0, n1, bias, y)
                : units_tokens<float, false>(p, x, count, mask, n0, n1, bias, y);
}

void base_values_avx512(uint64_t seed, float scale, uint64_t n, uint64_t k0, size_t count, float* out) {
  const Hasher hasher(seed, scale);
  for (size_t i = 0; i < count; i += 16)
    _mm512_mask_storeu_ps(out + i, tail_mask(count - i), hasher.base16(n, k0 + i));
}

}  // namespace

const ProcKernels& proc_kernels_avx512() {
  static const ProcKernels table{units_avx512, base_values_avx512};
  return table;
}

}  // namespace ortsparse::kernels
