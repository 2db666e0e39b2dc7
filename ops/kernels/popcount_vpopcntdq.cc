// AVX-512 VPOPCNTDQ path: one zmm holds the same word of kLanes = 8 keys, so a block costs one
// load + and/xor + vpopcntq per word. Compiled with -mavx512f -mavx512vpopcntdq; only called when
// CpuFeatures reports both.
#include <immintrin.h>

#include "kernels/popcount_kernels.h"

namespace ortsparse::kernels {
namespace {

static_assert(kLanes == 8, "one zmm of uint64 per block word");

inline void store_counts(__m512i acc, int32_t* out) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi64_epi32(acc));
}

void and_counts_vpop(const uint64_t* q, const uint64_t* packed, size_t words, size_t n_blocks, int32_t* out) {
  for (size_t b = 0; b < n_blocks; ++b) {
    const uint64_t* blk = packed + b * words * kLanes;
    __m512i acc = _mm512_setzero_si512();
    for (size_t w = 0; w < words; ++w) {
      const __m512i k = _mm512_loadu_si512(blk + w * kLanes);
      acc = _mm512_add_epi64(acc, _mm512_popcnt_epi64(_mm512_and_si512(k, _mm512_set1_epi64(static_cast<long long>(q[w])))));
    }
    store_counts(acc, out + b * kLanes);
  }
}

void xor_counts_vpop(const uint64_t* q, const uint64_t* packed, size_t words, size_t n_blocks, int32_t* out) {
  for (size_t b = 0; b < n_blocks; ++b) {
    const uint64_t* blk = packed + b * words * kLanes;
    __m512i acc = _mm512_setzero_si512();
    for (size_t w = 0; w < words; ++w) {
      const __m512i k = _mm512_loadu_si512(blk + w * kLanes);
      acc = _mm512_add_epi64(acc, _mm512_popcnt_epi64(_mm512_xor_si512(k, _mm512_set1_epi64(static_cast<long long>(q[w])))));
    }
    store_counts(acc, out + b * kLanes);
  }
}

void ternary_counts_vpop(const uint64_t* qp, const uint64_t* qn, const uint64_t* packed, size_t words,
                         size_t n_blocks, int32_t* out) {
  for (size_t b = 0; b < n_blocks; ++b) {
    const uint64_t* pos = packed + b * 2 * words * kLanes;
    const uint64_t* neg = pos + words * kLanes;
    __m512i acc = _mm512_setzero_si512();
    for (size_t w = 0; w < words; ++w) {
      const __m512i kp = _mm512_loadu_si512(pos + w * kLanes), kn = _mm512_loadu_si512(neg + w * kLanes);
      const __m512i p = _mm512_set1_epi64(static_cast<long long>(qp[w]));
      const __m512i n = _mm512_set1_epi64(static_cast<long long>(qn[w]));
      const __m512i agree = _mm512_or_si512(_mm512_and_si512(p, kp), _mm512_and_si512(n, kn));
      const __m512i disagree = _mm512_or_si512(_mm512_and_si512(p, kn), _mm512_and_si512(n, kp));
      acc = _mm512_add_epi64(acc, _mm512_sub_epi64(_mm512_popcnt_epi64(agree), _mm512_popcnt_epi64(disagree)));
    }
    store_counts(acc, out + b * kLanes);
  }
}

}  // namespace

const PopcountKernels& popcount_vpopcntdq() {
  static const PopcountKernels table{and_counts_vpop, xor_counts_vpop, ternary_counts_vpop};
  return table;
}

}  // namespace ortsparse::kernels
