// Kernels of the `quant` weight backend: W is block-quantized along K (MatMulNBits' format, 4 or 8
// bits, one fp32 scale and one uint8 zero point per (K-block, column)), repacked by QuantWeights
// (engine/quant_backend.h) into the layout below. Every ISA provides the same table; the scalar one is the
// reference the SIMD twins are tested against (tests/ops/test_quant_kernels.py).
//
// Weight of row k, column n:  w = scale[b, n] * (q[k, n] - zp[b, n]),  b = k / block.
//
// Numerics.
//  * decode: per K-block, acc[n] = sum over the kept rows r of x[r] * q[r, n] in fp32 (q converted
//    exactly), then out[n] += scale * (acc[n] - zp * sum_r x[r]). That is an fp32 product of the
//    dequantized weights (MatMulNBits accuracy_level 0) up to rounding: the zero-point term is
//    subtracted per block instead of per weight.
//  * decode_int8 (accuracy_level 4): the token's kept activations quantized per K-block exactly as
//    prefill quantizes them (amax over the block's kept rows; gated-off rows are 0), exact int32 dot
//    products dot[n] = sum over the kept rows r of q(x[r]) * q[r, n], then per block
//    out[n] = fma(wscale, fma(-zp, ascale * sum_r q(x[r]), float(dot) * ascale), out[n]): the same
//    fp32 operations in the same order on every ISA, so every ISA gives bit-identical results.
//  * prefill: activations quantized per (token, K-block) to int8, symmetric, a = round_even(x * 127 /
//    amax) with scale amax / 127 (MatMulNBits accuracy_level 4); exact int32 dot products with the
//    unsigned weights, then out[n] += wscale * (ascale * dot - zp * ascale * sum(a)) in fp32.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "common/cpu_features.h"

namespace ortsparse::kernels {

// Columns are packed in groups of 64: one group row is 64 bytes at 8 bits, 32 bytes at 4 bits.
constexpr size_t kQuantGroup = 64;

// The repacked weights. Columns are split into `num_panels` panels of `panel` columns (a multiple
// of kQuantGroup; columns >= N are padding with q = 0, scale = 0, zp = 0). Inside a panel the K rows
// follow each other, each `row_bytes` = panel * bits / 8 bytes, so a decode step that skips a row
// skips its bytes and a kept row is one contiguous run (long runs keep the hardware prefetchers
// streaming). Inside a row the columns go group by group; at 8 bits byte i of a group is column i,
// at 4 bits byte i (< 32) holds column i in its low nibble and column i + 32 in its high nibble.
struct QuantPacked {
  size_t k = 0, n = 0, bits = 8, block = 32, num_blocks = 0;
  size_t panel = 0, num_panels = 0, row_bytes = 0;
  const uint8_t* q = nullptr;            // [num_panels][k][row_bytes]
  const float* scales = nullptr;         // [num_panels][num_blocks][panel]
  const uint8_t* zero_points = nullptr;  // [num_panels][num_blocks][panel], or null: default_zp everywhere
  uint8_t default_zp = 128;              // 8 at 4 bits, 128 at 8 bits (MatMulNBits' default)

  const uint8_t* panel_q(size_t p) const { return q + p * k * row_bytes; }
  const float* panel_scales(size_t p) const { return scales + p * num_blocks * panel; }
  const uint8_t* panel_zero_points(size_t p) const {
    return zero_points ? zero_points + p * num_blocks * panel : nullptr;
  }
};

// The kept rows of K-block b in a decode call's row list: [begin, end) of `rows` (the list cursor
// `next` advanced past them), or the block's own rows [b * block, ...) when rows is null. False: the
// block keeps no row (the decode kernels skip it, its scales included).
inline bool block_kept_range(const QuantPacked& p, size_t b, const int32_t* rows, size_t nrows, size_t& next,
                             size_t& begin, size_t& end) {
  const size_t r0 = b * p.block, r1 = std::min(p.k, r0 + p.block);
  if (rows == nullptr) {
    begin = r0;
    end = r1;
    return true;
  }
  begin = next;
  while (next < nrows && static_cast<size_t>(rows[next]) < r1) ++next;
  end = next;
  return begin != end;
}

// Activations of the dense prefill tokens, quantized per (token, K-block) to int8 (see Numerics).
struct QuantActivations {
  size_t m = 0;               // tokens
  size_t ldq = 0;             // num_blocks * block (K padded to whole blocks, pad = 0)
  const int8_t* q = nullptr;     // [m][ldq]
  const int16_t* q16 = nullptr;  // the same values widened (kernels that multiply int16 pairs)
  const float* scale = nullptr;   // [m][num_blocks] (times the token's gate scale)
  const int32_t* sum = nullptr;   // [m][num_blocks]: sum of the block's q
};

// One decode token's activations for `decode_int8`, quantized by `quantize` (gate scale 1) from x
// with its gated-off rows set to 0: q indexed by K row (only kept rows are read), per K-block
// scale = amax / 127 and sum = sum of the block's q.
struct QuantDecodeActivations {
  const int8_t* q = nullptr;
  const float* scale = nullptr;
  const int32_t* sum = nullptr;
};

struct QuantKernels {
  // One token, one panel, K-blocks [b0, b1): out[0:panel] = sum over those blocks b of
  // scale[b, :] * (sum_{r in rows of b} x[r] * q[r, :] - zp[b, :] * sum_{r in rows of b} x[r]).
  // rows == nullptr: every row of the blocks; else `nrows` kept rows (ascending, all inside the
  // blocks). Only the kept rows' bytes (and the scales of blocks with a kept row) are read.
  // lookahead: how many entries of the token's list follow rows[nrows - 1] (another task's rows):
  // they are prefetched, not computed, so that a task run after this one on the same thread starts
  // warm (dense: rows up to K are prefetched the same way).
  // acc: scratch of `panel` floats. out is overwritten (padding columns included).
  void (*decode)(const QuantPacked& p, size_t panel, size_t b0, size_t b1, const float* x, const int32_t* rows,
                 size_t nrows, size_t lookahead, float* out, float* acc);

  // `decode` with int8 activations (see Numerics): out[0:panel] = sum over blocks b in [b0, b1) with a
  // kept row of wscale[b, :] * (a.scale[b] * dot_b[:] - zp[b, :] * a.scale[b] * a.sum[b]). Rows,
  // lookahead and out as `decode`; acc: scratch of `panel` int32.
  void (*decode_int8)(const QuantPacked& p, size_t panel, size_t b0, size_t b1, const QuantDecodeActivations& a,
                      const int32_t* rows, size_t nrows, size_t lookahead, float* out, int32_t* acc);

  // Tokens t < a.m, columns [c0, c1) of a panel (multiples of kQuantGroup):
  //   ys[t][j - c0] = (bias ? bias[j - c0] : 0) + sum_b wscale[b, j] * (a.scale[t, b] * dot(t, b, j)
  //                   - zp[b, j] * a.scale[t, b] * a.sum[t, b])     for j < c0 + valid,
  // where dot is the exact int32 product over the block. Writes nothing past `valid` columns.
  // scratch: prefill_scratch_bytes(p, a.m) bytes, 64-byte aligned (the kernel repacks a column
  // chunk into its dot-product order there, reused by every token, and keeps per-token partial sums).
  void (*prefill)(const QuantPacked& p, size_t panel, size_t c0, size_t c1, const QuantActivations& a,
                  float* const* ys, size_t valid, const float* bias, uint8_t* scratch);
  size_t (*prefill_scratch_bytes)(const QuantPacked& p, size_t m);

  // One token's activations for `prefill`: q and q16 [num_blocks * block] (past K: 0; q16 may be null:
  // not written, as the decode needs none), scale and sum
  // [num_blocks], as quantize_activations defines them (every ISA gives identical values: the
  // rounding is one fp32 product rounded half to even).
  void (*quantize)(const float* x, size_t k, size_t block, size_t num_blocks, float gate_scale, int8_t* q,
                   int16_t* q16, float* scale, int32_t* sum);
};

const QuantKernels& quant_kernels_scalar();
const QuantKernels& quant_kernels_avx2();
const QuantKernels& quant_kernels_avx512();  // VNNI prefill where the CPU has it, else AVX2's

// The reference quantization (the scalar table's `quantize` without q16): per block, amax = max |x|,
// q = round_half_even(x * (127 / amax)) (0 when amax = 0), scale = amax / 127 * gate_scale,
// sum = sum of q; a block holding a NaN or an infinity gets q = 0 and scale = NaN.
void quantize_activations(const float* x, size_t k, size_t block, size_t num_blocks, float gate_scale, int8_t* q,
                          float* scale, int32_t* sum);

}  // namespace ortsparse::kernels
