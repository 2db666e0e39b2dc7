// Popcount scoring of one packed query against blocks of packed keys, one table per popcount
// instruction path (AVX-512 VPOPCNTDQ, scalar POPCNT, portable SWAR), chosen at run time.
//
// Packed key layout (see docs/ops.md#popcountattention): keys are grouped in blocks of kLanes;
// block b holds planes x words x kLanes uint64, i.e. word w of plane p of key (b*kLanes + l) sits
// at packed[((b * planes + p) * words + w) * kLanes + l]. One vector load then covers the same
// word of kLanes keys, which is what VPOPCNTDQ wants; the other paths read the same layout.
// Padding keys and padding bits (D not a multiple of 64) are zero in every plane.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace ortsparse::kernels {

constexpr size_t kLanes = 8;

struct PopcountKernels {
  // out[j] = sum_w popcount(q[w] & key_j[w]) for the keys of n_blocks blocks (one plane).
  void (*and_counts)(const uint64_t* q, const uint64_t* packed, size_t words, size_t n_blocks, int32_t* out);
  // out[j] = sum_w popcount(q[w] ^ key_j[w]) (one plane).
  void (*xor_counts)(const uint64_t* q, const uint64_t* packed, size_t words, size_t n_blocks, int32_t* out);
  // Two planes (pos, neg): out[j] = |qp&kp| + |qn&kn| - |qp&kn| - |qn&kp|.
  void (*ternary_counts)(const uint64_t* qp, const uint64_t* qn, const uint64_t* packed, size_t words,
                         size_t n_blocks, int32_t* out);
};

const PopcountKernels& popcount_portable();
const PopcountKernels& popcount_popcnt();
const PopcountKernels& popcount_vpopcntdq();

}  // namespace ortsparse::kernels
