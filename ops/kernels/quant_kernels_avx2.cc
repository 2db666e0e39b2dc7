// AVX2 kernels of the quant backend. Decode converts the kept rows' bytes to fp32 and multiplies in
// fp32; prefill widens weights and int8 activations to int16 pairs and multiplies with vpmaddwd
// (exact, no saturation: vpmaddubsw would saturate on 8-bit weights).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/quant_decode_generic.h"
#include "kernels/quant_kernels.h"

namespace ortsparse::kernels {
namespace {

// Rows per pass over the panel (8 accumulators and the R broadcasts fit in 16 registers).
constexpr size_t kPassRows = 4;
using generic::Mode, generic::kFirst, generic::kMiddle, generic::kLast, generic::kOnly;

inline __m256 bytes_to_float(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// Half a group (32 columns) at a time keeps the 8 accumulators and R broadcasts in 16 registers:
// at 8 bits half h is columns [32h, 32h + 32); at 4 bits it is the bytes [16h, 16h + 16), i.e.
// columns [16h, 16h + 16) (low nibbles) and [32 + 16h, 48 + 16h) (high nibbles).
template <int kBits>
inline size_t column_of(size_t h, size_t v) {  // first column of vector v (0..3) of half h
  if (kBits == 8) return 32 * h + 8 * v;
  return (v < 2 ? 16 * h + 8 * v : 32 + 16 * h + 8 * (v - 2));
}

template <int kBits, int R, Mode kMode>
void pass(const uint8_t* const* rows, const uint8_t* const* ahead, const float* xv, size_t groups, float* acc,
          float* out, const float* scales, const uint8_t* zp, float default_zp, float xs) {
  __m256 xb[R];
  for (int i = 0; i < R; ++i) xb[i] = _mm256_set1_ps(xv[i]);
  const __m256i low4 = _mm256_set1_epi32(0x0F);
  for (size_t g = 0; g < groups; ++g) {
    // The rows generic::prefetch_rows() further down the token's list (see quant_kernels_avx512.cc).
    for (int i = 0; i < R; ++i) _mm_prefetch(reinterpret_cast<const char*>(ahead[i] + g * (kQuantGroup * kBits / 8)), _MM_HINT_T0);
    for (size_t h = 0; h < 2; ++h) {
      float* ag = acc + g * kQuantGroup;
      __m256 s[4];
      for (int v = 0; v < 4; ++v)
        s[v] = (kMode == kMiddle || kMode == kLast) ? _mm256_loadu_ps(ag + column_of<kBits>(h, v)) : _mm256_setzero_ps();
      for (int i = 0; i < R; ++i) {
        if (kBits == 8) {
          const uint8_t* q = rows[i] + g * kQuantGroup + 32 * h;
          for (int v = 0; v < 4; ++v) s[v] = _mm256_fmadd_ps(xb[i], bytes_to_float(q + 8 * v), s[v]);
        } else {
          const uint8_t* q = rows[i] + g * (kQuantGroup / 2) + 16 * h;
          for (int e = 0; e < 2; ++e) {
            const __m256i d = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * e)));
            s[e] = _mm256_fmadd_ps(xb[i], _mm256_cvtepi32_ps(_mm256_and_si256(d, low4)), s[e]);
            s[e + 2] = _mm256_fmadd_ps(xb[i], _mm256_cvtepi32_ps(_mm256_srli_epi32(d, 4)), s[e + 2]);
          }
        }
      }
      if (kMode == kFirst || kMode == kMiddle) {
        for (int v = 0; v < 4; ++v) _mm256_storeu_ps(ag + column_of<kBits>(h, v), s[v]);
      } else {
        const __m256 xsv = _mm256_set1_ps(xs);
        for (int v = 0; v < 4; ++v) {
          const size_t col = g * kQuantGroup + column_of<kBits>(h, v);
          const __m256 z = zp ? bytes_to_float(zp + col) : _mm256_set1_ps(default_zp);
          const __m256 t = _mm256_fnmadd_ps(z, xsv, s[v]);
          _mm256_storeu_ps(out + col, _mm256_fmadd_ps(_mm256_loadu_ps(scales + col), t, _mm256_loadu_ps(out + col)));
        }
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
  for (size_t j = 0; j < width; j += 8) _mm256_storeu_ps(out + j, _mm256_setzero_ps());
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

// ---------------------------------------------------------------------------------------------
// Int8 decode
// ---------------------------------------------------------------------------------------------

// Rows per pass (2 quads): more would spill the 16 ymm registers.
constexpr size_t kInt8PassRows = 8;

// Half h (32 columns) of a row's group g as unsigned bytes in column order (4 bits: the low nibbles
// of the group's 32 bytes are columns 0-31, the high nibbles 32-63).
template <int kBits>
inline __m256i half_bytes(const uint8_t* row, size_t g, size_t h) {
  if constexpr (kBits == 8) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + g * kQuantGroup + 32 * h));
  } else {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + g * (kQuantGroup / 2)));
    return _mm256_and_si256(h ? _mm256_srli_epi16(b, 4) : b, _mm256_set1_epi8(0x0F));
  }
}

// Four rows' 32 columns into dot-product order: dword d of 128-bit lane L of v[j] holds the four
// rows' bytes of column 16 L + 4 j + d (row e in byte e).
inline void interleave_quad(const __m256i r[4], __m256i v[4]) {
  const __m256i ab_lo = _mm256_unpacklo_epi8(r[0], r[1]), ab_hi = _mm256_unpackhi_epi8(r[0], r[1]);
  const __m256i cd_lo = _mm256_unpacklo_epi8(r[2], r[3]), cd_hi = _mm256_unpackhi_epi8(r[2], r[3]);
  v[0] = _mm256_unpacklo_epi16(ab_lo, cd_lo);
  v[1] = _mm256_unpackhi_epi16(ab_lo, cd_lo);
  v[2] = _mm256_unpacklo_epi16(ab_hi, cd_hi);
  v[3] = _mm256_unpackhi_epi16(ab_hi, cd_hi);
}

// Without VNNI: vpmaddubsw (unsigned x signed bytes, pairs summed to int16) and vpmaddwd by 1 (pairs
// of int16 summed to int32) give the same quad sums. 4-bit weights (<= 15) cannot saturate the
// int16 pairs; 8-bit weights can (255 * 127 * 2 > 32767), so they enter centred, c = w - 128, as
// |c| (<= 128, unsigned) times a with c's sign (|a| <= 127): pairs stay within 2 * 128 * 127, and
// 128 * sum(a) is added back at the end.
template <int kBits>
inline __m256i quad_dot(__m256i acc, __m256i w, __m256i a) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (kBits == 8) {
    const __m256i centred = _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80)));
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(centred), _mm256_sign_epi8(a, centred));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, ones));
  } else {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), ones));
  }
}

template <int kBits, int Q, Mode kMode>
void int8_pass(const uint8_t* const* rows, const uint8_t* const* ahead, const int32_t* packed, size_t groups,
               int32_t* acc, float* out, const float* scales, const uint8_t* zp, float default_zp, float ascale,
               float ascale_sum, int32_t centre_correction) {
  __m256i aq[Q];
  for (int i = 0; i < Q; ++i) aq[i] = _mm256_set1_epi32(packed[i]);
  constexpr size_t kGroupBytes = kQuantGroup * kBits / 8;
  for (size_t g = 0; g < groups; ++g) {
    for (int i = 0; i < 4 * Q; ++i) _mm_prefetch(reinterpret_cast<const char*>(ahead[i] + g * kGroupBytes), _MM_HINT_T0);
    for (size_t h = 0; h < 2; ++h) {
      int32_t* ag = acc + g * kQuantGroup + 32 * h;
      __m256i s[4];
      for (int v = 0; v < 4; ++v)
        s[v] = (kMode == kMiddle || kMode == kLast) ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ag + 8 * v))
                                                    : _mm256_setzero_si256();
      for (int i = 0; i < Q; ++i) {
        __m256i r[4], w[4];
        for (int e = 0; e < 4; ++e) r[e] = half_bytes<kBits>(rows[4 * i + e], g, h);
        interleave_quad(r, w);
        for (int v = 0; v < 4; ++v) s[v] = quad_dot<kBits>(s[v], w[v], aq[i]);
      }
      if (kMode == kFirst || kMode == kMiddle) {
        for (int v = 0; v < 4; ++v) _mm256_storeu_si256(reinterpret_cast<__m256i*>(ag + 8 * v), s[v]);
      } else {
        // Back to column order: n[i] = columns 8 i .. 8 i + 7 of the half.
        const __m256i n[4] = {_mm256_permute2x128_si256(s[0], s[1], 0x20), _mm256_permute2x128_si256(s[2], s[3], 0x20),
                              _mm256_permute2x128_si256(s[0], s[1], 0x31), _mm256_permute2x128_si256(s[2], s[3], 0x31)};
        const __m256 sa = _mm256_set1_ps(ascale), sas = _mm256_set1_ps(ascale_sum);
        const __m256i centre = _mm256_set1_epi32(centre_correction);
        for (int v = 0; v < 4; ++v) {
          const size_t col = g * kQuantGroup + 32 * h + 8 * v;
          const __m256 z = zp ? bytes_to_float(zp + col) : _mm256_set1_ps(default_zp);
          const __m256 dot = _mm256_cvtepi32_ps(_mm256_add_epi32(n[v], centre));
          const __m256 t = _mm256_fnmadd_ps(z, sas, _mm256_mul_ps(dot, sa));
          _mm256_storeu_ps(out + col, _mm256_fmadd_ps(_mm256_loadu_ps(scales + col), t, _mm256_loadu_ps(out + col)));
        }
      }
    }
  }
}

template <int kBits, int Q>
void int8_pass_mode(Mode mode, const uint8_t* const* rows, const uint8_t* const* ahead, const int32_t* packed,
                    size_t groups, int32_t* acc, float* out, const float* scales, const uint8_t* zp, float default_zp,
                    float ascale, float ascale_sum, int32_t centre) {
  switch (mode) {
    case kFirst: return int8_pass<kBits, Q, kFirst>(rows, ahead, packed, groups, acc, out, scales, zp, default_zp, ascale, ascale_sum, centre);
    case kMiddle: return int8_pass<kBits, Q, kMiddle>(rows, ahead, packed, groups, acc, out, scales, zp, default_zp, ascale, ascale_sum, centre);
    case kLast: return int8_pass<kBits, Q, kLast>(rows, ahead, packed, groups, acc, out, scales, zp, default_zp, ascale, ascale_sum, centre);
    case kOnly: return int8_pass<kBits, Q, kOnly>(rows, ahead, packed, groups, acc, out, scales, zp, default_zp, ascale, ascale_sum, centre);
  }
}

template <int kBits>
void decode_int8(const QuantPacked& p, size_t panel, size_t b0, size_t b1, const QuantDecodeActivations& a,
                 const int32_t* rows, size_t nrows, size_t lookahead, float* out, int32_t* acc) {
  const size_t width = p.panel, groups = width / kQuantGroup;
  const float default_zp = p.default_zp;
  for (size_t j = 0; j < width; j += 8) _mm256_storeu_ps(out + j, _mm256_setzero_ps());
  generic::for_each_int8_pass<kInt8PassRows>(
      p, panel, b0, b1, a.q, rows, nrows, lookahead,
      [&](int quads, Mode mode, const uint8_t* const* qr, const uint8_t* const* pf, const int32_t* packed, size_t b) {
        const float* sb = p.panel_scales(panel) + b * width;
        const uint8_t* zb = p.zero_points ? p.panel_zero_points(panel) + b * width : nullptr;
        const float sa = a.scale[b], sas = sa * static_cast<float>(a.sum[b]);
        const int32_t centre = kBits == 8 ? 128 * a.sum[b] : 0;
        generic::with_pass_rows<static_cast<int>(kInt8PassRows / 4)>(quads, [&](auto q) {
          int8_pass_mode<kBits, decltype(q)::value>(mode, qr, pf, packed, groups, acc, out, sb, zb, default_zp, sa, sas,
                                                    centre);
        });
      });
}

void decode_int8_any(const QuantPacked& p, size_t panel, size_t b0, size_t b1, const QuantDecodeActivations& a,
                     const int32_t* rows, size_t nrows, size_t lookahead, float* out, int32_t* acc) {
  (p.bits == 4 ? decode_int8<4> : decode_int8<8>)(p, panel, b0, b1, a, rows, nrows, lookahead, out, acc);
}

// ---------------------------------------------------------------------------------------------
// Prefill (int16 pairs)
// ---------------------------------------------------------------------------------------------

// Scratch: one column group repacked (per pair of K rows, 8 vectors of 8 columns in natural order,
// each dword = (w[r], w[r + 1]) as int16; rows >= K become 0), then per token the partial sums of
// the 16 columns being computed.
size_t pair_weight_bytes(const QuantPacked& p) { return p.num_blocks * p.block / 2 * 256; }
size_t pair_scratch_bytes(const QuantPacked& p, size_t m) { return pair_weight_bytes(p) + m * 16 * sizeof(float) + 64; }

template <int kBits>
void repack_pairs(const QuantPacked& p, size_t panel, size_t c, uint8_t* dst) {
  const size_t ldq = p.num_blocks * p.block, pairs = ldq / 2, rb = p.row_bytes;
  const uint8_t* q = p.panel_q(panel) + (kBits == 8 ? c : c / 2);
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (size_t pr = 0; pr < pairs; ++pr) {
    __m256i half[2][2];  // [row of the pair][32-column half]
    for (int e = 0; e < 2; ++e) {
      const size_t row = pr * 2 + e;
      if (row >= p.k) {
        half[e][0] = half[e][1] = _mm256_setzero_si256();
      } else if (kBits == 8) {
        half[e][0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + row * rb));
        half[e][1] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + row * rb + 32));
      } else {
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + row * rb));
        half[e][0] = _mm256_and_si256(b, low4);
        half[e][1] = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
      }
    }
    __m256i* out = reinterpret_cast<__m256i*>(dst + pr * 256);
    for (int hh = 0; hh < 2; ++hh) {
      const __m256i lo = _mm256_unpacklo_epi8(half[0][hh], half[1][hh]);  // cols 0-7 | 16-23
      const __m256i hi = _mm256_unpackhi_epi8(half[0][hh], half[1][hh]);  // cols 8-15 | 24-31
      _mm256_storeu_si256(out + 4 * hh + 0, _mm256_cvtepu8_epi16(_mm256_castsi256_si128(lo)));
      _mm256_storeu_si256(out + 4 * hh + 1, _mm256_cvtepu8_epi16(_mm256_castsi256_si128(hi)));
      _mm256_storeu_si256(out + 4 * hh + 2, _mm256_cvtepu8_epi16(_mm256_extracti128_si256(lo, 1)));
      _mm256_storeu_si256(out + 4 * hh + 3, _mm256_cvtepu8_epi16(_mm256_extracti128_si256(hi, 1)));
    }
  }
}

// T tokens x 16 columns (vectors 2v2, 2v2 + 1 of the group) over blocks [b0, b1), adding to the
// tokens' partial sums (which start at 0 when `first`).
template <int T>
void gemm_tile(const QuantPacked& p, size_t panel, size_t c, const uint8_t* w, size_t v2, const QuantActivations& a,
               size_t t0, size_t b0, size_t b1, bool first, float* sums_all) {
  const size_t nb = p.num_blocks, ldq = a.ldq, bp = p.block / 2;
  const float* scales = p.panel_scales(panel);
  const uint8_t* zp = p.panel_zero_points(panel);
  const int16_t* aq[T];
  for (int t = 0; t < T; ++t) aq[t] = a.q16 + (t0 + t) * ldq;
  __m256 f[T][2];
  for (int t = 0; t < T; ++t) {
    const float* sums = sums_all + (t0 + t) * 16;
    f[t][0] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(sums);
    f[t][1] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(sums + 8);
  }
  for (size_t b = b0; b < b1; ++b) {
    __m256i acc[T][2];
    for (int t = 0; t < T; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_si256();
    for (size_t pr = b * bp; pr < (b + 1) * bp; ++pr) {
      const __m256i* wp = reinterpret_cast<const __m256i*>(w + pr * 256) + 2 * v2;
      const __m256i w0 = _mm256_loadu_si256(wp), w1 = _mm256_loadu_si256(wp + 1);
      for (int t = 0; t < T; ++t) {
        int32_t pair;
        __builtin_memcpy(&pair, aq[t] + pr * 2, 4);
        const __m256i av = _mm256_set1_epi32(pair);
        acc[t][0] = _mm256_add_epi32(acc[t][0], _mm256_madd_epi16(w0, av));
        acc[t][1] = _mm256_add_epi32(acc[t][1], _mm256_madd_epi16(w1, av));
      }
    }
    const size_t col = b * p.panel + c + 16 * v2;
    const __m256 sw0 = _mm256_loadu_ps(scales + col), sw1 = _mm256_loadu_ps(scales + col + 8);
    const __m256 z0 = zp ? bytes_to_float(zp + col) : _mm256_set1_ps(p.default_zp);
    const __m256 z1 = zp ? bytes_to_float(zp + col + 8) : _mm256_set1_ps(p.default_zp);
    for (int t = 0; t < T; ++t) {
      const float sa = a.scale[(t0 + t) * nb + b];
      const __m256 sav = _mm256_set1_ps(sa), sas = _mm256_set1_ps(sa * static_cast<float>(a.sum[(t0 + t) * nb + b]));
      const __m256 v0 = _mm256_fnmadd_ps(z0, sas, _mm256_mul_ps(_mm256_cvtepi32_ps(acc[t][0]), sav));
      const __m256 v1 = _mm256_fnmadd_ps(z1, sas, _mm256_mul_ps(_mm256_cvtepi32_ps(acc[t][1]), sav));
      f[t][0] = _mm256_fmadd_ps(sw0, v0, f[t][0]);
      f[t][1] = _mm256_fmadd_ps(sw1, v1, f[t][1]);
    }
  }
  for (int t = 0; t < T; ++t) {
    float* sums = sums_all + (t0 + t) * 16;
    _mm256_storeu_ps(sums, f[t][0]);
    _mm256_storeu_ps(sums + 8, f[t][1]);
  }
}

// Weight bytes of one K-chunk of a 16-column slice: every token tile passes over it in L1.
constexpr size_t kChunkBytes = 16 * 1024;

template <int kBits>
void prefill_pairs(const QuantPacked& p, size_t panel, size_t c0, size_t c1, const QuantActivations& a,
                   float* const* ys, size_t valid, const float* bias, uint8_t* scratch) {
  constexpr int kTile = 4;
  float* sums = reinterpret_cast<float*>(scratch + pair_weight_bytes(p));
  const size_t nb = p.num_blocks, chunk_blocks = std::max<size_t>(1, kChunkBytes / (p.block / 2 * 64));
  for (size_t c = c0; c < c1 && c - c0 < valid; c += kQuantGroup) {
    repack_pairs<kBits>(p, panel, c, scratch);
    for (size_t v2 = 0; v2 < 4; ++v2) {
      const size_t base = c - c0 + 16 * v2;
      if (base >= valid) break;
      for (size_t b0 = 0; b0 < nb; b0 += chunk_blocks) {
        const size_t b1 = std::min(nb, b0 + chunk_blocks);
        for (size_t t0 = 0; t0 < a.m; t0 += kTile) {
          switch (std::min<size_t>(kTile, a.m - t0)) {
            case 1: gemm_tile<1>(p, panel, c, scratch, v2, a, t0, b0, b1, b0 == 0, sums); break;
            case 2: gemm_tile<2>(p, panel, c, scratch, v2, a, t0, b0, b1, b0 == 0, sums); break;
            case 3: gemm_tile<3>(p, panel, c, scratch, v2, a, t0, b0, b1, b0 == 0, sums); break;
            default: gemm_tile<4>(p, panel, c, scratch, v2, a, t0, b0, b1, b0 == 0, sums); break;
          }
        }
      }
      const size_t width = std::min<size_t>(16, valid - base);
      for (size_t t = 0; t < a.m; ++t)
        for (size_t i = 0; i < width; ++i) ys[t][base + i] = (bias ? bias[base + i] : 0.0f) + sums[t * 16 + i];
    }
  }
}

inline __m256 masked_load(const float* x, size_t count) {  // count < 8: the rest is 0
  alignas(32) float tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (size_t i = 0; i < count; ++i) tmp[i] = x[i];
  return _mm256_load_ps(tmp);
}

void quantize(const float* x, size_t k, size_t block, size_t num_blocks, float gate_scale, int8_t* q, int16_t* q16,
              float* scale, int32_t* sum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (size_t b = 0; b < num_blocks; ++b) {
    const size_t r0 = b * block, len = std::min(k, r0 + block) - r0;
    auto load = [&](size_t i) { return i + 8 <= len ? _mm256_loadu_ps(x + r0 + i) : masked_load(x + r0 + i, i < len ? len - i : 0); };
    __m256 amax = _mm256_setzero_ps(), nonfinite = _mm256_setzero_ps();  // x - x is NaN for NaN and +-inf
    for (size_t i = 0; i < block; i += 8) {
      const __m256 v = load(i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v));
      nonfinite = _mm256_add_ps(nonfinite, _mm256_sub_ps(v, v));
    }
    alignas(32) float lanes[8], bad[8];
    _mm256_store_ps(lanes, amax);
    _mm256_store_ps(bad, nonfinite);
    float top = 0.0f;
    bool finite = true;
    for (int i = 0; i < 8; ++i) {
      top = std::max(top, lanes[i]);
      finite &= !std::isnan(bad[i]);
    }
    if (!finite) {
      std::fill(q + r0, q + r0 + block, int8_t{0});
      if (q16) std::fill(q16 + r0, q16 + r0 + block, int16_t{0});
      scale[b] = std::numeric_limits<float>::quiet_NaN();
      sum[b] = 0;
      continue;
    }
    const __m256 inv = _mm256_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
    const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
    __m256i total = _mm256_setzero_si256();
    for (size_t i = 0; i < block; i += 16) {  // blocks are multiples of 16
      const __m256i a = _mm256_min_epi32(hi, _mm256_max_epi32(lo, _mm256_cvtps_epi32(_mm256_mul_ps(load(i), inv))));
      const __m256i c = _mm256_min_epi32(hi, _mm256_max_epi32(lo, _mm256_cvtps_epi32(_mm256_mul_ps(load(i + 8), inv))));
      total = _mm256_add_epi32(total, _mm256_add_epi32(a, c));
      const __m256i w16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, c), 0xD8);  // 16 int16 in order
      if (q16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(q16 + r0 + i), w16);
      const __m128i w8 = _mm_packs_epi16(_mm256_castsi256_si128(w16), _mm256_extracti128_si256(w16, 1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + r0 + i), w8);
    }
    alignas(32) int32_t parts[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(parts), total);
    int32_t s = 0;
    for (int i = 0; i < 8; ++i) s += parts[i];
    sum[b] = s;
    scale[b] = top / 127.0f * gate_scale;
  }
}

void prefill_any(const QuantPacked& p, size_t panel, size_t c0, size_t c1, const QuantActivations& a,
                 float* const* ys, size_t valid, const float* bias, uint8_t* scratch) {
  (p.bits == 4 ? prefill_pairs<4> : prefill_pairs<8>)(p, panel, c0, c1, a, ys, valid, bias, scratch);
}

}  // namespace

const QuantKernels& quant_kernels_avx2() {
  static const QuantKernels table{decode_any, decode_int8_any, prefill_any, pair_scratch_bytes, quantize};
  return table;
}

}  // namespace ortsparse::kernels
