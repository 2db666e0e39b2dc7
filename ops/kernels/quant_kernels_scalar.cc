// Scalar reference kernels of the quant backend: the definitions the SIMD twins are tested against.
#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/quant_kernels.h"

namespace ortsparse::kernels {
namespace {

// q of column j (panel-local) in a packed row.
inline int q_at(const uint8_t* row, size_t bits, size_t j) {
  const size_t g = j / kQuantGroup, i = j % kQuantGroup;
  if (bits == 8) return row[g * kQuantGroup + i];
  const uint8_t byte = row[g * (kQuantGroup / 2) + i % (kQuantGroup / 2)];
  return i < kQuantGroup / 2 ? (byte & 0x0F) : (byte >> 4);
}

inline float zp_at(const uint8_t* zp, const QuantPacked& p, size_t b, size_t j) {
  return static_cast<float>(zp ? zp[b * p.panel + j] : p.default_zp);
}

void decode(const QuantPacked& p, size_t panel, size_t b0, size_t b1, const float* x, const int32_t* rows,
            size_t nrows, size_t /*lookahead: the scalar reference does not prefetch*/, float* out, float* acc) {
  const size_t width = p.panel;
  const uint8_t* q = p.panel_q(panel);
  const float* scales = p.panel_scales(panel);
  const uint8_t* zp = p.panel_zero_points(panel);
  std::fill(out, out + width, 0.0f);
  size_t next = 0;  // into rows
  for (size_t b = b0; b < b1; ++b) {
    size_t begin = 0, end = 0;
    if (!block_kept_range(p, b, rows, nrows, next, begin, end)) continue;
    std::fill(acc, acc + width, 0.0f);
    float xs = 0.0f;
    for (size_t i = begin; i < end; ++i) {
      const size_t r = rows ? static_cast<size_t>(rows[i]) : i;
      const float xv = x[r];
      xs += xv;
      const uint8_t* row = q + r * p.row_bytes;
      for (size_t j = 0; j < width; ++j) acc[j] = std::fma(xv, static_cast<float>(q_at(row, p.bits, j)), acc[j]);
    }
    for (size_t j = 0; j < width; ++j)
      out[j] = std::fma(scales[b * width + j], std::fma(-zp_at(zp, p, b, j), xs, acc[j]), out[j]);
  }
}

void decode_int8(const QuantPacked& p, size_t panel, size_t b0, size_t b1, const QuantDecodeActivations& a,
                 const int32_t* rows, size_t nrows, size_t /*lookahead*/, float* out, int32_t* acc) {
  const size_t width = p.panel;
  const uint8_t* q = p.panel_q(panel);
  const float* scales = p.panel_scales(panel);
  const uint8_t* zp = p.panel_zero_points(panel);
  std::fill(out, out + width, 0.0f);
  size_t next = 0;
  for (size_t b = b0; b < b1; ++b) {
    size_t begin = 0, end = 0;
    if (!block_kept_range(p, b, rows, nrows, next, begin, end)) continue;
    std::fill(acc, acc + width, 0);
    for (size_t i = begin; i < end; ++i) {
      const size_t r = rows ? static_cast<size_t>(rows[i]) : i;
      const int32_t xq = a.q[r];
      const uint8_t* row = q + r * p.row_bytes;
      for (size_t j = 0; j < width; ++j) acc[j] += xq * q_at(row, p.bits, j);
    }
    const float sa = a.scale[b], sas = sa * static_cast<float>(a.sum[b]);
    for (size_t j = 0; j < width; ++j)
      out[j] = std::fma(scales[b * width + j], std::fma(-zp_at(zp, p, b, j), sas, static_cast<float>(acc[j]) * sa), out[j]);
  }
}

void prefill(const QuantPacked& p, size_t panel, size_t c0, size_t c1, const QuantActivations& a, float* const* ys,
             size_t valid, const float* bias, uint8_t* scratch) {
  const size_t width = p.panel, nb = p.num_blocks;
  const uint8_t* q = p.panel_q(panel);
  const float* scales = p.panel_scales(panel);
  const uint8_t* zp = p.panel_zero_points(panel);
  const size_t count = std::min(valid, c1 - c0);
  for (size_t t = 0; t < a.m; ++t) {
    const int8_t* aq = a.q + t * a.ldq;
    for (size_t jj = 0; jj < count; ++jj) {
      const size_t j = c0 + jj;
      float f = 0.0f;
      for (size_t b = 0; b < nb; ++b) {
        const size_t r0 = b * p.block, r1 = std::min(p.k, r0 + p.block);
        int32_t dot = 0;
        for (size_t r = r0; r < r1; ++r) dot += static_cast<int32_t>(aq[r]) * q_at(q + r * p.row_bytes, p.bits, j);
        const float sa = a.scale[t * nb + b];
        const float sas = sa * static_cast<float>(a.sum[t * nb + b]);
        const float v = std::fma(-zp_at(zp, p, b, j), sas, static_cast<float>(dot) * sa);
        f = std::fma(scales[b * width + j], v, f);
      }
      ys[t][jj] = (bias ? bias[jj] : 0.0f) + f;
    }
  }
}

size_t prefill_scratch_bytes(const QuantPacked&, size_t) { return 0; }

}  // namespace

void quantize_activations(const float* x, size_t k, size_t block, size_t num_blocks, float gate_scale, int8_t* q,
                          float* scale, int32_t* sum) {
  for (size_t b = 0; b < num_blocks; ++b) {
    const size_t r0 = b * block, r1 = std::min(k, r0 + block);
    float amax = 0.0f;
    bool finite = true;
    for (size_t r = r0; r < r1; ++r) {
      finite &= std::isfinite(x[r]);
      amax = std::max(amax, std::fabs(x[r]));
    }
    int8_t* qb = q + r0;
    std::fill(qb, qb + block, int8_t{0});
    sum[b] = 0;
    if (!finite) {  // the block's products become NaN, as they would in fp32
      scale[b] = std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t s = 0;
    for (size_t r = r0; r < r1; ++r) {
      const float v = std::nearbyint(x[r] * inv);  // round half to even (the default rounding mode)
      const int32_t iv = static_cast<int32_t>(std::min(127.0f, std::max(-127.0f, v)));
      qb[r - r0] = static_cast<int8_t>(iv);
      s += iv;
    }
    sum[b] = s;
    scale[b] = amax / 127.0f * gate_scale;
  }
}

namespace {
void quantize(const float* x, size_t k, size_t block, size_t num_blocks, float gate_scale, int8_t* q, int16_t* q16,
              float* scale, int32_t* sum) {
  quantize_activations(x, k, block, num_blocks, gate_scale, q, scale, sum);
  if (q16)
    for (size_t r = 0; r < num_blocks * block; ++r) q16[r] = q[r];
}
}  // namespace

const QuantKernels& quant_kernels_scalar() {
  static const QuantKernels table{decode, decode_int8, prefill, prefill_scratch_bytes, quantize};
  return table;
}

}  // namespace ortsparse::kernels
