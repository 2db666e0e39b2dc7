#include "attention/popcount_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "attention/exact_attention.h"
#include "common/error.h"
#include "kernels/top_k.h"

namespace ortsparse::attention {

using kernels::kLanes;

PackMode parse_pack_mode(const std::string& name) {
  if (name == "sign") return PackMode::kSign;
  if (name == "binary") return PackMode::kBinary;
  if (name == "ternary") return PackMode::kTernary;
  fail("attribute mode='", name, "' is not one of sign, binary, ternary");
}

Selector parse_selector(const std::string& name) {
  if (name == "none") return Selector::kNone;
  if (name == "popcount") return Selector::kPopcount;
  if (name == "energy") return Selector::kEnergy;
  fail("attribute select='", name, "' is not one of popcount, energy, none");
}

const char* pack_mode_name(PackMode mode) {
  switch (mode) {
    case PackMode::kSign: return "sign";
    case PackMode::kBinary: return "binary";
    default: return "ternary";
  }
}

const char* selector_name(Selector select) {
  switch (select) {
    case Selector::kPopcount: return "popcount";
    case Selector::kEnergy: return "energy";
    default: return "none";
  }
}

namespace {

constexpr float kMaskedOut = -1e30f;  // an additive mask below this excludes the key from selection

KeySummary key_summary(const PopcountAttentionConfig& c) {
  KeySummary s;
  s.select = c.select;
  s.mode = c.mode;
  s.eps = c.eps;
  s.center = c.center;
  s.proj_bits = c.proj_bits;
  return s;
}

// Per-task work buffers (sized for the call's longest key range).
struct Scratch {
  std::vector<float> sel, scores;
  std::vector<int32_t> counts, kept, final_rows;
  std::vector<uint32_t> select;
  std::vector<uint64_t> qbits;
  std::vector<float> qproj;
  uint64_t keys_total = 0, keys_exact = 0;

  void reserve(size_t keys, size_t packed_dim) {
    const size_t pad = ((keys + kLanes - 1) / kLanes + 1) * kLanes + kernels::kIndexSlack;
    const size_t qwords = 2 * ((packed_dim + 63) / 64) + 1;
    if (sel.size() >= pad && qbits.size() >= qwords && qproj.size() >= packed_dim) return;
    sel.resize(pad);
    scores.resize(pad);
    counts.resize(pad);
    kept.resize(pad);
    final_rows.resize(pad);
    qbits.resize(qwords);
    qproj.resize(packed_dim);
  }
};

// What every query row of one call shares.
struct CallPlan {
  const AttentionCall* call;
  const PopcountAttentionConfig* config;
  const kernels::KernelSet* kernels;
  ScoreParams score;
  const KeyCache* keys;  // null when the selector does not run
};

// The attendable keys of query (b, i): [lo, hi) in the head's key order.
struct KeyRange {
  size_t lo = 0, hi = 0;
};

KeyRange key_range(const CallPlan& p, size_t b, size_t i) {
  const AttentionCall& c = *p.call;
  const size_t keys = c.keys(b);
  KeyRange r{0, keys};
  if (!p.config->causal) return r;
  const int64_t pos = c.position(b, i);
  r.hi = pos < 0 ? 0 : std::min(keys, static_cast<size_t>(pos) + 1);
  if (p.config->local_window >= 0 && pos >= 0) {
    const int64_t first = pos - p.config->local_window + 1;
    r.lo = std::min(r.hi, static_cast<size_t>(std::max<int64_t>(0, first)));
  }
  return r;
}

// Approximate scores of keys [lo, hi) for query q of kv head hk into sel[0, hi - lo).
void selector_scores(const CallPlan& p, const float* q, size_t hk, const KeyRange& r, Scratch& s) {
  const PopcountAttentionConfig& cfg = *p.config;
  const KeyCache& kc = *p.keys;
  const size_t n = r.hi - r.lo;
  float* sel = s.sel.data();
  if (cfg.select == Selector::kEnergy) {
    std::copy_n(kc.head_energy(hk) + r.lo, n, sel);
    return;
  }
  const kernels::KernelSet& ks = *p.kernels;
  const float* qx = q;
  if (kc.projection) {
    ks.matmul->gemv_rows(kc.projection->data(), kc.packed_dim, nullptr, q, kc.d, s.qproj.data(), kc.packed_dim, false);
    qx = s.qproj.data();
  }
  uint64_t unused = 0;
  const float gq = ks.attention->pack_row(qx, kc.packed_dim, static_cast<int>(cfg.mode), cfg.eps, s.qbits.data(), 1, &unused);
  // Whole lane blocks from the one holding key lo.
  const size_t b0 = r.lo / kLanes, nb = (r.hi + kLanes - 1) / kLanes - b0, skip = r.lo - b0 * kLanes;
  const uint64_t* packed = kc.head_packed(hk) + b0 * kc.block_words;
  int32_t* cnt = s.counts.data();
  switch (cfg.mode) {
    case PackMode::kSign: ks.popcount->xor_counts(s.qbits.data(), packed, kc.words, nb, cnt); break;
    case PackMode::kBinary: ks.popcount->and_counts(s.qbits.data(), packed, kc.words, nb, cnt); break;
    case PackMode::kTernary:
      ks.popcount->ternary_counts(s.qbits.data(), s.qbits.data() + kc.words, packed, kc.words, nb, cnt);
      break;
  }
  cnt += skip;
  const float* gk = kc.head_gamma(hk) + r.lo;
  const int32_t d = static_cast<int32_t>(kc.packed_dim);
  // Approximate q·k: sign: (agreements - disagreements)·γq·γk = (D - 2·hamming)·γq·γk; binary:
  // |q∧k|·γq·γk; ternary: (agree - disagree)·γq·γk. Same float op order as the numpy reference,
  // so the selections match exactly.
  if (cfg.mode == PackMode::kSign)
    for (size_t j = 0; j < n; ++j) cnt[j] = d - 2 * cnt[j];
  for (size_t j = 0; j < n; ++j) sel[j] = static_cast<float>(cnt[j]) * gq * gk[j] * p.score.scale;
}

// One query row: exact attention, or selection + exact refine of the kept keys.
void attend_row(const CallPlan& p, size_t b, size_t h, size_t i, Scratch& s) {
  const AttentionCall& c = *p.call;
  const AttentionDims& dd = c.dims;
  const PopcountAttentionConfig& cfg = *p.config;
  const kernels::KernelSet& ks = *p.kernels;
  const size_t hkv = h / (dd.h / dd.hkv), hk = b * dd.hkv + hkv;
  const float* q = c.q + c.q_rows.at(b, h, i);
  const float* khead = c.k + c.k_rows.at(b, hkv, 0);
  const float* vhead = c.v + c.v_rows.at(b, hkv, 0);
  const size_t ldk = c.k_rows.pos, ldv = c.v_rows.pos;
  float* y = c.y + c.y_rows.at(b, h, i);
  const KeyRange r = key_range(p, b, i);
  const size_t n = r.hi - r.lo;
  const MaskRow m = mask_row(c.mask, b, h, i);
  s.keys_total += n;
  const size_t topk = static_cast<size_t>(cfg.topk);
  auto exact_all = [&]() {
    exact_scores(ks, p.score, q, dd.d, khead, ldk, m, r.lo, nullptr, n, s.scores.data());
    softmax_pv(ks, s.scores.data(), vhead, ldv, dd.dv, r.lo, nullptr, n, y);
    s.keys_exact += n;
  };
  if (p.keys == nullptr || n == 0 || (topk > 0 && n <= topk)) return exact_all();

  float* sel = s.sel.data();
  selector_scores(p, q, hk, r, s);
  if (p.score.softcap > 0.0f) {  // monotone: only the approximate path's softmax sees it
    const float inv = 1.0f / p.score.softcap;
    for (size_t j = 0; j < n; ++j) sel[j] = p.score.softcap * std::tanh(sel[j] * inv);
  }
  add_mask(m, r.lo, sel, n);
  if (topk == 0) {  // pure approximate path: softmax of the approximate scores
    softmax_pv(ks, sel, vhead, ldv, dd.dv, r.lo, nullptr, n, y);
    return;
  }
  // Exported models mask with a huge finite value (finfo.min): such keys are out of the selection
  // as -inf ones are (never candidates, never protected); refine still adds the mask as given.
  if (m.add)
    for (size_t j = 0; j < n; ++j) sel[j] = sel[j] < kMaskedOut ? kNegInf : sel[j];
  // Protected keys (the first keep_first, the last keep_recent of the range) are always kept:
  // +inf outranks every selector score. Masked-out keys stay out.
  const size_t first = std::min(n, static_cast<size_t>(cfg.keep_first));
  const size_t recent_begin = n - std::min(n, static_cast<size_t>(cfg.keep_recent));
  size_t allowed = n, forced = 0;
  if (m.any()) {
    allowed = 0;
    for (size_t j = 0; j < n; ++j) allowed += sel[j] != kNegInf;
  }
  auto protect = [&](size_t j) {
    if (sel[j] != kNegInf) {
      sel[j] = kPosInf;
      ++forced;
    }
  };
  for (size_t j = 0; j < first; ++j) protect(j);
  for (size_t j = std::max(first, recent_begin); j < n; ++j) protect(j);
  if (allowed <= topk + forced) return exact_all();

  const size_t want = std::min<size_t>(
      allowed, forced + std::max<size_t>(topk, static_cast<size_t>(std::ceil(static_cast<double>(cfg.candidates) * topk))));
  int32_t* kept = s.kept.data();
  const size_t count = kernels::select_top_k(*ks.select, sel, n, want, kept, s.select);
  exact_scores(ks, p.score, q, dd.d, khead, ldk, m, r.lo, kept, count, s.scores.data());
  s.keys_exact += count;
  if (count <= topk + forced) return softmax_pv(ks, s.scores.data(), vhead, ldv, dd.dv, r.lo, kept, count, y);

  // Oversampled candidates: keep the topk best exact scores among them (plus the protected).
  float* rank = s.sel.data();  // the selector scores are no longer needed
  for (size_t t = 0; t < count; ++t) {
    const size_t j = static_cast<size_t>(kept[t]);
    rank[t] = (j < first || j >= recent_begin) ? kPosInf : s.scores[t];
  }
  int32_t* fin = s.final_rows.data();
  const size_t nf = kernels::select_top_k(*ks.select, rank, count, topk + forced, fin, s.select);
  float* fs = s.sel.data();
  for (size_t t = 0; t < nf; ++t) {
    fs[t] = s.scores[static_cast<size_t>(fin[t])];
    fin[t] = kept[static_cast<size_t>(fin[t])];
  }
  softmax_pv(ks, fs, vhead, ldv, dd.dv, r.lo, fin, nf, y);
}

}  // namespace

PopcountAttention::PopcountAttention(const PopcountAttentionConfig& config, const kernels::KernelSet& kernels)
    : config_(config), kernels_(&kernels), keys_(key_summary(config), config.cache_keys) {
  if (!std::isfinite(config.scale) || config.scale < 0.0f)
    fail("attribute scale=", config.scale, " must be >= 0 (0: 1/sqrt(D))");
  if (config.topk < 0) fail("attribute topk=", config.topk, " must be >= 0 (0: approximate scores only)");
  if (config.proj_bits < 0 || config.proj_bits > 4096)
    fail("attribute proj_bits=", config.proj_bits, " must be in [0, 4096] (0: no projection)");
  if (config.keep_first < 0) fail("attribute keep_first=", config.keep_first, " must be >= 0");
  if (config.keep_recent < 0) fail("attribute keep_recent=", config.keep_recent, " must be >= 0");
  if (config.min_keys < 0) fail("attribute min_keys=", config.min_keys, " must be >= 0");
  if (!(config.eps >= 0.0f)) fail("attribute eps=", config.eps, " must be >= 0");
  if (!(config.density_max > 0.0f && config.density_max <= 1.0f))
    fail("attribute density_max=", config.density_max, " must be in (0, 1] (1: never auto-disable)");
  if (!(config.candidates >= 1.0f && config.candidates <= 1024.0f))
    fail("attribute candidates=", config.candidates, " must be in [1, 1024]");
  if (!(config.softcap >= 0.0f) || !std::isfinite(config.softcap))
    fail("attribute softcap=", config.softcap, " must be a finite number >= 0 (0: none)");
  if (config.topk == 0 && config.select == Selector::kEnergy)
    fail("attribute topk=0 (approximate scores, no refine) needs select='popcount'; select='energy' has no "
         "approximate score");
  if (!popcnt_path_supported(kernels.popcnt_path))
    fail("popcount path ", kernels::popcnt_path_name(kernels.popcnt_path), " is not supported by this CPU");
  if (!isa_supported(kernels.isa)) fail("ISA ", isa_name(kernels.isa), " is not supported by this CPU");
}

AttentionStats PopcountAttention::run(const AttentionCall& call, const TaskRunner& runner) const {
  AttentionStats stats;
  const AttentionDims& dims = call.dims;
  const size_t rows_total = dims.b * dims.h * dims.sq;
  if (rows_total == 0 || dims.dv == 0) return stats;
  // Scores of a 0-dim head are 0 · 1/sqrt(0): undefined, not "every key equal".
  if (dims.d == 0) fail("Q and K have head dim D = 0; attention needs D >= 1");
  size_t max_keys = 0;
  for (size_t b = 0; b < dims.b; ++b) max_keys = std::max(max_keys, call.keys(b));
  CallPlan plan{&call, &config_, kernels_, ScoreParams{}, nullptr};
  plan.score.scale = config_.scale > 0.0f ? config_.scale : static_cast<float>(1.0 / std::sqrt(static_cast<double>(dims.d)));
  plan.score.softcap = config_.softcap;
  const bool select = config_.select != Selector::kNone && max_keys >= static_cast<size_t>(config_.min_keys) &&
                      max_keys > 0 && (config_.topk == 0 || max_keys > static_cast<size_t>(config_.topk));
  std::shared_ptr<const KeyCache> keys;
  if (select) {
    keys = keys_.prepare(call, *kernels_, runner, stats.keys_packed);
    plan.keys = keys.get();
    if (config_.select == Selector::kPopcount) {
      for (size_t hk = 0; hk < keys->heads; ++hk) {
        stats.bits_set += keys->bits_set[hk];
        stats.bits_total += static_cast<uint64_t>(keys->rows[hk]) * keys->packed_dim;
      }
      const double density = static_cast<double>(stats.bits_set) / static_cast<double>(stats.bits_total ? stats.bits_total : 1);
      // Sign packing is dense by construction (half the bits set); the sparsity check is for the
      // eps-thresholded modes.
      if (config_.mode != PackMode::kSign && density > config_.density_max) plan.keys = nullptr;
    }
  }
  stats.packed = plan.keys != nullptr;

  const size_t n_tasks = std::min<size_t>(rows_total, 64);
  std::unique_ptr<std::vector<Scratch>> pooled;
  {
    std::lock_guard<std::mutex> lock(scratch_mutex_);
    if (!scratch_pool_.empty()) {
      pooled.reset(static_cast<std::vector<Scratch>*>(scratch_pool_.back().release()));
      scratch_pool_.pop_back();
    }
  }
  if (!pooled) pooled = std::make_unique<std::vector<Scratch>>();
  std::vector<Scratch>& scratch = *pooled;
  if (scratch.size() < n_tasks) scratch.resize(n_tasks);
  const size_t packed_dim = config_.proj_bits > 0 ? static_cast<size_t>(config_.proj_bits) : dims.d;
  for (size_t t = 0; t < n_tasks; ++t) {
    scratch[t].keys_total = scratch[t].keys_exact = 0;
    scratch[t].reserve(max_keys, packed_dim);
  }
  Scratch* scratch_p = scratch.data();
  const CallPlan* pp = &plan;
  runner.run(n_tasks, [=](size_t task) {
    const AttentionDims& dd = pp->call->dims;
    const size_t begin = rows_total * task / n_tasks, end = rows_total * (task + 1) / n_tasks;
    for (size_t r = begin; r < end; ++r)
      attend_row(*pp, r / (dd.sq * dd.h), (r / dd.sq) % dd.h, r % dd.sq, scratch_p[task]);
  });
  for (size_t t = 0; t < n_tasks; ++t) {
    stats.keys_total += scratch[t].keys_total;
    stats.keys_exact += scratch[t].keys_exact;
  }
  {
    std::lock_guard<std::mutex> lock(scratch_mutex_);
    scratch_pool_.emplace_back(pooled.release(), [](void* p) { delete static_cast<std::vector<Scratch>*>(p); });
  }
  return stats;
}

}  // namespace ortsparse::attention
