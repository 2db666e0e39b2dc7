// Leaf kernels of the gated matmul (row streaming, per-block input scores) and of top-k selection.
// Each ISA provides the same tables; matmul_kernels_scalar.cc is the reference every SIMD variant
// is tested against (tests/ops/test_kernels.py, tails included).
#pragma once

#include <cstddef>
#include <cstdint>

namespace ortsparse::kernels {

// Token-tile width of gemm_rows: one W row chunk is loaded once and used by this many tokens.
constexpr size_t kTokenTile = 4;

// Extra entries an index output buffer needs beyond its logical size (see indices_in_range).
constexpr size_t kIndexSlack = 16;

struct MatMulKernels {
  // y[0:n] = (accumulate ? y : 0) + sum_i xv[i] * w[row(i) * ldw + 0:n],  row(i) = rows ? rows[i] : i.
  // One token (M = 1, decode): W rows stream from memory once, y stays in L1.
  void (*gemv_rows)(const float* w, size_t ldw, const int32_t* rows, const float* xv, size_t nrows,
                    float* y, size_t n, bool accumulate);

  // For t < kTokenTile: y[t * ldy + 0:n] = (accumulate ? . : 0) + sum_i xv[i * kTokenTile + t] * w[row(i) * ldw + 0:n].
  // A tile of tokens sharing one row list (rows a token does not use carry xv = 0).
  void (*gemm_rows)(const float* w, size_t ldw, const int32_t* rows, const float* xv, size_t nrows,
                    float* y, size_t ldy, size_t n, bool accumulate);

  // out[b] = sum over the block's entries of x^2 (sumsq) or |x| (sumabs); the last block may be short.
  void (*block_sumsq)(const float* x, size_t k, size_t block, float* out);
  void (*block_sumabs)(const float* x, size_t k, size_t block, float* out);

  // out[i] = silu(gate[i]) * up[i] (SwiGLU's product), silu(g) = g * sigmoid(g), sigmoid from
  // e = exp(-|g|) as (g >= 0 ? 1 : e) / (1 + e) (never overflows; exp of exp_generic.h, so 0 for
  // g < -87, where |silu(g)| < 1e-35). Every step is exactly rounded, so the SIMD variants give the
  // scalar twin's bits.
  void (*silu_glu)(const float* gate, const float* up, size_t n, float* out);
};

// Helpers of the top-k selector (kernels/top_k.h) on order keys (kernels/order_key.h).
struct SelectKernels {
  // keys[i] = order_key(values[i]); returns their min and max (n >= 1).
  void (*order_keys)(const float* values, size_t n, uint32_t* keys, uint32_t* min_key, uint32_t* max_key);
  // number of keys >= t;
  size_t (*count_at_least)(const uint32_t* keys, size_t n, uint32_t t);
  // writes the indices i (ascending) with lo <= keys[i] <= hi to out; returns how many. `out` must
  // have room for n + kIndexSlack entries (SIMD variants store whole vectors).
  size_t (*indices_in_range)(const uint32_t* keys, size_t n, uint32_t lo, uint32_t hi, int32_t* out);
};

const MatMulKernels& matmul_kernels_scalar();
const MatMulKernels& matmul_kernels_avx2();
const MatMulKernels& matmul_kernels_avx512();
const SelectKernels& select_kernels_scalar();
const SelectKernels& select_kernels_avx2();
const SelectKernels& select_kernels_avx512();

}  // namespace ortsparse::kernels
