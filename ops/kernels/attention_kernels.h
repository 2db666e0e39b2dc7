// Kernels of attention: q·k over a list of keys, bit packing, key-row hashes. (P·V is the matmul
// kernels' gemv_rows: a weighted sum of V rows.) One variant per ISA, the scalar one
// is the reference twin (tests/ops/test_popcount_attention.py forces each with ORTSPARSE_ISA).
#pragma once

#include <cstddef>
#include <cstdint>


namespace ortsparse::kernels {

struct AttentionKernels {
  // out[i] = sum_d q[d] * k[row(i) * ldk + d],  row(i) = rows ? rows[i] : i.
  void (*dot_rows)(const float* q, const float* k, size_t ldk, size_t d, const int32_t* rows, size_t n, float* out);
  // Bit packing of one vector x[0:d] (mode: 1 sign, 2 binary, 3 ternary, as PackMode): word w of
  // plane p goes to out[(p * words + w) * stride]; adds the set bits to *bits_set; returns gamma
  // (sign: mean |x| over all d; binary/ternary: mean |x| over the active entries, eps if none),
  // accumulated in double so every ISA rounds to the same float but in rare boundary cases.
  float (*pack_row)(const float* x, size_t d, int mode, float eps, uint64_t* out, size_t stride, uint64_t* bits_set);
  // Keyed 128-bit hash of the bits of x[0:d] (two NH hashes, the second with the key shifted by
  // two words): out[0], out[1]. key holds row_hash_key_words(d) words. For any two different rows
  // and a uniformly random key the outputs collide with probability <= 2^-64.
  void (*row_hash)(const float* x, size_t d, const uint32_t* key, uint64_t* out);
  // Rotary embedding of the first 2·half entries of x into out (out != x): pairs (x[i], x[i + half])
  // or, interleaved, (x[2i], x[2i + 1]), rotated by cos[i], sin[i] (kernels/rotary_generic.h).
  void (*rotate)(const float* x, const float* cos, const float* sin, size_t half, int interleaved, float* out);
  // out[i] = exp(x[i] - shift) (kernels/exp_generic.h: the same bits on every ISA; below e^-87: 0);
  // returns the sum of out in double. out may be x.
  double (*exp_sub)(const float* x, size_t n, float shift, float* out);
};

inline size_t row_hash_key_words(size_t d) { return (d + 1) / 2 * 2 + 2; }

const AttentionKernels& attention_kernels_scalar();
const AttentionKernels& attention_kernels_avx2();
const AttentionKernels& attention_kernels_avx512();

}  // namespace ortsparse::kernels
