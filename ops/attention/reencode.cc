#include "attention/reencode.h"

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
constexpr size_t kBlockRows = 64;  // query rows per flash block (as the tiled prompt path)

enum RowKind : uint8_t { kReuse, kCorrect, kRecompute };

// Row a (this call's) counts as unchanged from b (the state's): bit-identical with tol = 0, else
// max|a - b| <= tol · max|b|. A NaN or Inf in a always counts as a change (the caller's finiteness
// check then leaves the call to the full path).
bool unchanged(const float* a, const float* b, size_t n, float tol) {
  if (tol == 0.0f) return std::memcmp(a, b, n * sizeof(float)) == 0;
  float diff = 0.0f, size = 0.0f;
  for (size_t i = 0; i < n; ++i) {
    const float d = std::fabs(a[i] - b[i]);
    if (!std::isfinite(d)) return false;
    diff = std::max(diff, d);
    size = std::max(size, std::fabs(b[i]));
  }
  return diff <= tol * size;
}

bool same_dims(const AttentionDims& a, const AttentionDims& b) {
  return a.b == b.b && a.h == b.h && a.hkv == b.hkv && a.sq == b.sq && a.skv == b.skv && a.d == b.d && a.dv == b.dv;
}

}  // namespace

bool reencode_applies(const PopcountAttentionConfig& config, size_t keys) {
  // PopcountAttention::run's condition for running the selector, negated.
  return config.select == Selector::kNone || keys == 0 || keys < static_cast<size_t>(config.min_keys) ||
         (config.topk > 0 && keys <= static_cast<size_t>(config.topk));
}

ReencodeStats Reencoder::run(const AttentionCall& call, const ReencodeParams& params,
                             const kernels::KernelSet& kernels, const TaskRunner& runner) {
  std::unique_lock<std::mutex> lock(mutex_, std::try_to_lock);
  if (!lock.owns_lock()) {
    ReencodeStats busy;
    busy.busy = true;
    return busy;
  }
  ReencodeStats stats = run_locked(call, params, kernels, runner);
  if (!stats.applied) valid_ = false;  // the state may be half-written: rebuilt by the next call
  return stats;
}

// One call's plan: what it shares with the state, and phase 1's findings per head and query row.
struct Reencoder::Pass {
  Pass(const AttentionCall& c, const ReencodeParams& p, const kernels::KernelSet& ks)
      : call(c), params(p), kernels(ks), group(c.dims.h / c.dims.hkv) {}

  // The attended keys of query i: [0, key_end(i)) (4-D form: query i sits at position Skv - Sq + i).
  size_t key_end(size_t i) const {
    const size_t skv = call.dims.skv;
    if (!params.causal) return skv;
    const int64_t pos = static_cast<int64_t>(skv) - static_cast<int64_t>(call.dims.sq) + static_cast<int64_t>(i);
    return pos < 0 ? 0 : std::min(skv, static_cast<size_t>(pos) + 1);
  }

  const AttentionCall& call;
  const ReencodeParams& params;
  const kernels::KernelSet& kernels;
  const size_t group;  // query heads per KV head
  bool reset = false;  // the state was (re)built for this call: every row is recomputed
  size_t mask_bytes = 0;
  const uint8_t* mask_data = nullptr;  // the call's mask buffer
  bool mask_changed = false;           // ... differs from the state's (or the state was reset)
  MaskView old_mask;                   // the previous call's mask, same strides
  // Per query row (b·H + h)·Sq + i: its Q row changed; its RowKind.
  std::vector<uint8_t> q_changed, kind;
  // Per head (b·Hkv + hk): changed K/V rows among [0, j) for j in [0, Skv], and their indices
  // (ascending, Skv entries per head).
  std::vector<uint32_t> changed_before;
  std::vector<int32_t> changed_keys;
};

struct Reencoder::HeadCounts {
  uint64_t reused = 0, corrected = 0, recomputed = 0, attended = 0, scored = 0;
  bool finite = true;  // every output the task wrote is finite
};

// A correction's scores of the changed keys (old and new) and its numerator.
struct Reencoder::RowScratch {
  explicit RowScratch(size_t dv) : numer(dv) {}
  std::vector<float> s_old, s_new, numer;
};

ReencodeStats Reencoder::run_locked(const AttentionCall& c, const ReencodeParams& params,
                                    const kernels::KernelSet& ks, const TaskRunner& runner) {
  ReencodeStats stats;
  const AttentionDims& dd = c.dims;
  if (dd.hkv == 0 || dd.h % dd.hkv != 0 || dd.d == 0 || dd.dv == 0 || dd.skv == 0 || !c.kv_len.empty() ||
      !c.q_pos0.empty() || c.head_sink != nullptr)
    return stats;
  const bool keep = c.mask.keep != nullptr, add = c.mask.add != nullptr;
  Pass pass(c, params, ks);
  pass.mask_bytes = params.mask_elements * (keep ? sizeof(uint8_t) : add ? sizeof(float) : 0);
  pass.mask_data = keep ? c.mask.keep : add ? reinterpret_cast<const uint8_t*>(c.mask.add) : nullptr;
  pass.reset = !same_call(c, params);
  pass.mask_changed =
      pass.mask_bytes > 0 && (pass.reset || std::memcmp(mask_.data(), pass.mask_data, pass.mask_bytes) != 0);
  if (add && pass.mask_changed)
    for (size_t e = 0; e < params.mask_elements; ++e)
      if (std::isnan(c.mask.add[e]) || c.mask.add[e] == kPosInf) return stats;  // the full path's semantics
  if (pass.reset) {
    reset_state(dd, pass.mask_bytes);
    stats.reset = true;
  }
  pass.old_mask = c.mask;
  pass.old_mask.keep = keep ? mask_.data() : nullptr;
  pass.old_mask.add = add ? reinterpret_cast<const float*>(mask_.data()) : nullptr;

  // Phase 1, per (b, kv head): which K/V rows and which query rows changed; each row's kind.
  const size_t heads = dd.b * dd.hkv, rows = dd.b * dd.h * dd.sq;
  pass.q_changed.resize(rows);
  pass.kind.resize(rows);
  pass.changed_before.resize(heads * (dd.skv + 1));
  pass.changed_keys.resize(heads * dd.skv);
  std::atomic<bool> finite{true};
  runner.run(heads, [&](size_t head) {
    if (!classify_head(pass, head)) finite.store(false, std::memory_order_relaxed);
  });
  if (!finite.load()) return stats;

  // Phase 2, per (b, kv head): reuse, correct, recompute (flash tiles); then the head's inputs
  // become the state. A task touches only its head's K/V rows and its query rows.
  std::atomic<uint64_t> reused{0}, corrected{0}, recomputed{0}, attended{0}, scored{0};
  runner.run(heads, [&](size_t head) {
    HeadCounts counts;
    update_head(pass, head, counts);
    reused.fetch_add(counts.reused, std::memory_order_relaxed);
    corrected.fetch_add(counts.corrected, std::memory_order_relaxed);
    recomputed.fetch_add(counts.recomputed, std::memory_order_relaxed);
    attended.fetch_add(counts.attended, std::memory_order_relaxed);
    scored.fetch_add(counts.scored, std::memory_order_relaxed);
    if (!counts.finite) finite.store(false, std::memory_order_relaxed);
  });
  if (!finite.load()) return stats;  // a non-finite output: the caller's full path decides it
  keep_call(c, params, pass);
  stats.applied = true;
  stats.rows_reused = reused.load();
  stats.rows_corrected = corrected.load();
  stats.rows_recomputed = recomputed.load();
  stats.keys_attended = attended.load();
  stats.keys_scored = scored.load();
  return stats;
}

// Whether the state describes a call of these shapes, parameters and mask layout.
bool Reencoder::same_call(const AttentionCall& c, const ReencodeParams& params) const {
  const bool keep = c.mask.keep != nullptr, add = c.mask.add != nullptr;
  return valid_ && same_dims(dims_, c.dims) && params_.scale == params.scale && params_.causal == params.causal &&
         params_.tol == params.tol && params_.mask_elements == params.mask_elements && mask_keep_ == keep &&
         mask_add_ == add && std::equal(mask_stride_, mask_stride_ + 4, c.mask.stride);
}

void Reencoder::reset_state(const AttentionDims& dd, size_t mask_bytes) {
  const size_t rows = dd.b * dd.h * dd.sq;
  valid_ = false;
  q_.assign(rows * dd.d, 0.0f);
  k_.assign(dd.b * dd.hkv * dd.skv * dd.d, 0.0f);
  v_.assign(dd.b * dd.hkv * dd.skv * dd.dv, 0.0f);
  y_.assign(rows * dd.dv, 0.0f);
  mask_.assign(mask_bytes, 0);
  row_max_.assign(rows, kNegInf);
  row_sum_.assign(rows, 0.0);
  row_through_.assign(rows, 0.0);
  numer_.assign(rows * dd.dv, 0.0f);
}

// Phase 1 for one (b, kv head): its changed K/V rows, its query rows' changes and kinds. Returns
// false when a changed input row is not finite (the call is then the full path's).
bool Reencoder::classify_head(Pass& pass, size_t head) const {
  const AttentionCall& c = pass.call;
  const AttentionDims& dd = c.dims;
  const size_t Skv = dd.skv, D = dd.d, Dv = dd.dv, b = head / dd.hkv, hk = head % dd.hkv;
  const float tol = pass.params.tol;
  uint32_t* before = pass.changed_before.data() + head * (Skv + 1);
  int32_t* list = pass.changed_keys.data() + head * Skv;
  bool ok = true;
  uint32_t count = 0;
  for (size_t j = 0; j < Skv; ++j) {
    before[j] = count;
    const float* kr = c.k + c.k_rows.at(b, hk, j);
    const float* vr = c.v + c.v_rows.at(b, hk, j);
    const bool changed = pass.reset || !unchanged(kr, k_.data() + (head * Skv + j) * D, D, tol) ||
                         !unchanged(vr, v_.data() + (head * Skv + j) * Dv, Dv, tol);
    if (!changed) continue;
    ok = ok && all_finite(kr, D) && all_finite(vr, Dv);
    list[count++] = static_cast<int32_t>(j);
  }
  before[Skv] = count;
  for (size_t g = 0; g < pass.group; ++g) {
    const size_t h = hk * pass.group + g;
    for (size_t i = 0; i < dd.sq; ++i) {
      const size_t r = (b * dd.h + h) * dd.sq + i;
      const float* qr = c.q + c.q_rows.at(b, h, i);
      const bool qc = pass.reset || !unchanged(qr, q_.data() + r * D, D, tol);
      pass.q_changed[r] = qc;
      if (qc) ok = ok && all_finite(qr, D);
      const size_t hi = pass.key_end(i);
      bool mask_row_changed = false;
      if (pass.mask_changed && !pass.reset && !qc) {
        const MaskRow now = mask_row(c.mask, b, h, i), was = mask_row(pass.old_mask, b, h, i);
        for (size_t j = 0; j < hi && !mask_row_changed; ++j) {
          const float x = now.value(j), y = was.value(j);
          mask_row_changed = !(x == y);
        }
      }
      const uint32_t n_changed = before[hi] - before[0];
      if (pass.reset || qc || mask_row_changed) {
        pass.kind[r] = kRecompute;
      } else if (n_changed == 0) {
        pass.kind[r] = kReuse;
      } else if (!(row_sum_[r] > 0.0) || row_max_[r] == kNegInf ||
                 static_cast<double>(n_changed) > kMaxCorrectedFraction * static_cast<double>(hi)) {
        pass.kind[r] = kRecompute;
      } else {
        pass.kind[r] = kCorrect;
      }
    }
  }
  return ok;
}

// Phase 2 for one (b, kv head): its query rows reused, corrected or recomputed, and its inputs
// made the state.
void Reencoder::update_head(const Pass& pass, size_t head, HeadCounts& counts) {
  const AttentionCall& c = pass.call;
  const AttentionDims& dd = c.dims;
  const size_t b = head / dd.hkv, hk = head % dd.hkv, Sq = dd.sq, Dv = dd.dv;
  std::vector<size_t> redo;  // rows (g * Sq + i) to recompute
  RowScratch scratch(Dv);
  for (size_t g = 0; g < pass.group; ++g) {
    const size_t h = hk * pass.group + g;
    for (size_t i = 0; i < Sq; ++i) {
      const size_t r = (b * dd.h + h) * Sq + i;
      counts.attended += pass.key_end(i);
      if (pass.kind[r] == kReuse) {
        std::copy_n(y_.data() + r * Dv, Dv, c.y + c.y_rows.at(b, h, i));
        ++counts.reused;
      } else if (pass.kind[r] == kRecompute || !correct_row(pass, head, g, i, scratch, counts)) {
        redo.push_back(g * Sq + i);
      }
    }
  }
  // The recomputation reads the state's K / V rows, updated here (after the corrections' reads of
  // the old ones).
  store_head_inputs(pass, head);
  counts.recomputed = redo.size();
  if (!redo.empty()) recompute_rows(pass, head, redo, counts);
}

// Correction of row (b, hk·G + g, i): the changed keys of its range leave and re-enter its running
// softmax. Returns false when the row must be recomputed instead (cancellation).
bool Reencoder::correct_row(const Pass& pass, size_t head, size_t g, size_t i, RowScratch& s, HeadCounts& counts) {
  const AttentionCall& c = pass.call;
  const AttentionDims& dd = c.dims;
  const kernels::KernelSet& ks = pass.kernels;
  const size_t Skv = dd.skv, D = dd.d, Dv = dd.dv, b = head / dd.hkv, hk = head % dd.hkv;
  const size_t h = hk * pass.group + g, r = (b * dd.h + h) * dd.sq + i;
  const size_t n = pass.changed_before[head * (Skv + 1) + pass.key_end(i)];
  const int32_t* keys = pass.changed_keys.data() + head * Skv;
  const float* k_state = k_.data() + head * Skv * D;
  const float* v_state = v_.data() + head * Skv * Dv;
  const float* v_new = c.v + c.v_rows.at(b, hk, 0);
  const ScoreParams score{pass.params.scale, 0.0f};
  s.s_old.resize(n);
  s.s_new.resize(n);
  const float* q = q_.data() + r * D;  // the row's state (= this call's Q row when tol = 0)
  const MaskRow m = pass.mask_bytes > 0 ? mask_row(c.mask, b, h, i) : MaskRow{};  // unchanged for this row
  exact_scores(ks, score, q, D, k_state, D, m, 0, keys, n, s.s_old.data());
  exact_scores(ks, score, q, D, c.k + c.k_rows.at(b, hk, 0), c.k_rows.pos, m, 0, keys, n, s.s_new.data());
  counts.scored += 2 * n;
  float mx = row_max_[r];
  const float top = *std::max_element(s.s_new.begin(), s.s_new.end());
  double sum = row_sum_[r], through = row_through_[r];
  float* numer = s.numer.data();
  std::copy_n(numer_.data() + r * Dv, Dv, numer);
  if (top > mx) {  // a new key above the running max: move the reference up (no overflow)
    const double f = std::exp(static_cast<double>(mx) - static_cast<double>(top));
    const float ff = static_cast<float>(f);
    for (size_t x = 0; x < Dv; ++x) numer[x] *= ff;
    sum *= f;
    through *= f;
    mx = top;
  }
  // The weights e^{s - m} of the old and new keys (vectorised exp, the kernels' own), then
  // N += sum(w_new v_new) - sum(w_old v_old) as two weighted sums of V rows.
  const double removed = ks.attention->exp_sub(s.s_old.data(), n, mx, s.s_old.data());
  const double added = ks.attention->exp_sub(s.s_new.data(), n, mx, s.s_new.data());
  for (size_t t = 0; t < n; ++t) s.s_old[t] = -s.s_old[t];
  ks.matmul->gemv_rows(v_state, Dv, keys, s.s_old.data(), n, numer, Dv, true);
  ks.matmul->gemv_rows(v_new, c.v_rows.pos, keys, s.s_new.data(), n, numer, Dv, true);
  sum = sum - removed + added;
  through += removed + added;
  if (!(sum > 0.0) || !(through <= kMaxAmplification * sum)) return false;  // cancellation: recompute
  const float inv = static_cast<float>(1.0 / sum);
  float* y = c.y + c.y_rows.at(b, h, i);
  float* keep_y = y_.data() + r * Dv;
  for (size_t x = 0; x < Dv; ++x) keep_y[x] = y[x] = numer[x] * inv;
  counts.finite = counts.finite && all_finite(y, Dv);
  std::copy_n(numer, Dv, numer_.data() + r * Dv);
  row_max_[r] = mx;
  row_sum_[r] = sum;
  row_through_[r] = through;
  ++counts.corrected;
  return true;
}

// The head's changed K / V / Q rows become the state; the rows left as they were (tol > 0: within
// tol) keep the state's, so every output is exact attention over the state's rows.
void Reencoder::store_head_inputs(const Pass& pass, size_t head) {
  const AttentionCall& c = pass.call;
  const AttentionDims& dd = c.dims;
  const size_t Skv = dd.skv, D = dd.d, Dv = dd.dv, b = head / dd.hkv, hk = head % dd.hkv;
  const int32_t* list = pass.changed_keys.data() + head * Skv;
  const float* k_new = c.k + c.k_rows.at(b, hk, 0);
  const float* v_new = c.v + c.v_rows.at(b, hk, 0);
  for (size_t t = 0; t < pass.changed_before[head * (Skv + 1) + Skv]; ++t) {
    const size_t j = static_cast<size_t>(list[t]);
    std::copy_n(k_new + j * c.k_rows.pos, D, k_.data() + (head * Skv + j) * D);
    std::copy_n(v_new + j * c.v_rows.pos, Dv, v_.data() + (head * Skv + j) * Dv);
  }
  for (size_t g = 0; g < pass.group; ++g)
    for (size_t i = 0; i < dd.sq; ++i) {
      const size_t h = hk * pass.group + g, r = (b * dd.h + h) * dd.sq + i;
      if (pass.q_changed[r]) std::copy_n(c.q + c.q_rows.at(b, h, i), D, q_.data() + r * D);
    }
}

namespace {

// K^T of a head's rows k [skv, d], tile by tile ([d][kKeys] floats per tile; columns past skv are 0).
std::vector<float> transposed_key_tiles(const float* k, size_t skv, size_t d) {
  const size_t tiles = (skv + kKeys - 1) / kKeys;
  std::vector<float> kt(tiles * d * kKeys, 0.0f);
  for (size_t j = 0; j < skv; ++j) {
    const float* row = k + j * d;
    float* dst = kt.data() + (j / kKeys) * d * kKeys + j % kKeys;
    for (size_t x = 0; x < d; ++x) dst[x * kKeys] = row[x];
  }
  return kt;
}

// Up to kBlockRows query rows of one head through the flash kernel: their q rows, attended keys
// [0, hi) and mask rows in, their running max, sum and unnormalised output out.
struct FlashBlock {
  FlashBlock(size_t d, size_t dv, bool masked)
      : q(kBlockRows * d), o(kBlockRows * dv), scores(kBlockRows * kKeys), bias(masked ? kBlockRows * kKeys : 0),
        row_max(kBlockRows), row_sum(kBlockRows), tile_lo(kBlockRows), tile_hi(kBlockRows), hi(kBlockRows),
        mask(kBlockRows) {}

  // The block's first m rows over the keys of kt (K^T tiles) and v [skv, dv], up to key `last`.
  void run(const kernels::KernelSet& ks, size_t m, size_t last, const float* kt, const float* v, size_t skv,
           size_t d, size_t dv, float scale) {
    const bool masked = !bias.empty();
    std::fill(o.begin(), o.end(), 0.0f);
    std::fill(row_max.begin(), row_max.end(), kNegInf);
    std::fill(row_sum.begin(), row_sum.end(), 0.0f);
    kernels::FlashTile tile;
    tile.q = q.data();
    tile.ldv = dv;
    tile.m = m;
    tile.d = d;
    tile.dv = dv;
    tile.scale = scale;
    tile.scores = scores.data();
    tile.row_max = row_max.data();
    tile.row_sum = row_sum.data();
    tile.o = o.data();
    for (size_t t0 = 0; t0 < last; t0 += kKeys) {
      const size_t n = std::min(kKeys, skv - t0);
      bool whole = true;
      for (size_t t = 0; t < m && whole; ++t) whole = hi[t] >= t0 + n;
      if (!whole)
        for (size_t t = 0; t < m; ++t) {
          tile_lo[t] = 0;
          tile_hi[t] = static_cast<int32_t>(std::clamp(hi[t], t0, t0 + n) - t0);
        }
      if (masked)
        for (size_t t = 0; t < m; ++t)
          for (size_t j = 0; j < n; ++j) bias[t * kKeys + j] = mask[t].value(t0 + j);
      tile.set_keys(kt + (t0 / kKeys) * d * kKeys, v + t0 * dv, n, whole ? nullptr : tile_lo.data(),
                    whole ? nullptr : tile_hi.data(), masked ? bias.data() : nullptr);
      ks.attention->flash_tile(tile);
    }
  }

  std::vector<float> q, o, scores, bias, row_max, row_sum;
  std::vector<int32_t> tile_lo, tile_hi;
  std::vector<size_t> hi;
  std::vector<MaskRow> mask;
};

}  // namespace

// The head's rows `redo` (g·Sq + i) computed in full over the state's rows (this call's, after
// store_head_inputs), kBlockRows at a time; each row's softmax state restarts from them.
void Reencoder::recompute_rows(const Pass& pass, size_t head, const std::vector<size_t>& redo, HeadCounts& counts) {
  const AttentionCall& c = pass.call;
  const AttentionDims& dd = c.dims;
  const size_t Skv = dd.skv, Sq = dd.sq, D = dd.d, Dv = dd.dv, b = head / dd.hkv, hk = head % dd.hkv;
  const bool masked = pass.mask_bytes > 0;
  const std::vector<float> kt = transposed_key_tiles(k_.data() + head * Skv * D, Skv, D);
  FlashBlock block(D, Dv, masked);
  for (size_t r0 = 0; r0 < redo.size(); r0 += kBlockRows) {
    const size_t m = std::min(kBlockRows, redo.size() - r0);
    size_t last = 0;
    for (size_t t = 0; t < m; ++t) {
      const size_t g = redo[r0 + t] / Sq, i = redo[r0 + t] % Sq, h = hk * pass.group + g;
      std::copy_n(q_.data() + ((b * dd.h + h) * Sq + i) * D, D, block.q.data() + t * D);
      block.hi[t] = pass.key_end(i);
      last = std::max(last, block.hi[t]);
      if (masked) block.mask[t] = mask_row(c.mask, b, h, i);
    }
    block.run(pass.kernels, m, last, kt.data(), v_.data() + head * Skv * Dv, Skv, D, Dv, pass.params.scale);
    for (size_t t = 0; t < m; ++t) {
      const size_t g = redo[r0 + t] / Sq, i = redo[r0 + t] % Sq, h = hk * pass.group + g;
      const size_t r = (b * dd.h + h) * Sq + i;
      float* y = c.y + c.y_rows.at(b, h, i);
      float* keep_y = y_.data() + r * Dv;
      float* numer_r = numer_.data() + r * Dv;
      const float* orow = block.o.data() + t * Dv;
      counts.scored += block.hi[t];
      if (block.row_max[t] == kNegInf) {  // no attendable key: y = 0
        std::fill(y, y + Dv, 0.0f);
        std::fill(keep_y, keep_y + Dv, 0.0f);
        std::fill(numer_r, numer_r + Dv, 0.0f);
        row_max_[r] = kNegInf;
        row_sum_[r] = row_through_[r] = 0.0;
        continue;
      }
      const float w = static_cast<float>(1.0 / static_cast<double>(block.row_sum[t]));
      for (size_t x = 0; x < Dv; ++x) {
        keep_y[x] = y[x] = orow[x] * w;
        numer_r[x] = orow[x];
      }
      counts.finite = counts.finite && all_finite(y, Dv);
      row_max_[r] = block.row_max[t];
      row_sum_[r] = row_through_[r] = block.row_sum[t];
    }
  }
}

// The call's mask, shapes and parameters become the state's (its rows already are).
void Reencoder::keep_call(const AttentionCall& c, const ReencodeParams& params, const Pass& pass) {
  if (pass.mask_changed) std::memcpy(mask_.data(), pass.mask_data, pass.mask_bytes);
  valid_ = true;
  dims_ = c.dims;
  params_ = params;
  mask_keep_ = c.mask.keep != nullptr;
  mask_add_ = c.mask.add != nullptr;
  std::copy(c.mask.stride, c.mask.stride + 4, mask_stride_);
}

}  // namespace ortsparse::attention
