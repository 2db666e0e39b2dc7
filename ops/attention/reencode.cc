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

ReencodeStats Reencoder::run_locked(const AttentionCall& c, const ReencodeParams& params,
                                    const kernels::KernelSet& ks, const TaskRunner& runner) {
  ReencodeStats stats;
  const AttentionDims& dd = c.dims;
  if (dd.hkv == 0 || dd.h % dd.hkv != 0 || dd.d == 0 || dd.dv == 0 || dd.skv == 0 || !c.kv_len.empty() ||
      !c.q_pos0.empty() || c.head_sink != nullptr)
    return stats;
  const size_t B = dd.b, H = dd.h, Hkv = dd.hkv, Sq = dd.sq, Skv = dd.skv, D = dd.d, Dv = dd.dv, G = H / Hkv;
  const size_t rows = B * H * Sq;
  const bool keep = c.mask.keep != nullptr, add = c.mask.add != nullptr;
  const size_t mask_bytes = params.mask_elements * (keep ? sizeof(uint8_t) : add ? sizeof(float) : 0);
  const uint8_t* mask_data = keep ? c.mask.keep : add ? reinterpret_cast<const uint8_t*>(c.mask.add) : nullptr;

  const bool same_call = valid_ && same_dims(dims_, dd) && params_.scale == params.scale &&
                         params_.causal == params.causal && params_.tol == params.tol &&
                         params_.mask_elements == params.mask_elements && mask_keep_ == keep && mask_add_ == add &&
                         std::equal(mask_stride_, mask_stride_ + 4, c.mask.stride);
  const bool reset = !same_call;
  const bool mask_changed = mask_bytes > 0 && (reset || std::memcmp(mask_.data(), mask_data, mask_bytes) != 0);
  if (add && mask_changed)
    for (size_t e = 0; e < params.mask_elements; ++e)
      if (std::isnan(c.mask.add[e]) || c.mask.add[e] == kPosInf) return stats;  // the full path's semantics
  if (reset) {
    valid_ = false;
    q_.assign(B * H * Sq * D, 0.0f);
    k_.assign(B * Hkv * Skv * D, 0.0f);
    v_.assign(B * Hkv * Skv * Dv, 0.0f);
    y_.assign(rows * Dv, 0.0f);
    mask_.assign(mask_bytes, 0);
    row_max_.assign(rows, kNegInf);
    row_sum_.assign(rows, 0.0);
    row_through_.assign(rows, 0.0);
    numer_.assign(rows * Dv, 0.0f);
    stats.reset = true;
  }
  MaskView old_mask = c.mask;  // the previous call's mask, same strides
  old_mask.keep = keep ? mask_.data() : nullptr;
  old_mask.add = add ? reinterpret_cast<const float*>(mask_.data()) : nullptr;

  // The attended keys of query i: [0, hi) (4-D form: query i sits at position Skv - Sq + i).
  auto key_end = [&](size_t i) -> size_t {
    if (!params.causal) return Skv;
    const int64_t pos = static_cast<int64_t>(Skv) - static_cast<int64_t>(Sq) + static_cast<int64_t>(i);
    return pos < 0 ? 0 : std::min(Skv, static_cast<size_t>(pos) + 1);
  };

  // Phase 1, per (b, kv head): which K/V rows and which query rows changed; each row's kind.
  const size_t heads = B * Hkv;
  std::vector<uint8_t> q_changed(rows), kind(rows);
  std::vector<uint32_t> changed_before(heads * (Skv + 1));  // per head: changed K/V rows among [0, j)
  std::vector<int32_t> changed_keys(heads * Skv);            // per head: their indices, ascending
  std::atomic<bool> finite{true};
  const float* q_in = c.q;
  const float* k_in = c.k;
  const float* v_in = c.v;
  runner.run(heads, [&](size_t task) {
    const size_t b = task / Hkv, hk = task % Hkv;
    uint32_t* before = changed_before.data() + task * (Skv + 1);
    int32_t* list = changed_keys.data() + task * Skv;
    bool ok = true;
    uint32_t count = 0;
    for (size_t j = 0; j < Skv; ++j) {
      before[j] = count;
      const float* kr = k_in + c.k_rows.at(b, hk, j);
      const float* vr = v_in + c.v_rows.at(b, hk, j);
      const bool changed = reset || !unchanged(kr, k_.data() + (task * Skv + j) * D, D, params.tol) ||
                           !unchanged(vr, v_.data() + (task * Skv + j) * Dv, Dv, params.tol);
      if (!changed) continue;
      ok = ok && all_finite(kr, D) && all_finite(vr, Dv);
      list[count++] = static_cast<int32_t>(j);
    }
    before[Skv] = count;
    for (size_t g = 0; g < G; ++g) {
      const size_t h = hk * G + g;
      for (size_t i = 0; i < Sq; ++i) {
        const size_t r = (b * H + h) * Sq + i;
        const float* qr = q_in + c.q_rows.at(b, h, i);
        const bool qc = reset || !unchanged(qr, q_.data() + r * D, D, params.tol);
        q_changed[r] = qc;
        if (qc) ok = ok && all_finite(qr, D);
        const size_t hi = key_end(i);
        bool mask_row_changed = false;
        if (mask_changed && !reset && !qc) {
          const MaskRow now = mask_row(c.mask, b, h, i), was = mask_row(old_mask, b, h, i);
          for (size_t j = 0; j < hi && !mask_row_changed; ++j) {
            const float x = now.value(j), y = was.value(j);
            mask_row_changed = !(x == y);
          }
        }
        const uint32_t n_changed = before[hi] - before[0];
        if (reset || qc || mask_row_changed) {
          kind[r] = kRecompute;
        } else if (n_changed == 0) {
          kind[r] = kReuse;
        } else if (!(row_sum_[r] > 0.0) || row_max_[r] == kNegInf ||
                   static_cast<double>(n_changed) > kMaxCorrectedFraction * static_cast<double>(hi)) {
          kind[r] = kRecompute;
        } else {
          kind[r] = kCorrect;
        }
      }
    }
    if (!ok) finite.store(false, std::memory_order_relaxed);
  });
  if (!finite.load()) return stats;

  // Phase 2, per (b, kv head): reuse, correct, recompute (flash tiles); then the head's inputs
  // become the state. A task touches only its head's K/V rows and its query rows.
  std::atomic<uint64_t> reused{0}, corrected{0}, recomputed{0}, attended{0}, scored{0};
  const ScoreParams score{params.scale, 0.0f};
  const bool masked = mask_bytes > 0;
  runner.run(heads, [&](size_t task) {
    const size_t b = task / Hkv, hk = task % Hkv;
    const uint32_t* before = changed_before.data() + task * (Skv + 1);
    const int32_t* list = changed_keys.data() + task * Skv;
    const float* k_state = k_.data() + task * Skv * D;
    const float* v_state = v_.data() + task * Skv * Dv;
    const float* k_new = k_in + c.k_rows.at(b, hk, 0);
    const float* v_new = v_in + c.v_rows.at(b, hk, 0);
    uint64_t n_reused = 0, n_corrected = 0, n_attended = 0, n_scored = 0;
    bool ok = true;
    std::vector<size_t> redo;  // rows (g * Sq + i) to recompute
    std::vector<float> s_old, s_new;
    std::vector<float> numer(Dv);
    for (size_t g = 0; g < G; ++g) {
      const size_t h = hk * G + g;
      for (size_t i = 0; i < Sq; ++i) {
        const size_t r = (b * H + h) * Sq + i, hi = key_end(i);
        float* y = c.y + c.y_rows.at(b, h, i);
        n_attended += hi;
        if (kind[r] == kReuse) {
          std::copy_n(y_.data() + r * Dv, Dv, y);
          ++n_reused;
          continue;
        }
        if (kind[r] == kRecompute) {
          redo.push_back(g * Sq + i);
          continue;
        }
        // Correction: the changed keys of [0, hi) leave and re-enter the running softmax.
        const size_t n = before[hi];
        const int32_t* keys = list;
        s_old.resize(n);
        s_new.resize(n);
        const float* q = q_.data() + r * D;  // the row's state (= this call's Q row when tol = 0)
        const MaskRow m = masked ? mask_row(c.mask, b, h, i) : MaskRow{};  // unchanged for this row
        exact_scores(ks, score, q, D, k_state, D, m, 0, keys, n, s_old.data());
        exact_scores(ks, score, q, D, k_new, c.k_rows.pos, m, 0, keys, n, s_new.data());
        n_scored += 2 * n;
        float mx = row_max_[r];
        const float top = *std::max_element(s_new.begin(), s_new.end());
        double sum = row_sum_[r], through = row_through_[r];
        std::copy_n(numer_.data() + r * Dv, Dv, numer.data());
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
        const double removed = ks.attention->exp_sub(s_old.data(), n, mx, s_old.data());
        const double added = ks.attention->exp_sub(s_new.data(), n, mx, s_new.data());
        for (size_t t = 0; t < n; ++t) s_old[t] = -s_old[t];
        ks.matmul->gemv_rows(v_state, Dv, keys, s_old.data(), n, numer.data(), Dv, true);
        ks.matmul->gemv_rows(v_new, c.v_rows.pos, keys, s_new.data(), n, numer.data(), Dv, true);
        sum = sum - removed + added;
        through += removed + added;
        if (!(sum > 0.0) || !(through <= kMaxAmplification * sum)) {  // cancellation: recompute
          redo.push_back(g * Sq + i);
          continue;
        }
        const float inv = static_cast<float>(1.0 / sum);
        float* keep_y = y_.data() + r * Dv;
        for (size_t x = 0; x < Dv; ++x) keep_y[x] = y[x] = numer[x] * inv;
        ok = ok && all_finite(y, Dv);
        std::copy_n(numer.data(), Dv, numer_.data() + r * Dv);
        row_max_[r] = mx;
        row_sum_[r] = sum;
        row_through_[r] = through;
        ++n_corrected;
      }
    }

    // The changed rows become the state (after the corrections' reads of the old ones); the rows
    // left as they were (tol > 0: within tol) keep the state's, so every output is exact attention
    // over the state's rows.
    for (size_t t = 0; t < before[Skv]; ++t) {
      const size_t j = static_cast<size_t>(list[t]);
      std::copy_n(k_new + j * c.k_rows.pos, D, k_.data() + (task * Skv + j) * D);
      std::copy_n(v_new + j * c.v_rows.pos, Dv, v_.data() + (task * Skv + j) * Dv);
    }
    for (size_t g = 0; g < G; ++g)
      for (size_t i = 0; i < Sq; ++i) {
        const size_t h = hk * G + g, r = (b * H + h) * Sq + i;
        if (q_changed[r]) std::copy_n(q_in + c.q_rows.at(b, h, i), D, q_.data() + r * D);
      }

    if (!redo.empty()) {
      // K^T of the head, tile by tile ([D][kKeys] floats per tile; columns past Skv stay 0).
      const size_t tiles = (Skv + kKeys - 1) / kKeys;
      std::vector<float> kt(tiles * D * kKeys, 0.0f);
      for (size_t j = 0; j < Skv; ++j) {
        const float* row = k_state + j * D;  // the state's rows, just updated
        float* dst = kt.data() + (j / kKeys) * D * kKeys + j % kKeys;
        for (size_t x = 0; x < D; ++x) dst[x * kKeys] = row[x];
      }
      std::vector<float> qb(kBlockRows * D), o(kBlockRows * Dv), scores(kBlockRows * kKeys);
      std::vector<float> bias(masked ? kBlockRows * kKeys : 0), row_max(kBlockRows), row_sum(kBlockRows);
      std::vector<int32_t> tile_lo(kBlockRows), tile_hi(kBlockRows);
      std::vector<size_t> hi(kBlockRows);
      std::vector<MaskRow> mrows(kBlockRows);
      for (size_t r0 = 0; r0 < redo.size(); r0 += kBlockRows) {
        const size_t m = std::min(kBlockRows, redo.size() - r0);
        size_t last = 0;
        for (size_t t = 0; t < m; ++t) {
          const size_t g = redo[r0 + t] / Sq, i = redo[r0 + t] % Sq, h = hk * G + g;
          std::copy_n(q_.data() + ((b * H + h) * Sq + i) * D, D, qb.data() + t * D);
          hi[t] = key_end(i);
          last = std::max(last, hi[t]);
          if (masked) mrows[t] = mask_row(c.mask, b, h, i);
        }
        std::fill(o.begin(), o.end(), 0.0f);
        std::fill(row_max.begin(), row_max.end(), kNegInf);
        std::fill(row_sum.begin(), row_sum.end(), 0.0f);
        kernels::FlashTile tile;
        tile.q = qb.data();
        tile.ldv = Dv;
        tile.m = m;
        tile.d = D;
        tile.dv = Dv;
        tile.scale = params.scale;
        tile.scores = scores.data();
        tile.row_max = row_max.data();
        tile.row_sum = row_sum.data();
        tile.o = o.data();
        for (size_t t0 = 0; t0 < last; t0 += kKeys) {
          const size_t n = std::min(kKeys, Skv - t0);
          bool whole = true;
          for (size_t t = 0; t < m && whole; ++t) whole = hi[t] >= t0 + n;
          if (!whole)
            for (size_t t = 0; t < m; ++t) {
              tile_lo[t] = 0;
              tile_hi[t] = static_cast<int32_t>(std::clamp(hi[t], t0, t0 + n) - t0);
            }
          if (masked)
            for (size_t t = 0; t < m; ++t)
              for (size_t j = 0; j < n; ++j) bias[t * kKeys + j] = mrows[t].value(t0 + j);
          tile.set_keys(kt.data() + (t0 / kKeys) * D * kKeys, v_state + t0 * Dv, n,
                        whole ? nullptr : tile_lo.data(), whole ? nullptr : tile_hi.data(),
                        masked ? bias.data() : nullptr);
          ks.attention->flash_tile(tile);
        }
        for (size_t t = 0; t < m; ++t) {
          const size_t g = redo[r0 + t] / Sq, i = redo[r0 + t] % Sq, h = hk * G + g;
          const size_t r = (b * H + h) * Sq + i;
          float* y = c.y + c.y_rows.at(b, h, i);
          float* keep_y = y_.data() + r * Dv;
          float* numer_r = numer_.data() + r * Dv;
          const float* orow = o.data() + t * Dv;
          n_scored += hi[t];
          if (row_max[t] == kNegInf) {  // no attendable key: y = 0
            std::fill(y, y + Dv, 0.0f);
            std::fill(keep_y, keep_y + Dv, 0.0f);
            std::fill(numer_r, numer_r + Dv, 0.0f);
            row_max_[r] = kNegInf;
            row_sum_[r] = row_through_[r] = 0.0;
            continue;
          }
          const float w = static_cast<float>(1.0 / static_cast<double>(row_sum[t]));
          for (size_t x = 0; x < Dv; ++x) {
            keep_y[x] = y[x] = orow[x] * w;
            numer_r[x] = orow[x];
          }
          ok = ok && all_finite(y, Dv);
          row_max_[r] = row_max[t];
          row_sum_[r] = row_through_[r] = row_sum[t];
        }
      }
    }

    reused.fetch_add(n_reused, std::memory_order_relaxed);
    corrected.fetch_add(n_corrected, std::memory_order_relaxed);
    recomputed.fetch_add(redo.size(), std::memory_order_relaxed);
    attended.fetch_add(n_attended, std::memory_order_relaxed);
    scored.fetch_add(n_scored, std::memory_order_relaxed);
    if (!ok) finite.store(false, std::memory_order_relaxed);
  });
  if (!finite.load()) return stats;  // a non-finite output: the caller's full path decides it
  if (mask_changed) std::memcpy(mask_.data(), mask_data, mask_bytes);
  valid_ = true;
  dims_ = dd;
  params_ = params;
  mask_keep_ = keep;
  mask_add_ = add;
  std::copy(c.mask.stride, c.mask.stride + 4, mask_stride_);
  stats.applied = true;
  stats.rows_reused = reused.load();
  stats.rows_corrected = corrected.load();
  stats.rows_recomputed = recomputed.load();
  stats.keys_attended = attended.load();
  stats.keys_scored = scored.load();
  return stats;
}

}  // namespace ortsparse::attention
