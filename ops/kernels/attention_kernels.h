// Kernels of attention: q·k over a list of keys, bit packing, key-row hashes. (P·V is the matmul
// kernels' gemv_rows: a weighted sum of V rows.) One variant per ISA, the scalar one
// is the reference twin (tests/ops/test_popcount_attention.py forces each with ORTSPARSE_ISA).
#pragma once

#include <cstddef>
#include <cstdint>


namespace ortsparse::kernels {

// Keys per tile of the tiled (flash) prompt kernel: a tile's K^T is [d][kFlashKeys] floats.
constexpr size_t kFlashKeys = 64;

// One step of the online softmax of a block of query rows against one key tile (flash attention).
// Row r < m: s_j = cap(q_r·k_j · scale) + bias[r·ldb + j], -inf for keys outside [lo[r], hi[r])
// (lo/hi null: every key j < n); then row_max, row_sum (sum of exp(s - row_max)) and the
// unnormalised output o[r·dv ...] are updated as softmax's running state: o = o·exp(old - new) +
// sum_j exp(s_j - new)·v_j. A row with no finite score yet is left alone (row_max stays -inf).
struct FlashTile {
  const float* q = nullptr;   // m rows of d floats, contiguous
  const float* kt = nullptr;  // the tile's keys transposed: kt[c·kFlashKeys + j]; columns j >= n are 0
  const float* v = nullptr;   // n rows of dv floats, row stride ldv
  size_t ldv = 0, m = 0, n = 0, d = 0, dv = 0;
  float scale = 1.0f, softcap = 0.0f;  // softcap > 0: s = softcap·tanh(s / softcap) before the bias
  const float* bias = nullptr;  // null or m rows of n added values, row stride ldb
  size_t ldb = 0;
  const int32_t* lo = nullptr;  // null, or per row the attended keys [lo[r], hi[r]) of the tile
  const int32_t* hi = nullptr;
  float* scores = nullptr;      // scratch: m·kFlashKeys floats
  float* row_max = nullptr;     // m: running max (-inf before the first tile)
  float* row_sum = nullptr;     // m: running sum of exp(s - row_max)
  float* o = nullptr;           // m rows of dv floats, contiguous

  // Points the tile at n keys (kt, v) with per-row ranges (null: every key) and a bias (null: none;
  // rows kFlashKeys apart), the part that changes from one key tile to the next.
  void set_keys(const float* keys_t, const float* values, size_t count, const int32_t* row_lo, const int32_t* row_hi,
                const float* tile_bias);
};

inline void FlashTile::set_keys(const float* keys_t, const float* values, size_t count, const int32_t* row_lo,
                                const int32_t* row_hi, const float* tile_bias) {
  kt = keys_t;
  v = values;
  n = count;
  lo = row_lo;
  hi = row_hi;
  bias = tile_bias;
  ldb = kFlashKeys;
}

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
  // The tiled prompt path's step (FlashTile above).
  void (*flash_tile)(const FlashTile& t);
};

inline size_t row_hash_key_words(size_t d) { return (d + 1) / 2 * 2 + 2; }

const AttentionKernels& attention_kernels_scalar();
const AttentionKernels& attention_kernels_avx2();
const AttentionKernels& attention_kernels_avx512();

}  // namespace ortsparse::kernels
