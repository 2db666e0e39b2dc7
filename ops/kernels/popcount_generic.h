// The three scoring loops over the packed layout, parameterised by the popcount of one word.
// Included by the portable and POPCNT files, each compiled with its own flags.
#pragma once

#include "kernels/popcount_kernels.h"

namespace ortsparse::kernels::generic {

template <int (*Pop)(uint64_t)>
void and_counts(const uint64_t* q, const uint64_t* packed, size_t words, size_t n_blocks, int32_t* out) {
  for (size_t b = 0; b < n_blocks; ++b) {
    const uint64_t* blk = packed + b * words * kLanes;
    for (size_t l = 0; l < kLanes; ++l) {
      int32_t c = 0;
      for (size_t w = 0; w < words; ++w) c += Pop(q[w] & blk[w * kLanes + l]);
      out[b * kLanes + l] = c;
    }
  }
}

template <int (*Pop)(uint64_t)>
void xor_counts(const uint64_t* q, const uint64_t* packed, size_t words, size_t n_blocks, int32_t* out) {
  for (size_t b = 0; b < n_blocks; ++b) {
    const uint64_t* blk = packed + b * words * kLanes;
    for (size_t l = 0; l < kLanes; ++l) {
      int32_t c = 0;
      for (size_t w = 0; w < words; ++w) c += Pop(q[w] ^ blk[w * kLanes + l]);
      out[b * kLanes + l] = c;
    }
  }
}

template <int (*Pop)(uint64_t)>
void ternary_counts(const uint64_t* qp, const uint64_t* qn, const uint64_t* packed, size_t words, size_t n_blocks,
                    int32_t* out) {
  for (size_t b = 0; b < n_blocks; ++b) {
    const uint64_t* pos = packed + b * 2 * words * kLanes;
    const uint64_t* neg = pos + words * kLanes;
    for (size_t l = 0; l < kLanes; ++l) {
      int32_t c = 0;
      for (size_t w = 0; w < words; ++w) {
        const uint64_t kp = pos[w * kLanes + l], kn = neg[w * kLanes + l];
        c += Pop((qp[w] & kp) | (qn[w] & kn)) - Pop((qp[w] & kn) | (qn[w] & kp));
      }
      out[b * kLanes + l] = c;
    }
  }
}

}  // namespace ortsparse::kernels::generic
