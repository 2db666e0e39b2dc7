// AVX-512 (F/BW/VL/DQ) kernels of the quant backend: decode (the kept rows' bytes converted to fp32
// and multiplied in fp32) and the activation quantization. The prefill GEMM needs VNNI and lives in
// quant_kernels_avx512_vnni.cc (compiled with -mavx512vnni, called only when the CPU has it);
// without VNNI the table takes the AVX2 prefill.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/quant_decode_generic.h"
#include "kernels/quant_kernels.h"

namespace ortsparse::kernels {
namespace {

// ---------------------------------------------------------------------------------------------
// Decode
// ---------------------------------------------------------------------------------------------

// Rows per pass over the panel: each pass loads and stores the block accumulator once.
constexpr size_t kPassRows = 8;
using generic::Mode, generic::kFirst, generic::kMiddle, generic::kLast, generic::kOnly;

inline __m512 bytes_to_float(__m128i bytes) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes)); }

template <int kBits, int R, Mode kMode>
void pass(const uint8_t* const* rows, const uint8_t* const* ahead, const float* xv, size_t groups, float* acc,
          float* out, const float* scales, const uint8_t* zp, float default_zp, float xs) {
  __m512 xb[R];
  for (int i = 0; i < R; ++i) xb[i] = _mm512_set1_ps(xv[i]);
  const __m512 xsv = _mm512_set1_ps(xs), zpc = _mm512_set1_ps(default_zp);
  const __m512 nibble_values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (size_t g = 0; g < groups; ++g) {
    // The rows generic::prefetch_rows() further down the token's list: a gated list jumps where the hardware
    // prefetchers cannot follow, so the kernel fetches them itself (one line per row and group).
    for (int i = 0; i < R; ++i) _mm_prefetch(reinterpret_cast<const char*>(ahead[i] + g * (kQuantGroup * kBits / 8)), _MM_HINT_T0);
    float* ag = acc + g * kQuantGroup;
    __m512 s[4];
    for (int v = 0; v < 4; ++v)
      s[v] = (kMode == kMiddle || kMode == kLast) ? _mm512_loadu_ps(ag + 16 * v) : _mm512_setzero_ps();
    for (int i = 0; i < R; ++i) {
      if (kBits == 8) {
        const uint8_t* q = rows[i] + g * kQuantGroup;
        for (int v = 0; v < 4; ++v)
          s[v] = _mm512_fmadd_ps(xb[i], bytes_to_float(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * v))), s[v]);
      } else {
        const uint8_t* q = rows[i] + g * (kQuantGroup / 2);
        for (int h = 0; h < 2; ++h) {
          const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * h)));
          // vpermps reads only the low 4 bits of each index: the low nibble as a float in one step.
          s[h] = _mm512_fmadd_ps(xb[i], _mm512_permutexvar_ps(d, nibble_values), s[h]);
          s[h + 2] = _mm512_fmadd_ps(xb[i], _mm512_cvtepi32_ps(_mm512_srli_epi32(d, 4)), s[h + 2]);
        }
      }
    }
    if (kMode == kFirst || kMode == kMiddle) {
      for (int v = 0; v < 4; ++v) _mm512_storeu_ps(ag + 16 * v, s[v]);
    } else {
      float* og = out + g * kQuantGroup;
      const float* sg = scales + g * kQuantGroup;
      for (int v = 0; v < 4; ++v) {
        const __m512 z =
            zp ? bytes_to_float(_mm_loadu_si128(reinterpret_cast<const __m128i*>(zp + g * kQuantGroup + 16 * v))) : zpc;
        const __m512 t = _mm512_fnmadd_ps(z, xsv, s[v]);
        _mm512_storeu_ps(og + 16 * v, _mm512_fmadd_ps(_mm512_loadu_ps(sg + 16 * v), t, _mm512_loadu_ps(og + 16 * v)));
      }
    }
  }
}

template <int kBits, int R>
void pass_mode(Mode mode, const uint8_t* const* rows, const uint8_t* const* ahead, const float* xv, size_t groups,
               float* acc, float* out, const float* scales, const uint8_t* zp, float default_zp, float xs) {
  switch (mode) {
    case kFirst: return pass<kBits, R, kFirst>(rows, ahead, xv, groups, acc, out, scales, zp, default_zp, xs);
    case kMiddle: return pass<kBits, R, kMiddle>(rows, ahead, xv, groups, acc, out, scales, zp, default_zp, xs);
    case kLast: return pass<kBits, R, kLast>(rows, ahead, xv, groups, acc, out, scales, zp, default_zp, xs);
    case kOnly: return pass<kBits, R, kOnly>(rows, ahead, xv, groups, acc, out, scales, zp, default_zp, xs);
  }
}

template <int kBits>
void decode(const QuantPacked& p, size_t panel, size_t b0, size_t b1, const float* x, const int32_t* rows,
            size_t nrows, size_t lookahead, float* out, float* acc) {
  const size_t width = p.panel, groups = width / kQuantGroup;
  const float default_zp = p.default_zp;
  for (size_t j = 0; j < width; j += 16) _mm512_storeu_ps(out + j, _mm512_setzero_ps());
  generic::for_each_decode_pass<kPassRows>(
      p, panel, b0, b1, x, rows, nrows, lookahead,
      [&](int count, Mode mode, const uint8_t* const* qr, const uint8_t* const* pf, const float* xv, const float* sb,
          const uint8_t* zb, float xs) {
        generic::with_pass_rows<static_cast<int>(kPassRows)>(count, [&](auto rows_per_pass) {
          pass_mode<kBits, decltype(rows_per_pass)::value>(mode, qr, pf, xv, groups, acc, out, sb, zb, default_zp, xs);
        });
      });
}

void decode_any(const QuantPacked& p, size_t panel, size_t b0, size_t b1, const float* x, const int32_t* rows,
                size_t nrows, size_t lookahead, float* out, float* acc) {
  (p.bits == 4 ? decode<4> : decode<8>)(p, panel, b0, b1, x, rows, nrows, lookahead, out, acc);
}

void quantize(const float* x, size_t k, size_t block, size_t num_blocks, float gate_scale, int8_t* q, int16_t* q16,
              float* scale, int32_t* sum) {
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (size_t b = 0; b < num_blocks; ++b) {
    const size_t r0 = b * block, len = std::min(k, r0 + block) - r0;
    __m512 amax = _mm512_setzero_ps(), nonfinite = _mm512_setzero_ps();  // x - x is NaN for NaN and +-inf
    for (size_t i = 0; i < block; i += 16) {
      const __mmask16 m = i >= len ? 0 : (len - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (len - i)) - 1u));
      const __m512 v = _mm512_maskz_loadu_ps(m, x + r0 + i);
      amax = _mm512_max_ps(amax, _mm512_andnot_ps(sign, v));
      nonfinite = _mm512_add_ps(nonfinite, _mm512_sub_ps(v, v));
    }
    const float top = _mm512_reduce_max_ps(amax);
    if (std::isnan(_mm512_reduce_add_ps(nonfinite))) {
      std::fill(q + r0, q + r0 + block, int8_t{0});
      if (q16) std::fill(q16 + r0, q16 + r0 + block, int16_t{0});
      scale[b] = std::numeric_limits<float>::quiet_NaN();
      sum[b] = 0;
      continue;
    }
    const __m512 inv = _mm512_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    __m512i total = _mm512_setzero_si512();
    for (size_t i = 0; i < block; i += 16) {
      const __mmask16 m = i >= len ? 0 : (len - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (len - i)) - 1u));
      const __m512 v = _mm512_maskz_loadu_ps(m, x + r0 + i);
      const __m512i iv = _mm512_min_epi32(hi, _mm512_max_epi32(lo, _mm512_cvtps_epi32(_mm512_mul_ps(v, inv))));
      total = _mm512_add_epi32(total, iv);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + r0 + i), _mm512_cvtsepi32_epi8(iv));
      if (q16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(q16 + r0 + i), _mm512_cvtsepi32_epi16(iv));
    }
    sum[b] = _mm512_reduce_add_epi32(total);
    scale[b] = top / 127.0f * gate_scale;
  }
}

}  // namespace

// quant_kernels_avx512_vnni.cc
void quant_prefill_avx512_vnni(const QuantPacked& p, size_t panel, size_t c0, size_t c1, const QuantActivations& a,
                               float* const* ys, size_t valid, const float* bias, uint8_t* scratch);
size_t quant_prefill_avx512_vnni_scratch_bytes(const QuantPacked& p, size_t m);
void quant_decode_int8_avx512_vnni(const QuantPacked& p, size_t panel, size_t b0, size_t b1,
                                   const QuantDecodeActivations& a, const int32_t* rows, size_t nrows, size_t lookahead,
                                   float* out, int32_t* acc);

const QuantKernels& quant_kernels_avx512() {
  static const QuantKernels table = [] {
    QuantKernels t{decode_any, quant_decode_int8_avx512_vnni, quant_prefill_avx512_vnni,
                   quant_prefill_avx512_vnni_scratch_bytes, quantize};
    if (!cpu_features().avx512vnni) {  // AVX-512 without VNNI: the AVX2 int8 decode and int16 prefill
      t.decode_int8 = quant_kernels_avx2().decode_int8;
      t.prefill = quant_kernels_avx2().prefill;
      t.prefill_scratch_bytes = quant_kernels_avx2().prefill_scratch_bytes;
    }
    return t;
  }();
  return table;
}

}  // namespace ortsparse::kernels
