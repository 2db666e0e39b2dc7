#include "attention/tiled_prefill.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#include "attention/exact_attention.h"
#include "common/finite.h"

namespace ortsparse::attention {

namespace {

constexpr size_t kKeys = kernels::kFlashKeys;
// Query rows per block (positions x the heads of a KV group): the block's Q, unnormalised output
// and one tile's scores are 3 x 64 x 64 floats at D = 64 (48 KiB), in L1/L2 while a K/V tile
// (2 x 16 KiB) streams through; more rows would read each tile fewer times but spill the scores.
constexpr size_t kBlockRows = 64;

struct Block {
  size_t b, hk, i0, positions;
};

}  // namespace

bool tiled_exact_attention(const AttentionCall& c, const kernels::KernelSet& ks, const TiledParams& p,
                           size_t keys_below, const TaskRunner& runner, uint64_t* keys_total) {
  const AttentionDims& dd = c.dims;
  if (dd.hkv == 0 || dd.h % dd.hkv != 0 || dd.d == 0) return false;
  const size_t G = dd.h / dd.hkv, d = dd.d, dv = dd.dv;
  const size_t bq = std::max<size_t>(1, kBlockRows / G);  // positions per block
  const size_t blocks_per_head = (dd.sq + bq - 1) / bq;

  // K^T of every (batch, kv head), tile by tile: tile t of head (b, hk) is [d][kKeys] floats from
  // kt_offset[b * hkv + hk] + t * d * kKeys; columns past the head's keys stay 0.
  std::vector<size_t> kt_offset(dd.b * dd.hkv + 1, 0);
  for (size_t b = 0; b < dd.b; ++b)
    for (size_t hk = 0; hk < dd.hkv; ++hk) {
      const size_t tiles = (c.keys(b) + kKeys - 1) / kKeys;
      kt_offset[b * dd.hkv + hk + 1] = kt_offset[b * dd.hkv + hk] + tiles * d * kKeys;
    }
  std::vector<float> kt(kt_offset.back(), 0.0f);
  std::atomic<bool> finite{true};
  std::atomic<uint64_t> attended{0};
  float* kt_p = kt.data();
  const size_t* off_p = kt_offset.data();
  runner.run(dd.b * dd.hkv, [&, kt_p, off_p](size_t task) {
    const size_t b = task / dd.hkv, hk = task % dd.hkv, keys = c.keys(b);
    const float* k = c.k + c.k_rows.at(b, hk, 0);
    const float* v = c.v + c.v_rows.at(b, hk, 0);
    bool ok = true;
    for (size_t j = 0; j < keys; ++j) {
      const float* row = k + j * c.k_rows.pos;
      ok = ok && all_finite(row, d) && all_finite(v + j * c.v_rows.pos, dv);
      float* dst = kt_p + off_p[task] + (j / kKeys) * d * kKeys + j % kKeys;
      for (size_t x = 0; x < d; ++x) dst[x * kKeys] = row[x];
    }
    if (!ok) finite.store(false, std::memory_order_relaxed);
  });
  if (!finite.load()) return false;

  // Blocks, the longest key ranges first (a causal prompt's last blocks have the most keys; the
  // pool hands out tasks in order, so the short ones fill the gaps at the end).
  std::vector<Block> blocks;
  blocks.reserve(dd.b * dd.hkv * blocks_per_head);
  for (size_t qb = blocks_per_head; qb-- > 0;)
    for (size_t b = 0; b < dd.b; ++b)
      for (size_t hk = 0; hk < dd.hkv; ++hk) blocks.push_back({b, hk, qb * bq, std::min(bq, dd.sq - qb * bq)});
  const Block* blocks_p = blocks.data();
  const bool masked = c.mask.keep != nullptr || c.mask.add != nullptr;

  runner.run(blocks.size(), [&, kt_p, off_p, blocks_p](size_t task) {
    if (!finite.load(std::memory_order_relaxed)) return;
    const Block& blk = blocks_p[task];
    const size_t m = blk.positions * G, keys = c.keys(blk.b);
    std::vector<float> q(m * d), o(m * dv, 0.0f), scores(m * kKeys), bias(masked ? m * kKeys : 0);
    std::vector<float> row_max(m, kNegInf), row_sum(m, 0.0f);
    std::vector<size_t> lo(m), hi(m);
    std::vector<int32_t> tile_lo(m), tile_hi(m);
    std::vector<MaskRow> mask(masked ? m : 0);
    std::vector<char> active(blk.positions);
    size_t first = keys, last = 0;  // the union of the rows' key ranges
    uint64_t row_keys = 0;
    bool ok = true;
    for (size_t t = 0; t < blk.positions; ++t) {
      const size_t i = blk.i0 + t;
      size_t a = 0, e = keys;
      if (p.causal) {
        const int64_t pos = c.position(blk.b, i);
        e = pos < 0 ? 0 : std::min(keys, static_cast<size_t>(pos) + 1);
        if (p.local_window >= 0 && pos >= 0)
          a = std::min(e, static_cast<size_t>(std::max<int64_t>(0, pos - p.local_window + 1)));
      }
      const bool ours = e - a < keys_below;  // the other rows are the caller's (they select)
      active[t] = ours;
      if (!ours) a = e = 0;
      for (size_t g = 0; g < G; ++g) {
        const size_t r = t * G + g, h = blk.hk * G + g;
        const float* src = c.q + c.q_rows.at(blk.b, h, i);
        ok = ok && all_finite(src, d);
        std::copy_n(src, d, q.data() + r * d);
        lo[r] = a;
        hi[r] = e;
        if (masked) mask[r] = mask_row(c.mask, blk.b, h, i);
      }
      if (a < e) {
        first = std::min(first, a);
        last = std::max(last, e);
        row_keys += G * (e - a);
      }
    }
    if (!ok) {
      finite.store(false, std::memory_order_relaxed);
      return;
    }
    kernels::FlashTile tile;
    tile.q = q.data();
    tile.ldv = c.v_rows.pos;
    tile.m = m;
    tile.d = d;
    tile.dv = dv;
    tile.scale = p.scale;
    tile.softcap = p.softcap;
    tile.scores = scores.data();
    tile.row_max = row_max.data();
    tile.row_sum = row_sum.data();
    tile.o = o.data();
    const float* vhead = c.v + c.v_rows.at(blk.b, blk.hk, 0);
    const float* kthead = kt_p + off_p[blk.b * dd.hkv + blk.hk];
    for (size_t t0 = first / kKeys * kKeys; t0 < last; t0 += kKeys) {
      const size_t n = std::min(kKeys, keys - t0);
      bool whole = !masked;  // every row attends every key of the tile
      for (size_t r = 0; r < m && whole; ++r) whole = lo[r] <= t0 && hi[r] >= t0 + n;
      if (!whole) {
        for (size_t r = 0; r < m; ++r) {
          const size_t a = std::clamp(lo[r], t0, t0 + n), e = std::clamp(hi[r], t0, t0 + n);
          tile_lo[r] = static_cast<int32_t>(a - t0);
          tile_hi[r] = static_cast<int32_t>(std::max(a, e) - t0);
        }
      }
      if (masked) {
        for (size_t r = 0; r < m; ++r) {
          float* dst = bias.data() + r * kKeys;
          for (size_t j = 0; j < n; ++j) dst[j] = mask[r].value(t0 + j);
          ok = ok && std::none_of(dst, dst + n, [](float x) { return std::isnan(x) || x == kPosInf; });
        }
      }
      tile.set_keys(kthead + (t0 / kKeys) * d * kKeys, vhead + t0 * c.v_rows.pos, n,
                    whole ? nullptr : tile_lo.data(), whole ? nullptr : tile_hi.data(),
                    masked ? bias.data() : nullptr);
      ks.attention->flash_tile(tile);
    }
    for (size_t r = 0; r < m; ++r) {
      const size_t t = r / G, h = blk.hk * G + r % G;
      if (!active[t]) continue;
      float* y = c.y + c.y_rows.at(blk.b, h, blk.i0 + t);
      if (row_max[r] == kNegInf) {  // no attendable key
        std::fill(y, y + dv, 0.0f);
        continue;
      }
      const float sink = c.head_sink ? c.head_sink[h] : p.smooth_softmax ? 0.0f : kNegInf;
      const double base = std::max(static_cast<double>(row_max[r]), static_cast<double>(sink));
      const double f = std::exp(static_cast<double>(row_max[r]) - base);
      const double total = row_sum[r] * f + (sink == kNegInf ? 0.0 : std::exp(static_cast<double>(sink) - base));
      const float w = static_cast<float>(f / total);
      const float* orow = o.data() + r * dv;
      for (size_t x = 0; x < dv; ++x) y[x] = orow[x] * w;
      ok = ok && all_finite(y, dv);
    }
    attended.fetch_add(row_keys, std::memory_order_relaxed);
    if (!ok) finite.store(false, std::memory_order_relaxed);
  });
  if (!finite.load()) return false;
  *keys_total = attended.load();
  return true;
}

}  // namespace ortsparse::attention
