#include "attention/tiled_prefill.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "attention/exact_attention.h"
#include "attention/key_bounds.h"
#include "common/error.h"
#include "common/finite.h"
#include "common/named_values.h"

namespace ortsparse::attention {

namespace {
constexpr Named<PrefillSelect> kPrefillSelectNames[] = {
    {"exact", PrefillSelect::kExact}, {"certified", PrefillSelect::kCertified}, {"budget", PrefillSelect::kBudget}};
}  // namespace

PrefillSelect parse_prefill_select(const std::string& name) {
  return parse_named("prefill_select", name, kPrefillSelectNames);
}
const char* prefill_select_name(PrefillSelect select) { return name_of(select, kPrefillSelectNames); }

namespace {

constexpr size_t kKeys = kernels::kFlashKeys;
// Query rows per block (positions x the heads of a KV group): the block's Q, unnormalised output
// and one tile's scores are 3 x 64 x 64 floats at D = 64 (48 KiB), in L1/L2 while a K/V tile
// (2 x 16 KiB) streams through; more rows would read each tile fewer times but spill the scores.
constexpr size_t kBlockRows = 64;
// Selective prefill: a block with fewer selectable tiles is computed exactly (the bound pass and
// the reordering would buy at most one tile).
constexpr size_t kMinSelectableTiles = 2;

struct Block {
  size_t b, hk, i0, positions;
};

}  // namespace

bool tiled_attention(const AttentionCall& c, const kernels::KernelSet& ks, const TiledParams& p,
                     const TaskRunner& runner, std::vector<char>& done, TiledStats* stats) {
  const AttentionDims& dd = c.dims;
  if (dd.hkv == 0 || dd.h % dd.hkv != 0 || dd.d == 0) return false;
  const size_t G = dd.h / dd.hkv, d = dd.d, dv = dd.dv;
  const size_t bq = std::max<size_t>(1, kBlockRows / G);  // positions per block
  const size_t blocks_per_head = (dd.sq + bq - 1) / bq;
  const bool selective = p.select != PrefillSelect::kExact;

  // K^T of every (batch, kv head), tile by tile: tile t of head (b, hk) is [d][kKeys] floats from
  // kt_offset[b * hkv + hk] + t * d * kKeys; columns past the head's keys stay 0. Selective
  // prefill also keeps each tile's box, [max K (D), min K (D)], transposed per head (row c of head
  // (b, hk): its tiles' entry c, from box + 2 * d * tile_base[b * hkv + hk]; a bound pass is then
  // one gemv of the split query), and its max |k| (tile_base: the head's first tile).
  // Per head, the key rows whose K or V row is not finite (ascending; the rows attending one are
  // left to the row path) and, when a V row is, V with its non-finite entries as 0 (what the kernel
  // reads for the other rows); K^T and the boxes take such K rows with 0 there.
  std::vector<size_t> kt_offset(dd.b * dd.hkv + 1, 0), tile_base(dd.b * dd.hkv + 1, 0);
  for (size_t b = 0; b < dd.b; ++b)
    for (size_t hk = 0; hk < dd.hkv; ++hk) {
      const size_t tiles = (c.keys(b) + kKeys - 1) / kKeys;
      kt_offset[b * dd.hkv + hk + 1] = kt_offset[b * dd.hkv + hk] + tiles * d * kKeys;
      tile_base[b * dd.hkv + hk + 1] = tile_base[b * dd.hkv + hk] + tiles;
    }
  std::vector<float> kt(kt_offset.back(), 0.0f);
  std::vector<float> box(selective ? tile_base.back() * 2 * d : 0), box_absmax(selective ? tile_base.back() : 0);
  std::vector<std::vector<size_t>> bad_rows(dd.b * dd.hkv);
  std::vector<std::vector<float>> zeroed_values(dd.b * dd.hkv);
  std::atomic<bool> values_nonfinite{false};
  std::atomic<uint64_t> attended{0}, skipped_keys{0}, tiles_seen{0}, tiles_skipped{0}, rows_done{0};
  float* kt_p = kt.data();
  float* box_p = selective ? box.data() : nullptr;
  float* absmax_p = box_absmax.data();
  const size_t* off_p = kt_offset.data();
  const size_t* base_p = tile_base.data();
  runner.run(dd.b * dd.hkv, [&, kt_p, off_p, box_p, absmax_p, base_p](size_t task) {
    const size_t b = task / dd.hkv, hk = task % dd.hkv, keys = c.keys(b);
    const float* k = c.k + c.k_rows.at(b, hk, 0);
    const float* v = c.v + c.v_rows.at(b, hk, 0);
    const size_t tiles = base_p[task + 1] - base_p[task];
    std::vector<float> hi(box_p ? d : 0), lo(box_p ? d : 0), zeroed(d);
    bool v_bad = false;
    for (size_t j = 0; j < keys; ++j) {
      const float* row = k + j * c.k_rows.pos;
      const bool k_ok = all_finite(row, d), v_ok = all_finite(v + j * c.v_rows.pos, dv);
      if (!k_ok || !v_ok) bad_rows[task].push_back(j);
      v_bad = v_bad || !v_ok;
      if (!k_ok) {
        for (size_t x = 0; x < d; ++x) zeroed[x] = std::isfinite(row[x]) ? row[x] : 0.0f;
        row = zeroed.data();
      }
      float* dst = kt_p + off_p[task] + (j / kKeys) * d * kKeys + j % kKeys;
      for (size_t x = 0; x < d; ++x) dst[x * kKeys] = row[x];
      if (box_p == nullptr) continue;
      if (j % kKeys == 0) {
        std::copy_n(row, d, hi.data());
        std::copy_n(row, d, lo.data());
      }
      for (size_t x = 0; x < d; ++x) {
        hi[x] = std::max(hi[x], row[x]);
        lo[x] = std::min(lo[x], row[x]);
      }
      if (j % kKeys == kKeys - 1 || j + 1 == keys) {  // the tile's box is complete
        const size_t t = j / kKeys;
        float* col = box_p + base_p[task] * 2 * d + t;
        float absmax = 0.0f;
        for (size_t x = 0; x < d; ++x) {
          col[x * tiles] = hi[x];
          col[(d + x) * tiles] = lo[x];
          absmax = std::max(absmax, std::max(std::fabs(hi[x]), std::fabs(lo[x])));
        }
        absmax_p[base_p[task] + t] = absmax;
      }
    }
    if (!v_bad) return;
    values_nonfinite.store(true, std::memory_order_relaxed);
    std::vector<float>& clean = zeroed_values[task];
    clean.resize(keys * dv);
    for (size_t j = 0; j < keys; ++j) {
      const float* row = v + j * c.v_rows.pos;
      for (size_t x = 0; x < dv; ++x) clean[j * dv + x] = std::isfinite(row[x]) ? row[x] : 0.0f;
    }
  });

  // Blocks, the longest key ranges first (a causal prompt's last blocks have the most keys; the
  // pool hands out tasks in order, so the short ones fill the gaps at the end).
  std::vector<Block> blocks;
  blocks.reserve(dd.b * dd.hkv * blocks_per_head);
  for (size_t qb = blocks_per_head; qb-- > 0;)
    for (size_t b = 0; b < dd.b; ++b)
      for (size_t hk = 0; hk < dd.hkv; ++hk) blocks.push_back({b, hk, qb * bq, std::min(bq, dd.sq - qb * bq)});
  const Block* blocks_p = blocks.data();
  const bool masked = c.mask.keep != nullptr || c.mask.add != nullptr;
  const ScoreParams score{p.scale, p.softcap};
  const double log_eps = p.eps > 0.0f ? std::log(static_cast<double>(p.eps)) : -std::numeric_limits<double>::infinity();
  char* done_p = done.data();

  runner.run(blocks.size(), [&, kt_p, off_p, box_p, absmax_p, base_p, blocks_p, done_p](size_t task) {
    const Block& blk = blocks_p[task];
    const size_t m = blk.positions * G, keys = c.keys(blk.b), head = blk.b * dd.hkv + blk.hk;
    std::vector<float> q(m * d, 0.0f), o(m * dv, 0.0f), scores(m * kKeys), bias(masked ? m * kKeys : 0);
    std::vector<float> row_max(m, kNegInf), row_sum(m, 0.0f);
    std::vector<size_t> lo(m, 0), hi(m, 0);
    std::vector<int32_t> tile_lo(m), tile_hi(m);
    std::vector<MaskRow> mask(masked ? m : 0);
    // Rows this block computes: their inputs are finite so far (the mask is checked tile by tile).
    std::vector<char> computed(m, 0);
    const std::vector<size_t>& bad = bad_rows[head];
    size_t first = keys, last = 0;  // the union of the computed rows' key ranges
    for (size_t t = 0; t < blk.positions; ++t) {
      const size_t i = blk.i0 + t;
      size_t a = 0, e = keys;
      if (p.causal) {
        const int64_t pos = c.position(blk.b, i);
        e = pos < 0 ? 0 : std::min(keys, static_cast<size_t>(pos) + 1);
        if (p.local_window >= 0 && pos >= 0)
          a = std::min(e, static_cast<size_t>(std::max<int64_t>(0, pos - p.local_window + 1)));
      }
      const auto bad_from_a = std::lower_bound(bad.begin(), bad.end(), a);
      const bool reads_bad = bad_from_a != bad.end() && *bad_from_a < e;
      for (size_t g = 0; g < G; ++g) {
        const size_t r = t * G + g, h = blk.hk * G + g;
        const float* src = c.q + c.q_rows.at(blk.b, h, i);
        if (masked) mask[r] = mask_row(c.mask, blk.b, h, i);
        if (reads_bad || !all_finite(src, d)) continue;  // the row path's (its q stays 0, its range empty)
        computed[r] = 1;
        std::copy_n(src, d, q.data() + r * d);
        lo[r] = a;
        hi[r] = e;
        if (a < e) {
          first = std::min(first, a);
          last = std::max(last, e);
        }
      }
    }
    kernels::FlashTile tile;
    tile.q = q.data();
    tile.m = m;
    tile.d = d;
    tile.dv = dv;
    tile.scale = p.scale;
    tile.softcap = p.softcap;
    tile.scores = scores.data();
    tile.row_max = row_max.data();
    tile.row_sum = row_sum.data();
    tile.o = o.data();
    const bool values_zeroed = !zeroed_values[head].empty();
    const float* vhead = values_zeroed ? zeroed_values[head].data() : c.v + c.v_rows.at(blk.b, blk.hk, 0);
    tile.ldv = values_zeroed ? dv : c.v_rows.pos;
    const float* kthead = kt_p + off_p[head];
    // A mask value of the row's range that is NaN or +inf: the row is the row path's.
    auto mask_spoils = [&](size_t r, size_t a, size_t e) {
      for (size_t j = a; j < e; ++j) {
        const float x = mask[r].value(j);
        if (std::isnan(x) || x == kPosInf) return true;
      }
      return false;
    };
    // One key tile (keys [t0, t0 + n)) through the online softmax of every row of the block.
    auto visit = [&](size_t t0) {
      const size_t n = std::min(kKeys, keys - t0);
      bool whole = !masked;  // every row attends every key of the tile
      for (size_t r = 0; r < m && whole; ++r) whole = lo[r] <= t0 && hi[r] >= t0 + n;
      for (size_t r = 0; r < m; ++r) {
        const size_t a = std::clamp(lo[r], t0, t0 + n), e = std::clamp(hi[r], t0, t0 + n);
        tile_lo[r] = static_cast<int32_t>(a - t0);
        tile_hi[r] = static_cast<int32_t>(std::max(a, e) - t0);
        if (!masked) continue;
        float* dst = bias.data() + r * kKeys;
        for (size_t j = 0; j < n; ++j) dst[j] = mask[r].value(t0 + j);
        if (computed[r] && mask_spoils(r, a, e)) computed[r] = 0;
      }
      tile.set_keys(kthead + (t0 / kKeys) * d * kKeys, vhead + t0 * tile.ldv, n,
                    whole ? nullptr : tile_lo.data(), whole ? nullptr : tile_hi.data(),
                    masked ? bias.data() : nullptr);
      ks.attention->flash_tile(tile);
    };

    const size_t t_first = first / kKeys, t_end = first < last ? (last + kKeys - 1) / kKeys : t_first;
    // Selective prefill: the tiles every live row attends whole, away from the sinks and every
    // row's recent keys, are selectable; the rest are always computed.
    std::vector<int32_t> selectable;
    size_t live_rows = 0;
    if (selective && first < last) {
      size_t lo_max = 0, hi_min = keys, shortest = keys;
      for (size_t r = 0; r < m; ++r) {
        if (lo[r] >= hi[r]) continue;
        ++live_rows;
        lo_max = std::max(lo_max, lo[r]);
        hi_min = std::min(hi_min, hi[r]);
        shortest = std::min(shortest, hi[r] - lo[r]);
      }
      if (shortest >= p.min_keys) {
        for (size_t t = t_first; t < t_end; ++t) {
          const size_t t0 = t * kKeys, n = std::min(kKeys, keys - t0);
          const bool whole = lo_max <= t0 && t0 + n <= hi_min;
          const bool sink = t0 < p.sink_keys;
          const bool recent = t0 + n + p.recent_keys > hi_min;
          if (whole && !sink && !recent) selectable.push_back(static_cast<int32_t>(t));
        }
      }
      const size_t enough = p.select == PrefillSelect::kBudget ? p.budget_tiles + 1 : kMinSelectableTiles;
      if (selectable.size() < std::max(enough, kMinSelectableTiles)) selectable.clear();
    }
    uint64_t skipped_here = 0, keys_skipped_here = 0;
    if (selectable.empty()) {
      for (size_t t = t_first; t < t_end; ++t) visit(t * kKeys);
    } else {
      // The block's bound per selectable tile: the max over its live rows of the row's bound.
      const size_t S = selectable.size();
      const size_t base = base_p[head], tiles = base_p[head + 1] - base;
      std::vector<float> qsplit(2 * d), raw(t_end), row_bound(m * S, kNegInf), top(S, kNegInf);
      bool usable = true;
      for (size_t r = 0; r < m && usable; ++r) {
        if (lo[r] >= hi[r]) continue;
        const float slack = bound_slack(d, split_query(q.data() + r * d, d, qsplit.data()));
        float* ub = row_bound.data() + r * S;
        // raw[t] = sum_c qsplit[c] · box row c, tile t: the bounds of tiles [0, t_end) at once
        ks.matmul->gemv_rows(box_p + base * 2 * d, tiles, nullptr, qsplit.data(), 2 * d, raw.data(), t_end, false);
        bool spoiled = false;
        for (size_t s = 0; s < S && !spoiled; ++s) {
          const size_t t = static_cast<size_t>(selectable[s]);
          const size_t t0 = t * kKeys, t1 = std::min(keys, t0 + kKeys);
          float b = score_space_bound(raw[t], absmax_p[base + t], slack, score);
          if (masked) {  // selectable tiles lie inside every live row's range
            spoiled = mask_spoils(r, t0, t1);
            float biggest = kNegInf;
            for (size_t j = t0; j < t1; ++j) biggest = std::max(biggest, mask[r].value(j));
            b = biggest == kNegInf ? kNegInf : b + biggest;
          }
          ub[s] = b;
        }
        if (spoiled) {  // the row path's: out of the block's bounds and tiles
          computed[r] = 0;
          lo[r] = hi[r] = 0;
          --live_rows;
          std::fill(ub, ub + S, kNegInf);
          continue;
        }
        for (size_t s = 0; s < S; ++s) {
          usable = usable && !std::isnan(ub[s]);
          top[s] = std::max(top[s], ub[s]);
        }
      }
      std::vector<int32_t> order(S);  // positions in `selectable`, best block bound first (ties: lower tile)
      std::iota(order.begin(), order.end(), 0);
      std::sort(order.begin(), order.end(), [&top](int32_t a, int32_t b) { return top[a] > top[b] || (top[a] == top[b] && a < b); });
      std::vector<char> chosen(t_end - t_first, 1);
      for (const int32_t t : selectable) chosen[t - t_first] = 0;
      size_t visited = 0;
      if (!usable) {  // a bound overflowed to NaN: no order to trust, every tile
        visited = S;
        for (const int32_t t : selectable) chosen[t - t_first] = 1;
      } else if (p.select == PrefillSelect::kBudget) {
        visited = std::min(S, p.budget_tiles);
        for (size_t k = 0; k < visited; ++k) chosen[selectable[order[k]] - t_first] = 1;
      }
      if (p.select == PrefillSelect::kBudget || !usable) {
        for (size_t t = t_first; t < t_end; ++t)  // ascending, as the exact path
          if (chosen[t - t_first]) visit(t * kKeys);
      } else {
        for (size_t t = t_first; t < t_end; ++t)  // the always-computed tiles first: they set the rows' max and sum
          if (chosen[t - t_first]) visit(t * kKeys);
        // Per row, the largest bound among the tiles from order position k on (k = S: none), and
        // the keys of those tiles.
        std::vector<float> bound_left(m * (S + 1), kNegInf);
        std::vector<size_t> keys_left(S + 1, 0);
        for (size_t k = S; k-- > 0;) {
          const size_t t = static_cast<size_t>(selectable[order[k]]);
          keys_left[k] = keys_left[k + 1] + std::min(kKeys, keys - t * kKeys);
          for (size_t r = 0; r < m; ++r)
            bound_left[r * (S + 1) + k] = std::max(bound_left[r * (S + 1) + k + 1], row_bound[r * S + order[k]]);
        }
        // Certified stop: every row's keys left could add at most keys_left · exp(bound − max) to its
        // sum of exp(s − max); at most eps of that sum, the mass dropped is <= eps of the total.
        // The row that failed last is checked first: it usually fails again, so a step costs one log.
        size_t failing = 0;
        auto row_within_eps = [&](size_t r, size_t k, double log_left) {
          const float b = bound_left[r * (S + 1) + k];
          if (b == kNegInf) return true;
          if (row_max[r] == kNegInf) return false;
          return static_cast<double>(b) - row_max[r] + log_left <= log_eps + std::log(static_cast<double>(row_sum[r]));
        };
        auto dropped_within_eps = [&](size_t k) {
          const double log_left = std::log(static_cast<double>(keys_left[k]));
          if (!row_within_eps(failing, k, log_left)) return false;
          for (size_t r = 0; r < m; ++r) {
            if (r == failing || row_within_eps(r, k, log_left)) continue;
            failing = r;
            return false;
          }
          return true;
        };
        for (; visited < S && !dropped_within_eps(visited); ++visited) visit(static_cast<size_t>(selectable[order[visited]]) * kKeys);
      }
      for (size_t k = visited; k < S && usable; ++k) {
        const size_t t = static_cast<size_t>(selectable[order[k]]);
        ++skipped_here;
        keys_skipped_here += std::min(kKeys, keys - t * kKeys) * live_rows;
      }
    }
    uint64_t row_keys = 0, rows_here = 0;
    for (size_t r = 0; r < m; ++r) {
      if (!computed[r]) continue;
      const size_t t = r / G, h = blk.hk * G + r % G, i = blk.i0 + t;
      float* y = c.y + c.y_rows.at(blk.b, h, i);
      if (row_max[r] == kNegInf) {  // no attendable key
        std::fill(y, y + dv, 0.0f);
      } else {
        const float sink = c.head_sink ? c.head_sink[h] : p.smooth_softmax ? 0.0f : kNegInf;
        const double base = std::max(static_cast<double>(row_max[r]), static_cast<double>(sink));
        const double f = std::exp(static_cast<double>(row_max[r]) - base);
        const double total = row_sum[r] * f + (sink == kNegInf ? 0.0 : std::exp(static_cast<double>(sink) - base));
        const float w = static_cast<float>(f / total);
        const float* orow = o.data() + r * dv;
        for (size_t x = 0; x < dv; ++x) y[x] = orow[x] * w;
        if (!all_finite(y, dv)) continue;  // the row path's (a sink or a sum out of float range)
      }
      done_p[(blk.b * dd.h + h) * dd.sq + i] = 1;
      row_keys += hi[r] - lo[r];
      ++rows_here;
    }
    attended.fetch_add(row_keys, std::memory_order_relaxed);
    rows_done.fetch_add(rows_here, std::memory_order_relaxed);
    skipped_keys.fetch_add(keys_skipped_here, std::memory_order_relaxed);
    tiles_seen.fetch_add(t_end - t_first, std::memory_order_relaxed);
    tiles_skipped.fetch_add(skipped_here, std::memory_order_relaxed);
  });
  stats->keys_total = attended.load();
  stats->keys_skipped = skipped_keys.load();
  stats->tiles = tiles_seen.load();
  stats->tiles_skipped = tiles_skipped.load();
  stats->rows_left = dd.b * dd.h * dd.sq - rows_done.load();
  stats->values_nonfinite = values_nonfinite.load();
  return true;
}

}  // namespace ortsparse::attention
