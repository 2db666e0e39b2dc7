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

// A query block: positions [i0, i0 + positions) of batch entry b, each with every query head of
// KV head hk.
struct Block {
  size_t b, hk, i0, positions;
};

// What every block of one call shares.
struct TiledPlan {
  const AttentionCall& call;
  const kernels::KernelSet& kernels;
  const TiledParams& params;
  size_t group;    // query heads per KV head
  bool selective;  // params.select != kExact
  bool masked;     // the call has a mask (keep or add)
  ScoreParams score;
  double log_eps;  // kCertified: log(eps), -inf at eps = 0
};

// The keys of every (batch, kv head) `head` = b·Hkv + hk, laid out once per call for the blocks.
// K^T tile by tile: tile t of a head is [d][kKeys] floats from kt[kt_offset[head] + t·d·kKeys];
// columns past the head's keys stay 0. Selective prefill also keeps each tile's box, [max K (D),
// min K (D)], transposed per head (row c of the head: its tiles' entry c, from
// box[2·d·tile_base[head]]; a bound pass is then one gemv of the split query), and its max |k|
// (tile_base: the head's first tile). Per head, the key rows whose K or V row is not finite
// (ascending; the rows attending one are left to the row path) and, when a V row is, V with its
// non-finite entries as 0 (what the kernel reads for the other rows); K^T and the boxes take such
// K rows with 0 there.
struct KeyTiles {
  std::vector<size_t> kt_offset, tile_base;
  std::vector<float> kt, box, box_absmax;
  std::vector<std::vector<size_t>> bad_rows;
  std::vector<std::vector<float>> zeroed_values;
  std::atomic<bool> values_nonfinite{false};
};

// KeyTiles' entries of one head (a task: heads write disjoint parts).
void lay_out_head_keys(const AttentionCall& c, bool selective, size_t head, KeyTiles& out) {
  const AttentionDims& dd = c.dims;
  const size_t d = dd.d, dv = dd.dv;
  const size_t b = head / dd.hkv, hk = head % dd.hkv, keys = c.keys(b);
  const float* k = c.k + c.k_rows.at(b, hk, 0);
  const float* v = c.v + c.v_rows.at(b, hk, 0);
  const size_t base = out.tile_base[head], tiles = out.tile_base[head + 1] - base;
  float* kt = out.kt.data() + out.kt_offset[head];
  std::vector<float> hi(selective ? d : 0), lo(selective ? d : 0), zeroed(d);
  bool v_bad = false;
  for (size_t j = 0; j < keys; ++j) {
    const float* row = k + j * c.k_rows.pos;
    const bool k_ok = all_finite(row, d), v_ok = all_finite(v + j * c.v_rows.pos, dv);
    if (!k_ok || !v_ok) out.bad_rows[head].push_back(j);
    v_bad = v_bad || !v_ok;
    if (!k_ok) {
      for (size_t x = 0; x < d; ++x) zeroed[x] = std::isfinite(row[x]) ? row[x] : 0.0f;
      row = zeroed.data();
    }
    float* dst = kt + (j / kKeys) * d * kKeys + j % kKeys;
    for (size_t x = 0; x < d; ++x) dst[x * kKeys] = row[x];
    if (!selective) continue;
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
      float* col = out.box.data() + base * 2 * d + t;
      float absmax = 0.0f;
      for (size_t x = 0; x < d; ++x) {
        col[x * tiles] = hi[x];
        col[(d + x) * tiles] = lo[x];
        absmax = std::max(absmax, std::max(std::fabs(hi[x]), std::fabs(lo[x])));
      }
      out.box_absmax[base + t] = absmax;
    }
  }
  if (!v_bad) return;
  out.values_nonfinite.store(true, std::memory_order_relaxed);
  std::vector<float>& clean = out.zeroed_values[head];
  clean.resize(keys * dv);
  for (size_t j = 0; j < keys; ++j) {
    const float* row = v + j * c.v_rows.pos;
    for (size_t x = 0; x < dv; ++x) clean[j * dv + x] = std::isfinite(row[x]) ? row[x] : 0.0f;
  }
}

void lay_out_keys(const AttentionCall& c, bool selective, const TaskRunner& runner, KeyTiles& out) {
  const AttentionDims& dd = c.dims;
  const size_t heads = dd.b * dd.hkv;
  out.kt_offset.assign(heads + 1, 0);
  out.tile_base.assign(heads + 1, 0);
  for (size_t head = 0; head < heads; ++head) {
    const size_t tiles = (c.keys(head / dd.hkv) + kKeys - 1) / kKeys;
    out.kt_offset[head + 1] = out.kt_offset[head] + tiles * dd.d * kKeys;
    out.tile_base[head + 1] = out.tile_base[head] + tiles;
  }
  out.kt.assign(out.kt_offset.back(), 0.0f);
  out.box.resize(selective ? out.tile_base.back() * 2 * dd.d : 0);
  out.box_absmax.resize(selective ? out.tile_base.back() : 0);
  out.bad_rows.resize(heads);
  out.zeroed_values.resize(heads);
  runner.run(heads, [&](size_t head) { lay_out_head_keys(c, selective, head, out); });
}

// The query blocks, the longest key ranges first (a causal prompt's last blocks have the most
// keys; the pool hands out tasks in order, so the short ones fill the gaps at the end).
std::vector<Block> plan_blocks(const AttentionDims& dd, size_t bq) {
  const size_t blocks_per_head = (dd.sq + bq - 1) / bq;
  std::vector<Block> blocks;
  blocks.reserve(dd.b * dd.hkv * blocks_per_head);
  for (size_t qb = blocks_per_head; qb-- > 0;)
    for (size_t b = 0; b < dd.b; ++b)
      for (size_t hk = 0; hk < dd.hkv; ++hk) blocks.push_back({b, hk, qb * bq, std::min(bq, dd.sq - qb * bq)});
  return blocks;
}

// What one block computed, summed into TiledStats.
struct BlockCounts {
  uint64_t row_keys = 0, rows_done = 0, keys_skipped = 0, tiles = 0, tiles_skipped = 0;
};

// One query block through the flash kernel: its rows gathered, its key tiles visited (every one,
// or with selective prefill the always-computed ones and the selectable ones chosen by bound),
// its rows written. Row r of the block is position i0 + r / G of query head hk·G + r % G.
class BlockRun {
 public:
  BlockRun(const TiledPlan& plan, const KeyTiles& keys, const Block& blk);
  BlockCounts run(char* done);

 private:
  void gather_rows();
  bool mask_spoils(size_t r, size_t a, size_t e) const;
  void visit(size_t t0);
  std::vector<int32_t> selectable_tiles();
  void visit_selected(const std::vector<int32_t>& selectable, BlockCounts& counts);
  bool bound_tiles(const std::vector<int32_t>& selectable, std::vector<float>& row_bound, std::vector<float>& top);
  size_t visit_certified(const std::vector<int32_t>& selectable, const std::vector<int32_t>& order,
                         const std::vector<float>& row_bound);
  void write_rows(char* done, BlockCounts& counts);

  const TiledPlan& plan_;
  const KeyTiles& keys_tiles_;
  const Block& blk_;
  const size_t m_, keys_, head_, d_, dv_;
  std::vector<float> q_, o_, scores_, bias_, row_max_, row_sum_;
  std::vector<size_t> lo_, hi_;  // row r's attended keys [lo, hi) (empty: not computed here)
  std::vector<int32_t> tile_lo_, tile_hi_;
  std::vector<MaskRow> mask_;
  // Rows this block computes: their inputs are finite so far (the mask is checked tile by tile).
  std::vector<char> computed_;
  size_t first_ = 0, last_ = 0;  // the union of the computed rows' key ranges
  size_t t_first_ = 0, t_end_ = 0;  // ... as key tiles [t_first, t_end)
  size_t live_rows_ = 0;            // selective prefill: rows with a non-empty range
  kernels::FlashTile tile_;
  const float* kthead_ = nullptr;  // the head's K^T tiles
  const float* vhead_ = nullptr;   // its V rows (row stride tile_.ldv)
};

BlockRun::BlockRun(const TiledPlan& plan, const KeyTiles& keys, const Block& blk)
    : plan_(plan), keys_tiles_(keys), blk_(blk), m_(blk.positions * plan.group), keys_(plan.call.keys(blk.b)),
      head_(blk.b * plan.call.dims.hkv + blk.hk), d_(plan.call.dims.d), dv_(plan.call.dims.dv),
      q_(m_ * d_, 0.0f), o_(m_ * dv_, 0.0f), scores_(m_ * kKeys), bias_(plan.masked ? m_ * kKeys : 0),
      row_max_(m_, kNegInf), row_sum_(m_, 0.0f), lo_(m_, 0), hi_(m_, 0), tile_lo_(m_), tile_hi_(m_),
      mask_(plan.masked ? m_ : 0), computed_(m_, 0) {}

BlockCounts BlockRun::run(char* done) {
  BlockCounts counts;
  gather_rows();
  const AttentionCall& c = plan_.call;
  tile_.q = q_.data();
  tile_.m = m_;
  tile_.d = d_;
  tile_.dv = dv_;
  tile_.scale = plan_.params.scale;
  tile_.softcap = plan_.params.softcap;
  tile_.scores = scores_.data();
  tile_.row_max = row_max_.data();
  tile_.row_sum = row_sum_.data();
  tile_.o = o_.data();
  const std::vector<float>& zeroed = keys_tiles_.zeroed_values[head_];
  vhead_ = zeroed.empty() ? c.v + c.v_rows.at(blk_.b, blk_.hk, 0) : zeroed.data();
  tile_.ldv = zeroed.empty() ? c.v_rows.pos : dv_;
  kthead_ = keys_tiles_.kt.data() + keys_tiles_.kt_offset[head_];

  t_first_ = first_ / kKeys;
  t_end_ = first_ < last_ ? (last_ + kKeys - 1) / kKeys : t_first_;
  std::vector<int32_t> selectable;  // empty: every tile of the range
  if (plan_.selective && first_ < last_) selectable = selectable_tiles();
  if (selectable.empty()) {
    for (size_t t = t_first_; t < t_end_; ++t) visit(t * kKeys);
  } else {
    visit_selected(selectable, counts);
  }
  write_rows(done, counts);
  counts.tiles = t_end_ - t_first_;
  return counts;
}

// Each row's q and key range; a row reading a non-finite K / V row or q is left to the row path
// (its q stays 0, its range empty).
void BlockRun::gather_rows() {
  const AttentionCall& c = plan_.call;
  const TiledParams& p = plan_.params;
  const size_t G = plan_.group;
  const std::vector<size_t>& bad = keys_tiles_.bad_rows[head_];
  first_ = keys_;
  last_ = 0;
  for (size_t t = 0; t < blk_.positions; ++t) {
    const size_t i = blk_.i0 + t;
    size_t a = 0, e = keys_;
    if (p.causal) {
      const int64_t pos = c.position(blk_.b, i);
      e = pos < 0 ? 0 : std::min(keys_, static_cast<size_t>(pos) + 1);
      if (p.local_window >= 0 && pos >= 0)
        a = std::min(e, static_cast<size_t>(std::max<int64_t>(0, pos - p.local_window + 1)));
    }
    const auto bad_from_a = std::lower_bound(bad.begin(), bad.end(), a);
    const bool reads_bad = bad_from_a != bad.end() && *bad_from_a < e;
    for (size_t g = 0; g < G; ++g) {
      const size_t r = t * G + g, h = blk_.hk * G + g;
      const float* src = c.q + c.q_rows.at(blk_.b, h, i);
      if (plan_.masked) mask_[r] = mask_row(c.mask, blk_.b, h, i);
      if (reads_bad || !all_finite(src, d_)) continue;
      computed_[r] = 1;
      std::copy_n(src, d_, q_.data() + r * d_);
      lo_[r] = a;
      hi_[r] = e;
      if (a < e) {
        first_ = std::min(first_, a);
        last_ = std::max(last_, e);
      }
    }
  }
}

// A mask value of keys [a, e) of row r that is NaN or +inf: the row is the row path's.
bool BlockRun::mask_spoils(size_t r, size_t a, size_t e) const {
  for (size_t j = a; j < e; ++j) {
    const float x = mask_[r].value(j);
    if (std::isnan(x) || x == kPosInf) return true;
  }
  return false;
}

// One key tile (keys [t0, t0 + n)) through the online softmax of every row of the block.
void BlockRun::visit(size_t t0) {
  const bool masked = plan_.masked;
  const size_t n = std::min(kKeys, keys_ - t0);
  bool whole = !masked;  // every row attends every key of the tile
  for (size_t r = 0; r < m_ && whole; ++r) whole = lo_[r] <= t0 && hi_[r] >= t0 + n;
  for (size_t r = 0; r < m_; ++r) {
    const size_t a = std::clamp(lo_[r], t0, t0 + n), e = std::clamp(hi_[r], t0, t0 + n);
    tile_lo_[r] = static_cast<int32_t>(a - t0);
    tile_hi_[r] = static_cast<int32_t>(std::max(a, e) - t0);
    if (!masked) continue;
    float* dst = bias_.data() + r * kKeys;
    for (size_t j = 0; j < n; ++j) dst[j] = mask_[r].value(t0 + j);
    if (computed_[r] && mask_spoils(r, a, e)) computed_[r] = 0;
  }
  tile_.set_keys(kthead_ + (t0 / kKeys) * d_ * kKeys, vhead_ + t0 * tile_.ldv, n, whole ? nullptr : tile_lo_.data(),
                 whole ? nullptr : tile_hi_.data(), masked ? bias_.data() : nullptr);
  plan_.kernels.attention->flash_tile(tile_);
}

// Selective prefill: the tiles every live row attends whole, away from the sinks and every row's
// recent keys, are selectable; the rest are always computed. Empty when the block is computed
// exactly (a row shorter than min_keys, or too few selectable tiles).
std::vector<int32_t> BlockRun::selectable_tiles() {
  const TiledParams& p = plan_.params;
  std::vector<int32_t> selectable;
  size_t lo_max = 0, hi_min = keys_, shortest = keys_;
  for (size_t r = 0; r < m_; ++r) {
    if (lo_[r] >= hi_[r]) continue;
    ++live_rows_;
    lo_max = std::max(lo_max, lo_[r]);
    hi_min = std::min(hi_min, hi_[r]);
    shortest = std::min(shortest, hi_[r] - lo_[r]);
  }
  if (shortest >= p.min_keys) {
    for (size_t t = t_first_; t < t_end_; ++t) {
      const size_t t0 = t * kKeys, n = std::min(kKeys, keys_ - t0);
      const bool whole = lo_max <= t0 && t0 + n <= hi_min;
      const bool sink = t0 < p.sink_keys;
      const bool recent = t0 + n + p.recent_keys > hi_min;
      if (whole && !sink && !recent) selectable.push_back(static_cast<int32_t>(t));
    }
  }
  const size_t enough = p.select == PrefillSelect::kBudget ? p.budget_tiles + 1 : kMinSelectableTiles;
  if (selectable.size() < std::max(enough, kMinSelectableTiles)) selectable.clear();
  return selectable;
}

// The block's tiles with selection: bound the selectable ones, visit the always-computed ones and
// those the budget or the certificate keeps; counts the skipped ones.
void BlockRun::visit_selected(const std::vector<int32_t>& selectable, BlockCounts& counts) {
  const TiledParams& p = plan_.params;
  const size_t S = selectable.size();
  std::vector<float> row_bound(m_ * S, kNegInf), top(S, kNegInf);
  const bool usable = bound_tiles(selectable, row_bound, top);
  std::vector<int32_t> order(S);  // positions in `selectable`, best block bound first (ties: lower tile)
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(),
            [&top](int32_t a, int32_t b) { return top[a] > top[b] || (top[a] == top[b] && a < b); });
  std::vector<char> chosen(t_end_ - t_first_, 1);
  for (const int32_t t : selectable) chosen[t - t_first_] = 0;
  size_t visited = 0;
  if (!usable) {  // a bound overflowed to NaN: no order to trust, every tile
    visited = S;
    for (const int32_t t : selectable) chosen[t - t_first_] = 1;
  } else if (p.select == PrefillSelect::kBudget) {
    visited = std::min(S, p.budget_tiles);
    for (size_t k = 0; k < visited; ++k) chosen[selectable[order[k]] - t_first_] = 1;
  }
  // Budget (or no usable bound): ascending, as the exact path. Certified: the always-computed
  // tiles first, they set the rows' max and sum; then the selectable ones best bound first.
  for (size_t t = t_first_; t < t_end_; ++t)
    if (chosen[t - t_first_]) visit(t * kKeys);
  if (p.select != PrefillSelect::kBudget && usable) visited = visit_certified(selectable, order, row_bound);
  for (size_t k = visited; k < S && usable; ++k) {
    const size_t t = static_cast<size_t>(selectable[order[k]]);
    ++counts.tiles_skipped;
    counts.keys_skipped += std::min(kKeys, keys_ - t * kKeys) * live_rows_;
  }
}

// The block's bound per selectable tile, top[s]: the max over its live rows of the row's bound
// (row_bound[r·S + s]). A row whose mask spoils a selectable tile becomes the row path's (out of
// the block's bounds and tiles). Returns false when a bound is NaN (no order to trust).
bool BlockRun::bound_tiles(const std::vector<int32_t>& selectable, std::vector<float>& row_bound,
                           std::vector<float>& top) {
  const size_t S = selectable.size();
  const size_t base = keys_tiles_.tile_base[head_], tiles = keys_tiles_.tile_base[head_ + 1] - base;
  const float* box = keys_tiles_.box.data() + base * 2 * d_;
  const float* absmax = keys_tiles_.box_absmax.data() + base;
  std::vector<float> qsplit(2 * d_), raw(t_end_);
  bool usable = true;
  for (size_t r = 0; r < m_ && usable; ++r) {
    if (lo_[r] >= hi_[r]) continue;
    const float slack = bound_slack(d_, split_query(q_.data() + r * d_, d_, qsplit.data()));
    float* ub = row_bound.data() + r * S;
    // raw[t] = sum_c qsplit[c] · box row c, tile t: the bounds of tiles [0, t_end) at once
    plan_.kernels.matmul->gemv_rows(box, tiles, nullptr, qsplit.data(), 2 * d_, raw.data(), t_end_, false);
    bool spoiled = false;
    for (size_t s = 0; s < S && !spoiled; ++s) {
      const size_t t = static_cast<size_t>(selectable[s]);
      const size_t t0 = t * kKeys, t1 = std::min(keys_, t0 + kKeys);
      float b = score_space_bound(raw[t], absmax[t], slack, plan_.score);
      if (plan_.masked) {  // selectable tiles lie inside every live row's range
        spoiled = mask_spoils(r, t0, t1);
        float biggest = kNegInf;
        for (size_t j = t0; j < t1; ++j) biggest = std::max(biggest, mask_[r].value(j));
        b = biggest == kNegInf ? kNegInf : b + biggest;
      }
      ub[s] = b;
    }
    if (spoiled) {
      computed_[r] = 0;
      lo_[r] = hi_[r] = 0;
      --live_rows_;
      std::fill(ub, ub + S, kNegInf);
      continue;
    }
    for (size_t s = 0; s < S; ++s) {
      usable = usable && !std::isnan(ub[s]);
      top[s] = std::max(top[s], ub[s]);
    }
  }
  return usable;
}

// kCertified, after the always-computed tiles: visits the selectable tiles in `order` until the
// certificate holds; returns how many it visited.
size_t BlockRun::visit_certified(const std::vector<int32_t>& selectable, const std::vector<int32_t>& order,
                                 const std::vector<float>& row_bound) {
  const size_t S = selectable.size();
  // Per row, the largest bound among the tiles from order position k on (k = S: none), and the
  // keys of those tiles.
  std::vector<float> bound_left(m_ * (S + 1), kNegInf);
  std::vector<size_t> keys_left(S + 1, 0);
  for (size_t k = S; k-- > 0;) {
    const size_t t = static_cast<size_t>(selectable[order[k]]);
    keys_left[k] = keys_left[k + 1] + std::min(kKeys, keys_ - t * kKeys);
    for (size_t r = 0; r < m_; ++r)
      bound_left[r * (S + 1) + k] = std::max(bound_left[r * (S + 1) + k + 1], row_bound[r * S + order[k]]);
  }
  // Certified stop: every row's keys left could add at most keys_left · exp(bound − max) to its
  // sum of exp(s − max); at most eps of that sum, the mass dropped is <= eps of the total.
  // The row that failed last is checked first: it usually fails again, so a step costs one log.
  size_t failing = 0;
  auto row_within_eps = [&](size_t r, size_t k, double log_left) {
    const float b = bound_left[r * (S + 1) + k];
    if (b == kNegInf) return true;
    if (row_max_[r] == kNegInf) return false;
    return static_cast<double>(b) - row_max_[r] + log_left <=
           plan_.log_eps + std::log(static_cast<double>(row_sum_[r]));
  };
  auto dropped_within_eps = [&](size_t k) {
    const double log_left = std::log(static_cast<double>(keys_left[k]));
    if (!row_within_eps(failing, k, log_left)) return false;
    for (size_t r = 0; r < m_; ++r) {
      if (r == failing || row_within_eps(r, k, log_left)) continue;
      failing = r;
      return false;
    }
    return true;
  };
  size_t visited = 0;
  for (; visited < S && !dropped_within_eps(visited); ++visited)
    visit(static_cast<size_t>(selectable[order[visited]]) * kKeys);
  return visited;
}

// y of the block's computed rows: the online softmax's output over its sum (with the head sink in
// the normaliser); a row with no attendable key gets 0. Marks them done.
void BlockRun::write_rows(char* done, BlockCounts& counts) {
  const AttentionCall& c = plan_.call;
  const AttentionDims& dd = c.dims;
  const size_t G = plan_.group;
  for (size_t r = 0; r < m_; ++r) {
    if (!computed_[r]) continue;
    const size_t t = r / G, h = blk_.hk * G + r % G, i = blk_.i0 + t;
    float* y = c.y + c.y_rows.at(blk_.b, h, i);
    if (row_max_[r] == kNegInf) {  // no attendable key
      std::fill(y, y + dv_, 0.0f);
    } else {
      const float sink = c.head_sink ? c.head_sink[h] : plan_.params.smooth_softmax ? 0.0f : kNegInf;
      const double base = std::max(static_cast<double>(row_max_[r]), static_cast<double>(sink));
      const double f = std::exp(static_cast<double>(row_max_[r]) - base);
      const double total = row_sum_[r] * f + (sink == kNegInf ? 0.0 : std::exp(static_cast<double>(sink) - base));
      const float w = static_cast<float>(f / total);
      const float* orow = o_.data() + r * dv_;
      for (size_t x = 0; x < dv_; ++x) y[x] = orow[x] * w;
      if (!all_finite(y, dv_)) continue;  // the row path's (a sink or a sum out of float range)
    }
    done[(blk_.b * dd.h + h) * dd.sq + i] = 1;
    counts.row_keys += hi_[r] - lo_[r];
    ++counts.rows_done;
  }
}

}  // namespace

bool tiled_attention(const AttentionCall& c, const kernels::KernelSet& ks, const TiledParams& p,
                     const TaskRunner& runner, std::vector<char>& done, TiledStats* stats) {
  const AttentionDims& dd = c.dims;
  if (dd.hkv == 0 || dd.h % dd.hkv != 0 || dd.d == 0) return false;
  const size_t G = dd.h / dd.hkv;
  const double log_eps = p.eps > 0.0f ? std::log(static_cast<double>(p.eps)) : -std::numeric_limits<double>::infinity();
  const TiledPlan plan{c, ks, p, G, p.select != PrefillSelect::kExact,
                       c.mask.keep != nullptr || c.mask.add != nullptr, ScoreParams{p.scale, p.softcap}, log_eps};
  KeyTiles keys;
  lay_out_keys(c, plan.selective, runner, keys);
  const std::vector<Block> blocks = plan_blocks(dd, std::max<size_t>(1, kBlockRows / G));
  std::atomic<uint64_t> attended{0}, skipped_keys{0}, tiles_seen{0}, tiles_skipped{0}, rows_done{0};
  char* done_p = done.data();
  runner.run(blocks.size(), [&, done_p](size_t task) {
    const BlockCounts counts = BlockRun(plan, keys, blocks[task]).run(done_p);
    attended.fetch_add(counts.row_keys, std::memory_order_relaxed);
    rows_done.fetch_add(counts.rows_done, std::memory_order_relaxed);
    skipped_keys.fetch_add(counts.keys_skipped, std::memory_order_relaxed);
    tiles_seen.fetch_add(counts.tiles, std::memory_order_relaxed);
    tiles_skipped.fetch_add(counts.tiles_skipped, std::memory_order_relaxed);
  });
  stats->keys_total = attended.load();
  stats->keys_skipped = skipped_keys.load();
  stats->tiles = tiles_seen.load();
  stats->tiles_skipped = tiles_skipped.load();
  stats->rows_left = dd.b * dd.h * dd.sq - rows_done.load();
  stats->values_nonfinite = keys.values_nonfinite.load();
  return true;
}

}  // namespace ortsparse::attention
