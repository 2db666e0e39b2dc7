// The row walk both SIMD decode kernels of the quant backend share: per K-block of the panel, its
// kept rows (every row when `rows` is null) in passes of up to kPass rows; each pass gets the rows'
// bytes, the rows kPrefetch further down the list to prefetch, their x values, the block's scales
// and zero points, the block's sum of x and how it treats the block accumulator. Only the pass (the
// arithmetic) is ISA-specific. Included once per ISA file.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kernels/quant_kernels.h"

namespace ortsparse::kernels::generic {
// Internal linkage: each ISA file keeps its own copy (compiled with its own flags).
namespace {

// How a pass treats the block accumulator `acc` and the output:
// acc = rows | acc += rows | out += s*(acc+rows-zp*xs) | out += s*(rows-zp*xs)
enum Mode { kFirst, kMiddle, kLast, kOnly };

// How far ahead the decode kernels prefetch kept rows: ~kPrefetchBytes of row data (more than the
// bytes in flight during one DRAM latency), at least the next pass's rows and at most 32 rows.
constexpr size_t kPrefetchBytes = 6144;
inline size_t prefetch_rows(size_t row_bytes, size_t pass_rows) {
  return std::min<size_t>(32, std::max<size_t>(pass_rows, (kPrefetchBytes + row_bytes - 1) / row_bytes));
}

// Block b's scales and zero points of a panel (width columns) into L1.
inline void prefetch_block_scales(const float* scales, const uint8_t* zp, size_t width, size_t b) {
  const char* s = reinterpret_cast<const char*>(scales + b * width);
  for (size_t at = 0; at < width * sizeof(float); at += 64) _mm_prefetch(s + at, _MM_HINT_T0);
  if (zp)
    for (size_t at = 0; at < width; at += 64) _mm_prefetch(reinterpret_cast<const char*>(zp + b * width + at), _MM_HINT_T0);
}

// run(std::integral_constant<int, R>{}) with R = count, for 1 <= count <= kMax (a pass's row count
// as a compile-time constant, so each ISA's pass is unrolled per row count).
template <int kMax, class Run>
void with_pass_rows(int count, Run&& run) {
  if constexpr (kMax == 1) {
    run(std::integral_constant<int, 1>{});
  } else if (count >= kMax) {
    run(std::integral_constant<int, kMax>{});
  } else {
    with_pass_rows<kMax - 1>(count, run);
  }
}

// The walk both decode kernels share: per K-block of the panel, the block's kept rows [begin, end)
// of the list (every row when `rows` is null): on_block(b, begin, end) once, then
// on_pass(b, count, mode, r, qr, pf) per pass of count <= kPass rows, with r the rows' indices, qr
// their bytes and pf the rows `distance` further down the list (dense: row order) to prefetch.
// Prefetching runs past this call's rows into the next task's (list entries after nrows, or the
// rows after the last block), so a task that follows on the same thread starts warm.
template <size_t kPass, class OnBlock, class OnPass>
void walk_kept_rows(const QuantPacked& p, size_t panel, size_t b0, size_t b1, const int32_t* rows, size_t nrows,
                    size_t lookahead, OnBlock&& on_block, OnPass&& on_pass) {
  const size_t width = p.panel;
  const uint8_t* q = p.panel_q(panel);
  const float* scales = p.panel_scales(panel);
  const uint8_t* zp = p.panel_zero_points(panel);
  const size_t list_end = nrows + lookahead, distance = prefetch_rows(p.row_bytes, kPass);
  size_t next = 0;
  if (b0 < b1) prefetch_block_scales(scales, zp, width, b0);
  for (size_t b = b0; b < b1; ++b) {
    size_t begin = 0, end = 0;
    if (!block_kept_range(p, b, rows, nrows, next, begin, end)) continue;
    // The next block's scales and zero points are a stream of their own, read once per block at its
    // last pass, that the hardware prefetchers miss: fetch them while this block's rows stream in.
    if (b + 1 < p.num_blocks) prefetch_block_scales(scales, zp, width, b + 1);
    on_block(b, begin, end);
    for (size_t i = begin; i < end; i += kPass) {
      const size_t count = std::min(kPass, end - i);
      const bool first = i == begin, last = i + kPass >= end;
      const Mode mode = first ? (last ? kOnly : kFirst) : (last ? kLast : kMiddle);
      size_t r[kPass];
      const uint8_t* qr[kPass];
      const uint8_t* pf[kPass];
      for (size_t e = 0; e < count; ++e) {
        r[e] = rows ? static_cast<size_t>(rows[i + e]) : i + e;
        qr[e] = q + r[e] * p.row_bytes;
        const size_t ahead = i + e + distance;
        const size_t ra = rows ? (ahead < list_end ? static_cast<size_t>(rows[ahead]) : r[e]) : (ahead < p.k ? ahead : r[e]);
        pf[e] = q + ra * p.row_bytes;
      }
      on_pass(b, count, mode, r, qr, pf);
    }
  }
}

// The fp32-activation decode: run_pass(count, mode, rows, ahead, xv, scales, zero_points, xs), one
// pass of count <= kPass rows with their x values and the block's sum of x.
template <size_t kPass, class RunPass>
void for_each_decode_pass(const QuantPacked& p, size_t panel, size_t b0, size_t b1, const float* x,
                          const int32_t* rows, size_t nrows, size_t lookahead, RunPass&& run_pass) {
  const size_t width = p.panel;
  const float* scales = p.panel_scales(panel);
  const uint8_t* zp = p.panel_zero_points(panel);
  float xs = 0.0f;
  walk_kept_rows<kPass>(
      p, panel, b0, b1, rows, nrows, lookahead,
      [&](size_t, size_t begin, size_t end) {
        xs = 0.0f;
        for (size_t i = begin; i < end; ++i) xs += x[rows ? rows[i] : i];
      },
      [&](size_t b, size_t count, Mode mode, const size_t* r, const uint8_t** qr, const uint8_t** pf) {
        float xv[kPass] = {};  // [count, kPass) unread; initialised so the compiler can tell
        for (size_t e = 0; e < count; ++e) xv[e] = x[r[e]];
        run_pass(static_cast<int>(count), mode, qr, pf, xv, scales + b * width, zp ? zp + b * width : nullptr, xs);
      });
}

// The int8 decode (decode_int8): passes of up to kPass rows (a multiple of 4) handed over as quads,
// the unit of one int8 dot product lane: each quad's activations packed into one int32 (row 4i + e
// of the pass in byte e), a pass's last quad padded with activation 0 and the pass's last row
// (already in L1, so the padding costs no bytes). run_pass(quads, mode, rows, ahead, packed, block)
// with rows / ahead 4 * quads entries.
template <size_t kPass, class RunPass>
void for_each_int8_pass(const QuantPacked& p, size_t panel, size_t b0, size_t b1, const int8_t* xq,
                        const int32_t* rows, size_t nrows, size_t lookahead, RunPass&& run_pass) {
  static_assert(kPass % 4 == 0, "passes are whole quads");
  walk_kept_rows<kPass>(
      p, panel, b0, b1, rows, nrows, lookahead, [](size_t, size_t, size_t) {},
      [&](size_t b, size_t count, Mode mode, const size_t* r, const uint8_t** qr, const uint8_t** pf) {
        const size_t quads = (count + 3) / 4;
        int32_t packed[kPass / 4] = {};
        for (size_t e = 0; e < count; ++e)
          packed[e / 4] |= static_cast<int32_t>(static_cast<uint32_t>(static_cast<uint8_t>(xq[r[e]])) << (8 * (e % 4)));
        for (size_t e = count; e < quads * 4; ++e) {
          qr[e] = qr[count - 1];
          pf[e] = pf[count - 1];
        }
        run_pass(static_cast<int>(quads), mode, qr, pf, packed, b);
      });
}

}  // namespace
}  // namespace ortsparse::kernels::generic
