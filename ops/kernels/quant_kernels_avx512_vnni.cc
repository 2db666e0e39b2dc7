// AVX-512 VNNI kernels of the quant backend: vpdpbusd (unsigned weight bytes x signed int8
// activations, 4 K values per lane). The int8 decode interleaves each quad of kept rows on the fly;
// the prefill repacks a column group per call into dot-product order. Their own file so that
// -mavx512vnni applies to nothing else; called only when the CPU has VNNI.
#include <immintrin.h>

#include <algorithm>

#include "kernels/quant_decode_generic.h"
#include "kernels/quant_kernels.h"

namespace ortsparse::kernels {
namespace {

// ---------------------------------------------------------------------------------------------
// Int8 decode
// ---------------------------------------------------------------------------------------------

// Rows per pass (4 quads): each pass loads and stores the block's int32 accumulators once.
constexpr size_t kInt8PassRows = 16;
using generic::Mode, generic::kFirst, generic::kMiddle, generic::kLast, generic::kOnly;

// One row's 64 columns of group g as unsigned bytes in column order (4 bits: the low nibbles are
// columns 0-31, the high nibbles 32-63, so a shift, an insert and a mask give them in order).
template <int kBits>
inline __m512i group_bytes(const uint8_t* row, size_t g) {
  if constexpr (kBits == 8) {
    return _mm512_loadu_si512(row + g * kQuantGroup);
  } else {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + g * (kQuantGroup / 2)));
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(b), _mm256_srli_epi16(b, 4), 1);
    return _mm512_and_si512(both, _mm512_set1_epi8(0x0F));
  }
}

// Four rows' 64 columns into dot-product order: dword d of 128-bit lane L of v[j] holds the four
// rows' bytes of column 16 L + 4 j + d (row e in byte e), the order the unpacks produce.
inline void interleave_quad(const __m512i r[4], __m512i v[4]) {
  const __m512i ab_lo = _mm512_unpacklo_epi8(r[0], r[1]), ab_hi = _mm512_unpackhi_epi8(r[0], r[1]);
  const __m512i cd_lo = _mm512_unpacklo_epi8(r[2], r[3]), cd_hi = _mm512_unpackhi_epi8(r[2], r[3]);
  v[0] = _mm512_unpacklo_epi16(ab_lo, cd_lo);
  v[1] = _mm512_unpackhi_epi16(ab_lo, cd_lo);
  v[2] = _mm512_unpacklo_epi16(ab_hi, cd_hi);
  v[3] = _mm512_unpackhi_epi16(ab_hi, cd_hi);
}

// The inverse of that order on the sums (a 4 x 4 transpose of 128-bit lanes): n[L] = columns
// 16 L .. 16 L + 15.
inline void to_column_order(const __m512i v[4], __m512i n[4]) {
  const __m512i t0 = _mm512_shuffle_i32x4(v[0], v[1], _MM_SHUFFLE(1, 0, 1, 0));
  const __m512i t1 = _mm512_shuffle_i32x4(v[0], v[1], _MM_SHUFFLE(3, 2, 3, 2));
  const __m512i t2 = _mm512_shuffle_i32x4(v[2], v[3], _MM_SHUFFLE(1, 0, 1, 0));
  const __m512i t3 = _mm512_shuffle_i32x4(v[2], v[3], _MM_SHUFFLE(3, 2, 3, 2));
  n[0] = _mm512_shuffle_i32x4(t0, t2, _MM_SHUFFLE(2, 0, 2, 0));
  n[1] = _mm512_shuffle_i32x4(t0, t2, _MM_SHUFFLE(3, 1, 3, 1));
  n[2] = _mm512_shuffle_i32x4(t1, t3, _MM_SHUFFLE(2, 0, 2, 0));
  n[3] = _mm512_shuffle_i32x4(t1, t3, _MM_SHUFFLE(3, 1, 3, 1));
}

template <int kBits, int Q, Mode kMode>
void int8_pass(const uint8_t* const* rows, const uint8_t* const* ahead, const int32_t* packed, size_t groups,
               int32_t* acc, float* out, const float* scales, const uint8_t* zp, float default_zp, float ascale,
               float ascale_sum) {
  __m512i aq[Q];
  for (int i = 0; i < Q; ++i) aq[i] = _mm512_set1_epi32(packed[i]);
  constexpr size_t kGroupBytes = kQuantGroup * kBits / 8;
  for (size_t g = 0; g < groups; ++g) {
    // The rows generic::prefetch_rows() further down the token's list (see quant_kernels_avx512.cc).
    for (int i = 0; i < 4 * Q; ++i) _mm_prefetch(reinterpret_cast<const char*>(ahead[i] + g * kGroupBytes), _MM_HINT_T0);
    int32_t* ag = acc + g * kQuantGroup;
    __m512i s[4];
    for (int v = 0; v < 4; ++v)
      s[v] = (kMode == kMiddle || kMode == kLast) ? _mm512_loadu_si512(ag + 16 * v) : _mm512_setzero_si512();
    for (int i = 0; i < Q; ++i) {
      __m512i r[4], w[4];
      for (int e = 0; e < 4; ++e) r[e] = group_bytes<kBits>(rows[4 * i + e], g);
      interleave_quad(r, w);
      for (int v = 0; v < 4; ++v) s[v] = _mm512_dpbusd_epi32(s[v], w[v], aq[i]);
    }
    if (kMode == kFirst || kMode == kMiddle) {
      for (int v = 0; v < 4; ++v) _mm512_storeu_si512(ag + 16 * v, s[v]);
    } else {
      __m512i n[4];
      to_column_order(s, n);
      const __m512 sa = _mm512_set1_ps(ascale), sas = _mm512_set1_ps(ascale_sum);
      float* og = out + g * kQuantGroup;
      const float* sg = scales + g * kQuantGroup;
      for (int v = 0; v < 4; ++v) {
        const __m512 z = zp ? _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                  _mm_loadu_si128(reinterpret_cast<const __m128i*>(zp + g * kQuantGroup + 16 * v))))
                            : _mm512_set1_ps(default_zp);
        const __m512 t = _mm512_fnmadd_ps(z, sas, _mm512_mul_ps(_mm512_cvtepi32_ps(n[v]), sa));
        _mm512_storeu_ps(og + 16 * v, _mm512_fmadd_ps(_mm512_loadu_ps(sg + 16 * v), t, _mm512_loadu_ps(og + 16 * v)));
      }
    }
  }
}

template <int kBits, int Q>
void int8_pass_mode(Mode mode, const uint8_t* const* rows, const uint8_t* const* ahead, const int32_t* packed,
                    size_t groups, int32_t* acc, float* out, const float* scales, const uint8_t* zp, float default_zp,
                    float ascale, float ascale_sum) {
  switch (mode) {
    case kFirst: return int8_pass<kBits, Q, kFirst>(rows, ahead, packed, groups, acc, out, scales, zp, default_zp, ascale, ascale_sum);
    case kMiddle: return int8_pass<kBits, Q, kMiddle>(rows, ahead, packed, groups, acc, out, scales, zp, default_zp, ascale, ascale_sum);
    case kLast: return int8_pass<kBits, Q, kLast>(rows, ahead, packed, groups, acc, out, scales, zp, default_zp, ascale, ascale_sum);
    case kOnly: return int8_pass<kBits, Q, kOnly>(rows, ahead, packed, groups, acc, out, scales, zp, default_zp, ascale, ascale_sum);
  }
}

template <int kBits>
void decode_int8(const QuantPacked& p, size_t panel, size_t b0, size_t b1, const QuantDecodeActivations& a,
                 const int32_t* rows, size_t nrows, size_t lookahead, float* out, int32_t* acc) {
  const size_t width = p.panel, groups = width / kQuantGroup, nb = p.num_blocks;
  const float default_zp = p.default_zp;
  for (size_t j = 0; j < width; j += 16) _mm512_storeu_ps(out + j, _mm512_setzero_ps());
  generic::for_each_int8_pass<kInt8PassRows>(
      p, panel, b0, b1, a.q, rows, nrows, lookahead,
      [&](int quads, Mode mode, const uint8_t* const* qr, const uint8_t* const* pf, const int32_t* packed, size_t b) {
        const float* sb = p.panel_scales(panel) + b * width;
        const uint8_t* zb = p.zero_points ? p.panel_zero_points(panel) + b * width : nullptr;
        const float sa = a.scale[b], sas = sa * static_cast<float>(a.sum[b]);
        (void)nb;
        generic::with_pass_rows<static_cast<int>(kInt8PassRows / 4)>(quads, [&](auto q) {
          int8_pass_mode<kBits, decltype(q)::value>(mode, qr, pf, packed, groups, acc, out, sb, zb, default_zp, sa, sas);
        });
      });
}

// After repacking, vector v (0..3) of a K-quad holds in dword i the 4 K values of column
// 16 * (i / 4) + 4 * v + i % 4 of the group (the order the byte/word unpacks produce).
inline size_t vnni_column(size_t v, size_t i) { return 16 * (i / 4) + 4 * v + i % 4; }

struct VnniScratch {
  uint8_t* w;    // [2 groups][quads][4 vectors][64 bytes]
  float* scale;  // [2 groups][num_blocks][64] in vector order
  float* zp;     // [2 groups][num_blocks][64] in vector order
  float* sums;   // [m][32]: per token, the partial sums of the 32 columns being computed
};

size_t vnni_scratch_bytes(const QuantPacked& p, size_t m) {
  const size_t ldq = p.num_blocks * p.block;
  return 2 * ldq * kQuantGroup + 2 * 2 * p.num_blocks * kQuantGroup * sizeof(float) + m * 32 * sizeof(float) + 64;
}

VnniScratch vnni_layout(const QuantPacked& p, uint8_t* scratch) {
  const size_t ldq = p.num_blocks * p.block;
  VnniScratch s;
  s.w = scratch;
  s.scale = reinterpret_cast<float*>(scratch + 2 * ldq * kQuantGroup);
  s.zp = s.scale + 2 * p.num_blocks * kQuantGroup;
  s.sums = s.zp + 2 * p.num_blocks * kQuantGroup;
  return s;
}

// Column groups [c, c + G * 64) of a panel into dot-product order (rows >= K become 0).
template <int kBits, int G>
void repack_vnni(const QuantPacked& p, size_t panel, size_t c, const VnniScratch& s) {
  const size_t ldq = p.num_blocks * p.block, quads = ldq / 4, rb = p.row_bytes;
  const uint8_t* q = p.panel_q(panel) + (kBits == 8 ? c : c / 2);
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (size_t kq = 0; kq < quads; ++kq) {
    __m512i r[G][4];
    for (int e = 0; e < 4; ++e) {
      const size_t row = kq * 4 + e;
      for (int gi = 0; gi < G; ++gi) {
        if (row >= p.k) {
          r[gi][e] = _mm512_setzero_si512();
        } else if (kBits == 8) {
          r[gi][e] = _mm512_loadu_si512(q + row * rb + gi * kQuantGroup);
        } else {
          const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + row * rb + gi * 32));
          const __m256i lo = _mm256_and_si256(b, low4), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
          r[gi][e] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        }
      }
    }
    for (int gi = 0; gi < G; ++gi) {
      const __m512i ab_lo = _mm512_unpacklo_epi8(r[gi][0], r[gi][1]), ab_hi = _mm512_unpackhi_epi8(r[gi][0], r[gi][1]);
      const __m512i cd_lo = _mm512_unpacklo_epi8(r[gi][2], r[gi][3]), cd_hi = _mm512_unpackhi_epi8(r[gi][2], r[gi][3]);
      uint8_t* dst = s.w + (gi * quads + kq) * 256;
      _mm512_storeu_si512(dst, _mm512_unpacklo_epi16(ab_lo, cd_lo));
      _mm512_storeu_si512(dst + 64, _mm512_unpackhi_epi16(ab_lo, cd_lo));
      _mm512_storeu_si512(dst + 128, _mm512_unpacklo_epi16(ab_hi, cd_hi));
      _mm512_storeu_si512(dst + 192, _mm512_unpackhi_epi16(ab_hi, cd_hi));
    }
  }
  const float* scales = p.panel_scales(panel);
  const uint8_t* zp = p.panel_zero_points(panel);
  for (int gi = 0; gi < G; ++gi)
    for (size_t b = 0; b < p.num_blocks; ++b) {
      float* ds = s.scale + (gi * p.num_blocks + b) * kQuantGroup;
      float* dz = s.zp + (gi * p.num_blocks + b) * kQuantGroup;
      for (size_t v = 0; v < 4; ++v)
        for (size_t i = 0; i < 16; ++i) {
          const size_t col = b * p.panel + c + gi * kQuantGroup + vnni_column(v, i);
          ds[v * 16 + i] = scales[col];
          dz[v * 16 + i] = zp ? zp[col] : p.default_zp;
        }
    }
}

// T tokens x 32 columns (vectors 2h, 2h + 1 of group gi) over blocks [b0, b1), adding to the
// tokens' partial sums in s.sums (which start at 0 when `first`).
template <int T>
void gemm_tile(const QuantPacked& p, const VnniScratch& s, int gi, int h, const QuantActivations& a, size_t t0,
               size_t b0, size_t b1, bool first) {
  const size_t nb = p.num_blocks, ldq = a.ldq, quads = ldq / 4, bq = p.block / 4;
  const uint8_t* w = s.w + gi * quads * 256 + h * 128;
  const int8_t* aq[T];
  for (int t = 0; t < T; ++t) aq[t] = a.q + (t0 + t) * ldq;
  __m512 f[T][2];
  for (int t = 0; t < T; ++t) {
    float* sums = s.sums + (t0 + t) * 32;
    f[t][0] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(sums);
    f[t][1] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(sums + 16);
  }
  for (size_t b = b0; b < b1; ++b) {
    __m512i acc[T][2];
    for (int t = 0; t < T; ++t) acc[t][0] = acc[t][1] = _mm512_setzero_si512();
    for (size_t kq = b * bq; kq < (b + 1) * bq; ++kq) {
      const __m512i w0 = _mm512_loadu_si512(w + kq * 256), w1 = _mm512_loadu_si512(w + kq * 256 + 64);
      for (int t = 0; t < T; ++t) {
        int32_t quad;
        __builtin_memcpy(&quad, aq[t] + kq * 4, 4);
        const __m512i av = _mm512_set1_epi32(quad);
        acc[t][0] = _mm512_dpbusd_epi32(acc[t][0], w0, av);
        acc[t][1] = _mm512_dpbusd_epi32(acc[t][1], w1, av);
      }
    }
    const float* sb = s.scale + (gi * nb + b) * kQuantGroup + h * 32;
    const float* zb = s.zp + (gi * nb + b) * kQuantGroup + h * 32;
    const __m512 sw0 = _mm512_loadu_ps(sb), sw1 = _mm512_loadu_ps(sb + 16);
    const __m512 z0 = _mm512_loadu_ps(zb), z1 = _mm512_loadu_ps(zb + 16);
    for (int t = 0; t < T; ++t) {
      const float sa = a.scale[(t0 + t) * nb + b];
      const __m512 sav = _mm512_set1_ps(sa), sas = _mm512_set1_ps(sa * static_cast<float>(a.sum[(t0 + t) * nb + b]));
      const __m512 v0 = _mm512_fnmadd_ps(z0, sas, _mm512_mul_ps(_mm512_cvtepi32_ps(acc[t][0]), sav));
      const __m512 v1 = _mm512_fnmadd_ps(z1, sas, _mm512_mul_ps(_mm512_cvtepi32_ps(acc[t][1]), sav));
      f[t][0] = _mm512_fmadd_ps(sw0, v0, f[t][0]);
      f[t][1] = _mm512_fmadd_ps(sw1, v1, f[t][1]);
    }
  }
  for (int t = 0; t < T; ++t) {
    float* sums = s.sums + (t0 + t) * 32;
    _mm512_storeu_ps(sums, f[t][0]);
    _mm512_storeu_ps(sums + 16, f[t][1]);
  }
}

// Weight bytes of one K-chunk of a 32-column half group: every token tile passes over the chunk
// while it sits in L1 (a whole K x 32 slice of a large K would be re-read from L2 per tile).
constexpr size_t kChunkBytes = 16 * 1024;

template <int kBits>
void prefill_vnni(const QuantPacked& p, size_t panel, size_t c0, size_t c1, const QuantActivations& a,
                  float* const* ys, size_t valid, const float* bias, uint8_t* scratch) {
  const VnniScratch s = vnni_layout(p, scratch);
  constexpr int kTile = 4;
  const size_t nb = p.num_blocks, chunk_blocks = std::max<size_t>(1, kChunkBytes / (p.block / 4 * 128));
  for (size_t c = c0; c < c1 && c - c0 < valid;) {
    const int groups = (kBits == 4 && c + 2 * kQuantGroup <= c1) ? 2 : 1;
    if (groups == 2) {
      repack_vnni<kBits, 2>(p, panel, c, s);
    } else {
      repack_vnni<kBits, 1>(p, panel, c, s);
    }
    for (int gi = 0; gi < groups; ++gi) {
      const size_t base = c - c0 + gi * kQuantGroup;  // output column of the group's first column
      if (base >= valid) break;
      for (int h = 0; h < 2; ++h) {
        for (size_t b0 = 0; b0 < nb; b0 += chunk_blocks) {
          const size_t b1 = std::min(nb, b0 + chunk_blocks);
          for (size_t t0 = 0; t0 < a.m; t0 += kTile) {
            switch (std::min<size_t>(kTile, a.m - t0)) {
              case 1: gemm_tile<1>(p, s, gi, h, a, t0, b0, b1, b0 == 0); break;
              case 2: gemm_tile<2>(p, s, gi, h, a, t0, b0, b1, b0 == 0); break;
              case 3: gemm_tile<3>(p, s, gi, h, a, t0, b0, b1, b0 == 0); break;
              default: gemm_tile<4>(p, s, gi, h, a, t0, b0, b1, b0 == 0); break;
            }
          }
        }
        for (size_t t = 0; t < a.m; ++t) {
          const float* sums = s.sums + t * 32;
          for (size_t vv = 0; vv < 2; ++vv)
            for (size_t i = 0; i < 16; ++i) {
              const size_t col = base + vnni_column(2 * h + vv, i);
              if (col < valid) ys[t][col] = (bias ? bias[col] : 0.0f) + sums[vv * 16 + i];
            }
        }
      }
    }
    c += groups * kQuantGroup;
  }
}

}  // namespace

void quant_decode_int8_avx512_vnni(const QuantPacked& p, size_t panel, size_t b0, size_t b1,
                                   const QuantDecodeActivations& a, const int32_t* rows, size_t nrows, size_t lookahead,
                                   float* out, int32_t* acc) {
  (p.bits == 4 ? decode_int8<4> : decode_int8<8>)(p, panel, b0, b1, a, rows, nrows, lookahead, out, acc);
}

void quant_prefill_avx512_vnni(const QuantPacked& p, size_t panel, size_t c0, size_t c1, const QuantActivations& a,
                               float* const* ys, size_t valid, const float* bias, uint8_t* scratch) {
  (p.bits == 4 ? prefill_vnni<4> : prefill_vnni<8>)(p, panel, c0, c1, a, ys, valid, bias, scratch);
}

size_t quant_prefill_avx512_vnni_scratch_bytes(const QuantPacked& p, size_t m) { return vnni_scratch_bytes(p, m); }

}  // namespace ortsparse::kernels
