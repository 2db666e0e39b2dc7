#include "attention/popcount_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <vector>

#include "attention/exact_attention.h"
#include "attention/head_reuse.h"
#include "attention/key_bounds.h"
#include "attention/tiled_prefill.h"
#include "common/error.h"
#include "common/named_values.h"
#include "kernels/top_k.h"

namespace ortsparse::attention {

using kernels::kLanes;

namespace {
constexpr Named<PackMode> kPackModeNames[] = {
    {"sign", PackMode::kSign}, {"binary", PackMode::kBinary}, {"ternary", PackMode::kTernary}};
constexpr Named<Selector> kSelectorNames[] = {{"popcount", Selector::kPopcount}, {"energy", Selector::kEnergy},
                                              {"pages", Selector::kPages}, {"none", Selector::kNone}};
}  // namespace

PackMode parse_pack_mode(const std::string& name) { return parse_named("mode", name, kPackModeNames); }
Selector parse_selector(const std::string& name) { return parse_named("select", name, kSelectorNames); }
const char* pack_mode_name(PackMode mode) { return name_of(mode, kPackModeNames); }
const char* selector_name(Selector select) { return name_of(select, kSelectorNames); }

namespace {

constexpr float kMaskedOut = -1e30f;  // an additive mask below this excludes the key from selection

KeySummary key_summary(const PopcountAttentionConfig& c) {
  KeySummary s;
  s.select = c.select;
  s.mode = c.mode;
  s.eps = c.eps;
  s.center = c.center;
  s.proj_bits = c.proj_bits;
  s.page_size = c.page_size;
  return s;
}

// Per-task work buffers (sized for the call's longest key range).
struct Scratch {
  std::vector<float> sel, scores;
  std::vector<int32_t> counts, kept, final_rows;
  std::vector<uint32_t> select;
  std::vector<uint64_t> qbits;
  std::vector<float> qproj;
  // grouped exact
  std::vector<float> group_scores, group_weights;
  // pages
  std::vector<float> qsplit, bounds, heap_scores;
  std::vector<int32_t> page_order, heap_rows;
  uint64_t keys_total = 0, keys_exact = 0, pages_total = 0, pages_visited = 0, rows_paged = 0, rows_certified = 0;
  // event-driven attention: heads planned to reuse (certified, budget) that ranked their pages instead
  uint64_t certified_ranked = 0, budget_ranked = 0;
  // event-driven attention's gap check: a reused output, and the largest gap seen (-1: none)
  std::vector<float> check;
  float gap_max = -1.0f;

  void reserve_pages(size_t keys, size_t d, size_t page) {
    const size_t n_pages = keys / page + 2;
    if (qsplit.size() < 2 * d) qsplit.resize(2 * d);
    if (bounds.size() < n_pages) {
      bounds.resize(n_pages);
      page_order.resize(n_pages);
    }
    if (heap_scores.size() < keys + page) {
      heap_scores.resize(keys + page);
      heap_rows.resize(keys + page);
    }
  }

  // Before a call: the counters zeroed, the buffers sized for its longest key range.
  void start_call(size_t keys, size_t packed_dim) {
    keys_total = keys_exact = pages_total = pages_visited = 0;
    rows_paged = rows_certified = 0;
    certified_ranked = budget_ranked = 0;
    gap_max = -1.0f;
    reserve(keys, packed_dim);
  }

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
  // Event-driven attention (a decode step planned by head_reuse): the memories and each (b, h)'s
  // action; null: every row ranks its pages.
  HeadReuse* reuse = nullptr;
  const std::vector<HeadAction>* actions = nullptr;
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

// Scores the gathered key rows exactly (one list: the kernel prefetches along it, across scattered
// pages) and keeps the topk best (ties: lower position in rows) in heap_scores / heap_rows
// [0, kept); kth: the worst kept score. False when a score is NaN.
bool keep_best_keys(const CallPlan& p, const float* q, const float* khead, size_t ldk, const MaskRow& m,
                    const int32_t* rows, size_t count, Scratch& s, size_t& kept, float& kth) {
  const kernels::KernelSet& ks = *p.kernels;
  const size_t topk = static_cast<size_t>(p.config->topk);
  float* scores = s.sel.data();
  exact_scores(ks, p.score, q, p.call->dims.d, khead, ldk, m, 0, rows, count, scores);
  size_t allowed = 0;
  for (size_t j = 0; j < count; ++j) {
    if (std::isnan(scores[j])) return false;
    if (scores[j] == kNegInf || scores[j] < kMaskedOut) {
      scores[j] = kNegInf;
    } else {
      ++allowed;
    }
  }
  int32_t* pick = s.final_rows.data();
  kept = kernels::select_top_k(*ks.select, scores, count, std::min(topk, allowed), pick, s.select);
  kth = kPosInf;
  for (size_t t = 0; t < kept; ++t) {
    s.heap_scores[t] = scores[pick[t]];
    s.heap_rows[t] = rows[pick[t]];
    kth = std::min(kth, s.heap_scores[t]);
  }
  return true;
}

// The kept keys of a pages row: the top-k (heap_scores / heap_rows [0, kept)), then the protected
// ranges [r.lo, mid_lo) and [mid_hi, r.hi), through softmax·V. scored: keys scored to choose them.
void finish_kept_row(const CallPlan& p, const float* q, const float* khead, size_t ldk, const float* vhead,
                     size_t ldv, const KeyRange& r, size_t mid_lo, size_t mid_hi, const MaskRow& m, float sink,
                     float* y, Scratch& s, size_t kept, size_t scored) {
  const AttentionDims& dd = p.call->dims;
  const kernels::KernelSet& ks = *p.kernels;
  const ScoreParams& sp = p.score;
  const size_t d = dd.d;
  float* hs = s.heap_scores.data();
  int32_t* hr = s.heap_rows.data();
  // Their V rows start their way to cache while the protected keys are scored.
  const size_t v_bytes = dd.dv * sizeof(float);
  for (size_t t = 0; t < kept; ++t) {
    const char* row = reinterpret_cast<const char*>(vhead + static_cast<size_t>(hr[t]) * ldv);
    for (size_t byte = 0; byte < v_bytes; byte += 64) __builtin_prefetch(row + byte, 0, 2);
  }
  size_t count = kept;
  auto protect = [&](size_t a, size_t e) {
    if (e <= a) return;
    exact_scores(ks, sp, q, d, khead, ldk, m, a, nullptr, e - a, hs + count);
    for (size_t j = a; j < e; ++j) hr[count++] = static_cast<int32_t>(j);
  };
  protect(r.lo, mid_lo);
  protect(mid_hi, r.hi);
  s.keys_exact += scored + (count - kept);
  softmax_pv(ks, hs, vhead, ldv, dd.dv, 0, hr, count, y, sink);
}

// Bounds of every page holding keys [mid_lo, mid_hi) of query q into s.bounds (page pg0 first), the
// page's largest mask value added (a fully masked page: -inf). False when q or a page holds a
// non-finite value or a mask value is NaN: the row is computed exactly.
bool page_bounds(const CallPlan& p, size_t hk, const float* q, const MaskRow& m, size_t mid_lo, size_t mid_hi,
                 Scratch& s) {
  const KeyCache& kc = *p.keys;
  const size_t d = p.call->dims.d, page = kc.page;
  const float q_abs = split_query(q, d, s.qsplit.data());
  if (!std::isfinite(q_abs)) return false;
  const size_t pg0 = mid_lo / page, pg1 = (mid_hi + page - 1) / page, npg = pg1 - pg0;
  float* bound = s.bounds.data();
  p.kernels->attention->dot_rows(s.qsplit.data(), kc.head_pages(hk) + pg0 * 2 * d, 2 * d, 2 * d, nullptr, npg, bound);
  const float slack = bound_slack(d, q_abs);
  const float* absmax = kc.head_page_absmax(hk) + pg0;
  for (size_t t = 0; t < npg; ++t) {
    if (std::isnan(absmax[t])) return false;
    float b = score_space_bound(bound[t], absmax[t], slack, p.score);
    if (m.any()) {
      float top = kNegInf;
      for (size_t j = std::max(mid_lo, (pg0 + t) * page); j < std::min(mid_hi, (pg0 + t + 1) * page); ++j) {
        if (std::isnan(m.value(j))) return false;  // a NaN bias must reach the output, not lower a bound
        top = std::max(top, m.value(j));
      }
      b = top == kNegInf ? kNegInf : b + top;
    }
    bound[t] = b;
  }
  return true;
}

// One query row's pages, as the pages selector ranks them: the keys [mid_lo, mid_hi) outside the
// protected first / recent ones lie in the cache's pages pg0 .. pg0 + npg; bound[t]: page t's bound
// in score space (page_bounds); order: page indices both modes rearrange (initially 0 .. npg).
struct RowPages {
  size_t mid_lo, mid_hi, page, pg0, npg;
  const float* bound;
  int32_t* order;

  std::pair<size_t, size_t> keys(size_t t) const {
    return std::make_pair(std::max(mid_lo, (pg0 + t) * page), std::min(mid_hi, (pg0 + t + 1) * page));
  }
  bool higher_bound_first(int32_t a, int32_t b) const {
    return bound[a] > bound[b] || (bound[a] == bound[b] && a < b);
  }
};

// What a mode chose: the kept keys in s.heap_scores / s.heap_rows [0, kept), the keys and pages it
// scored exactly, and whether no key of another page could have entered the top-k.
struct RowChoice {
  size_t kept = 0, visited_keys = 0, visited_pages = 0;
  bool certified = true;
};

// Budget mode (candidates > 0): the ceil(candidates·topk / page_size) best-bound pages are scored
// exactly and their topk best keys kept; certified when every other page's bound is below the k-th
// kept score. With `record`, the choice is kept for event-driven attention's next steps. False when
// an exact score is NaN.
bool choose_budget_pages(const CallPlan& p, size_t hk, const float* q, const float* khead, size_t ldk,
                         const MaskRow& m, const RowPages& pages, Scratch& s, HeadMemory* record, RowChoice& choice) {
  const PopcountAttentionConfig& cfg = *p.config;
  const size_t topk = static_cast<size_t>(cfg.topk), page = pages.page, npg = pages.npg;
  const float* bound = pages.bound;
  int32_t* order = pages.order;
  const size_t budget = static_cast<size_t>(std::ceil(static_cast<double>(cfg.candidates) * topk));
  size_t chosen = std::min(npg, (budget + page - 1) / page);
  std::nth_element(order, order + chosen, order + npg,
                   [&pages](int32_t a, int32_t b) { return pages.higher_bound_first(a, b); });
  for (size_t c = 0; c < chosen;) {  // fully masked pages hold no candidate
    if (bound[order[c]] == kNegInf) {
      std::swap(order[c], order[--chosen]);
    } else {
      ++c;
    }
  }
  std::sort(order, order + chosen);  // ascending key order: ties of the top-k go to the lower key
  int32_t* rows = s.kept.data();
  for (size_t c = 0; c < chosen; ++c) {
    const auto [a, e] = pages.keys(static_cast<size_t>(order[c]));
    for (size_t j = a; j < e; ++j) rows[choice.visited_keys++] = static_cast<int32_t>(j);
  }
  choice.visited_pages = chosen;
  float kth = kPosInf;
  if (!keep_best_keys(p, q, khead, ldk, m, rows, choice.visited_keys, s, choice.kept, kth)) return false;
  // Certified when no page left out could hold a key scoring above the k-th kept one.
  float rest = kNegInf;
  for (size_t t = chosen; t < npg; ++t) rest = std::max(rest, bound[order[t]]);
  choice.certified = choice.kept == topk ? rest < kth : rest == kNegInf;
  if (record != nullptr) {  // event-driven attention: this choice, for the next steps to reuse
    const float* absmax = p.keys->head_page_absmax(hk) + pages.pg0;
    float worst_chosen = chosen > 0 ? kPosInf : kNegInf, top_absmax = 0.0f;
    record->pages.resize(chosen);
    for (size_t c = 0; c < chosen; ++c) {
      record->pages[c] = static_cast<int32_t>(pages.pg0) + order[c];
      worst_chosen = std::min(worst_chosen, bound[order[c]]);
    }
    for (size_t t = 0; t < npg; ++t) top_absmax = std::max(top_absmax, absmax[t]);
    record->gap = rest == kNegInf ? kPosInf : worst_chosen - rest;
    record->absmax = top_absmax;
    record->ranked_lo = pages.mid_lo;
    record->ranked_hi = pages.mid_hi;
    record->q_ref.assign(q, q + p.call->dims.d);
    record->age = 0;
    record->valid = true;
  }
  return true;
}

// Certified mode (candidates = 0): pages are scored exactly best bound first into a top-k heap
// whose top is the worst kept key (lower score, or equal score and higher index), until the next
// bound is below the k-th best score: no key of an unvisited page could enter the top-k. False
// when an exact score is NaN.
bool choose_certified_pages(const CallPlan& p, const float* q, const float* khead, size_t ldk, const MaskRow& m,
                            const RowPages& pages, Scratch& s, RowChoice& choice) {
  const size_t topk = static_cast<size_t>(p.config->topk);
  const float* bound = pages.bound;
  int32_t* order = pages.order;
  const auto lower_bound_first = [&pages](int32_t a, int32_t b) { return pages.higher_bound_first(b, a); };
  std::make_heap(order, order + pages.npg, lower_bound_first);
  float* hs = s.heap_scores.data();  // kept scores
  int32_t* hr = s.heap_rows.data();  // their key indices
  const auto better = [hs, hr](uint32_t a, uint32_t b) { return hs[a] > hs[b] || (hs[a] == hs[b] && hr[a] < hr[b]); };
  std::vector<uint32_t>& slot = s.select;
  if (slot.size() < topk + 1) slot.resize(topk + 1);
  uint32_t* heap = slot.data();
  float* page_scores = s.scores.data();
  size_t& kept = choice.kept;
  size_t left = pages.npg;
  while (left > 0) {
    const int32_t t = order[0];
    const float b = bound[t];
    if (b == kNegInf || (kept == topk && b < hs[heap[0]])) break;
    std::pop_heap(order, order + left, lower_bound_first);
    --left;
    const auto [a, e] = pages.keys(static_cast<size_t>(t));
    exact_scores(*p.kernels, p.score, q, p.call->dims.d, khead, ldk, m, a, nullptr, e - a, page_scores);
    choice.visited_keys += e - a;
    ++choice.visited_pages;
    for (size_t j = 0; j < e - a; ++j) {
      const float v = page_scores[j];
      if (std::isnan(v)) return false;
      if (v == kNegInf || v < kMaskedOut) continue;  // masked out
      const int32_t row = static_cast<int32_t>(a + j);
      if (kept < topk) {
        hs[kept] = v;
        hr[kept] = row;
        heap[kept] = static_cast<uint32_t>(kept);
        ++kept;
        std::push_heap(heap, heap + kept, better);
      } else {
        const uint32_t top = heap[0];
        if (v > hs[top] || (v == hs[top] && row < hr[top])) {
          std::pop_heap(heap, heap + kept, better);
          hs[top] = v;
          hr[top] = row;
          std::push_heap(heap, heap + kept, better);
        }
      }
    }
  }
  return true;
}

// The softmax state (max, sum of exp(s - max)) a mass-mode row has seen: the protected keys', then
// each scored batch's. Sums in double: thousands of terms, compared against a small fraction.
struct MassSoFar {
  float max = kNegInf;
  double sum = 0.0;

  // Adds scores s[0, n) (masked ones already -inf); returns their mass relative to the new max.
  double add(const float* s, size_t n) {
    float top = max;
    for (size_t j = 0; j < n; ++j) top = std::max(top, s[j]);
    if (top == kNegInf) return 0.0;
    if (top > max) {
      sum = max == kNegInf ? 0.0 : sum * std::exp(static_cast<double>(max) - top);
      max = top;
    }
    double mass = 0.0;
    for (size_t j = 0; j < n; ++j) mass += std::exp(static_cast<double>(s[j]) - max);
    sum += mass;
    return mass;
  }
  // The bound's certificate: `keys` keys scoring at most `bound` carry at most eps of the mass.
  bool covers(size_t keys, float bound, float eps) const {
    if (keys == 0 || bound == kNegInf) return true;
    if (max == kNegInf) return false;
    return static_cast<double>(keys) * std::exp(static_cast<double>(bound) - max) <= static_cast<double>(eps) * sum;
  }
};

// Scores the protected keys [r.lo, mid_lo) and [mid_hi, r.hi) of a mass-mode row into `mass` (scratch
// in s.scores). finish_kept_row scores them again: their K rows are in cache by then, and every
// pages mode keeps one ending. False when a score is NaN.
bool protected_mass(const CallPlan& p, const float* q, const float* khead, size_t ldk, const MaskRow& m,
                    const KeyRange& r, size_t mid_lo, size_t mid_hi, Scratch& s, MassSoFar& mass) {
  float* ps = s.scores.data();
  for (const auto& [a, e] : {std::make_pair(r.lo, mid_lo), std::make_pair(mid_hi, r.hi)}) {
    if (e <= a) continue;
    exact_scores(*p.kernels, p.score, q, p.call->dims.d, khead, ldk, m, a, nullptr, e - a, ps);
    for (size_t j = 0; j < e - a; ++j) {
      if (std::isnan(ps[j])) return false;
      if (ps[j] < kMaskedOut) ps[j] = kNegInf;
    }
    mass.add(ps, e - a);
  }
  return true;
}

// Mass mode (mass_eps > 0, candidates > 0): a per-row budget. Pages are scored exactly best bound
// first, ceil(topk / page) pages (a batch) at a time, up to the budget of ceil(candidates·topk) keys;
// the row stops after a batch that carried at most mass_eps of the softmax mass seen so far (the
// protected keys' included): a head whose weight sits on the sink and recent keys stops after one
// batch, one that spreads its weight reads on. It also stops, certified, when the bound says the
// unvisited keys together carry at most mass_eps of that mass. Every scored key is kept (its K row
// is read already; dropping it saves one V row). False when an exact score is NaN.
bool choose_mass_pages(const CallPlan& p, const float* q, const float* khead, size_t ldk, const MaskRow& m,
                       const KeyRange& r, const RowPages& pages, Scratch& s, RowChoice& choice) {
  const PopcountAttentionConfig& cfg = *p.config;
  const size_t topk = static_cast<size_t>(cfg.topk), page = pages.page, npg = pages.npg;
  const size_t batch = std::max<size_t>(1, (topk + page - 1) / page);
  const size_t budget = static_cast<size_t>(std::ceil(static_cast<double>(cfg.candidates) * topk));
  const size_t limit = std::min(npg, std::max(batch, (budget + page - 1) / page));
  const float* bound = pages.bound;
  int32_t* order = pages.order;
  std::partial_sort(order, order + limit, order + npg,
                    [&pages](int32_t a, int32_t b) { return pages.higher_bound_first(a, b); });
  MassSoFar mass;
  if (!protected_mass(p, q, khead, ldk, m, r, pages.mid_lo, pages.mid_hi, s, mass)) return false;
  int32_t* rows = s.kept.data();
  float* scores = s.sel.data();
  const size_t middle = pages.mid_hi - pages.mid_lo;
  size_t visited = 0, count = 0;
  choice.certified = false;
  while (visited < limit) {
    const float next = bound[order[visited]];
    if (next == kNegInf || (visited > 0 && mass.covers(middle - count, next, cfg.mass_eps))) {
      choice.certified = true;  // fully masked pages, or the bound covers the rest
      break;
    }
    const size_t end = std::min(limit, visited + batch), first_row = count;
    std::sort(order + visited, order + end);  // ascending keys within the batch: the kernel prefetches along
    for (size_t c = visited; c < end; ++c) {
      const auto [a, e] = pages.keys(static_cast<size_t>(order[c]));
      for (size_t j = a; j < e; ++j) rows[count++] = static_cast<int32_t>(j);
    }
    exact_scores(*p.kernels, p.score, q, p.call->dims.d, khead, ldk, m, 0, rows + first_row, count - first_row,
                 scores + first_row);
    for (size_t j = first_row; j < count; ++j) {
      if (std::isnan(scores[j])) return false;
      if (scores[j] < kMaskedOut) scores[j] = kNegInf;
    }
    const double carried = mass.add(scores + first_row, count - first_row);
    visited = end;
    if (carried <= static_cast<double>(cfg.mass_eps) * mass.sum) break;
  }
  if (!choice.certified) {  // stopped by the batch rule or the budget: does the bound cover the rest too?
    float rest = kNegInf;  // pages [visited, limit) are in descending bound order, the rest below them
    if (visited < limit) {
      rest = bound[order[visited]];
    } else {
      for (size_t t = limit; t < npg; ++t) rest = std::max(rest, bound[order[t]]);
    }
    choice.certified = mass.covers(middle - count, rest, cfg.mass_eps);
  }
  for (size_t j = 0; j < count; ++j) {
    if (scores[j] == kNegInf) continue;
    s.heap_scores[choice.kept] = scores[j];
    s.heap_rows[choice.kept++] = rows[j];
  }
  choice.visited_keys = count;
  choice.visited_pages = visited;
  return true;
}

// The pages selector on one query row: keys of [lo, hi) outside the protected first / recent ones
// are grouped in the cache's pages; a page's bound max_k(q·k) <= sum_d max(q_d·min_d, q_d·max_d)
// (+ rounding slack), mapped to score space (scale, soft-cap, the page's largest mask value: all
// monotone), orders the pages (ties: lower page first). The keys are chosen by the budget mode
// (candidates > 0: choose_budget_pages) or the certified one (candidates = 0: choose_certified_pages).
// Returns false (caller computes exact attention) when a page or q holds a non-finite value, a mask
// value of the range is NaN, or an exact score is NaN.
bool attend_row_pages(const CallPlan& p, size_t hk, const float* q, const float* khead, size_t ldk,
                      const float* vhead, size_t ldv, const KeyRange& r, const MaskRow& m, float sink, float* y,
                      Scratch& s, HeadMemory* record) {
  const PopcountAttentionConfig& cfg = *p.config;
  const size_t page = p.keys->page, n = r.hi - r.lo;
  const size_t first = std::min(n, static_cast<size_t>(cfg.keep_first));
  const size_t recent_begin = std::max(first, n - std::min(n, static_cast<size_t>(cfg.keep_recent)));
  const size_t mid_lo = r.lo + first, mid_hi = r.lo + recent_begin;
  s.reserve_pages(r.hi, p.call->dims.d, page);
  const size_t pg0 = mid_lo / page, pg1 = (mid_hi + page - 1) / page, npg = pg1 - pg0;
  if (!page_bounds(p, hk, q, m, mid_lo, mid_hi, s)) return false;
  const RowPages pages{mid_lo, mid_hi, page, pg0, npg, s.bounds.data(), s.page_order.data()};
  for (size_t t = 0; t < npg; ++t) pages.order[t] = static_cast<int32_t>(t);
  RowChoice choice;
  const bool chosen = cfg.mass_eps > 0.0f     ? choose_mass_pages(p, q, khead, ldk, m, r, pages, s, choice)
                      : cfg.candidates > 0.0f ? choose_budget_pages(p, hk, q, khead, ldk, m, pages, s, record, choice)
                                              : choose_certified_pages(p, q, khead, ldk, m, pages, s, choice);
  if (!chosen) return false;
  s.pages_total += npg;
  s.pages_visited += choice.visited_pages;
  ++s.rows_paged;
  s.rows_certified += choice.certified ? 1 : 0;
  finish_kept_row(p, q, khead, ldk, vhead, ldv, r, mid_lo, mid_hi, m, sink, y, s, choice.kept, choice.visited_keys);
  return true;
}

// Event-driven attention (head_reuse.h): a pages row (budget mode, no mask) that bounds only the
// pages `mem` chose at its reference step and the pages holding keys that arrived since (the page
// that was partly filled then included), and keeps the budget's best of those. When the
// certificate holds, every page the reference ranked and left out still bounds below every page it
// chose, so this is the choice the full ranking makes — as long as the row's range still holds
// enough of the chosen pages (`certified`: checked below). Returns kReuseDone, kReuseExact (a
// non-finite value: the caller computes exact attention, as attend_row_pages) or kReuseRank (the
// candidates cannot fill the budget, or a certified choice no longer covers the range: rank).
enum ReuseResult { kReuseDone, kReuseExact, kReuseRank };

ReuseResult attend_row_reused(const CallPlan& p, size_t hk, const float* q, const float* khead, size_t ldk,
                              const float* vhead, size_t ldv, const KeyRange& r, const MaskRow& m, float sink,
                              float* y, Scratch& s, const HeadMemory& mem, bool certified) {
  const PopcountAttentionConfig& cfg = *p.config;
  const kernels::KernelSet& ks = *p.kernels;
  const KeyCache& kc = *p.keys;
  const size_t d = p.call->dims.d, page = kc.page, n = r.hi - r.lo, topk = static_cast<size_t>(cfg.topk);
  const size_t first = std::min(n, static_cast<size_t>(cfg.keep_first));
  const size_t recent_begin = std::max(first, n - std::min(n, static_cast<size_t>(cfg.keep_recent)));
  const size_t mid_lo = r.lo + first, mid_hi = r.lo + recent_begin;
  s.reserve_pages(r.hi, d, page);
  const float q_abs = split_query(q, d, s.qsplit.data());  // as attend_row_pages: the same bounds, bit for bit
  if (!std::isfinite(q_abs)) return kReuseExact;
  const size_t pg0 = mid_lo / page, pg1 = (mid_hi + page - 1) / page, npg = pg1 - pg0;
  const size_t budget = static_cast<size_t>(std::ceil(static_cast<double>(cfg.candidates) * topk));
  size_t chosen = std::min(npg, (budget + page - 1) / page);
  // Candidates: the reference's chosen pages still in range, then every page from the one that
  // held key ranked_hi (ascending, no repeats: the chosen list is sorted).
  int32_t* cand = s.page_order.data();
  size_t count = 0;
  const size_t fresh_from = std::max(pg0, mem.ranked_hi / page);
  const size_t ranked_end = std::min(fresh_from, pg1);
  for (const int32_t pg : mem.pages)
    if (static_cast<size_t>(pg) >= pg0 && static_cast<size_t>(pg) < ranked_end) cand[count++] = pg;
  const size_t still_chosen = count;
  for (size_t pg = fresh_from; pg < pg1; ++pg) cand[count++] = static_cast<int32_t>(pg);
  if (count < chosen) return kReuseRank;
  // The certificate orders the pages the reference ranked, nothing else. The full ranking's choice
  // is still among the candidates only if the range starts no earlier than the ranked pages (a
  // rewound window: pages never ranked) and, when it holds ranked pages the reference left out,
  // still holds `chosen` of the pages it chose: a local window that moved past a chosen page lets
  // the best of the rest take its place, and the left-out pages, not bounded here, may be that.
  if (certified && (pg0 < mem.ranked_lo / page || (ranked_end - pg0 > still_chosen && still_chosen < chosen)))
    return kReuseRank;
  const float slack = bound_slack(d, q_abs);
  const ScoreParams& sp = p.score;
  float* bound = s.bounds.data();  // by candidate
  for (size_t c = 0; c < count; ++c) {
    const size_t pg = static_cast<size_t>(cand[c]);
    const float absmax = kc.head_page_absmax(hk)[pg];
    if (std::isnan(absmax)) return kReuseExact;
    ks.attention->dot_rows(s.qsplit.data(), kc.head_pages(hk) + pg * 2 * d, 2 * d, 2 * d, nullptr, 1, bound + c);
    bound[c] = score_space_bound(bound[c], absmax, slack, sp);
  }
  std::vector<uint32_t>& pos = s.select;  // candidate positions, best bound first (ties: lower page)
  if (pos.size() < count) pos.resize(count);
  for (size_t c = 0; c < count; ++c) pos[c] = static_cast<uint32_t>(c);
  std::nth_element(pos.begin(), pos.begin() + chosen, pos.begin() + count, [bound, cand](uint32_t a, uint32_t b) {
    return bound[a] > bound[b] || (bound[a] == bound[b] && cand[a] < cand[b]);
  });
  std::sort(pos.begin(), pos.begin() + chosen);  // candidates are ascending pages: so are these
  int32_t* rows = s.kept.data();
  size_t scored = 0;
  for (size_t c = 0; c < chosen; ++c) {
    const size_t pg = static_cast<size_t>(cand[pos[c]]);
    for (size_t j = std::max(mid_lo, pg * page); j < std::min(mid_hi, (pg + 1) * page); ++j)
      rows[scored++] = static_cast<int32_t>(j);
  }
  size_t kept = 0;
  float kth = kPosInf;
  if (!keep_best_keys(p, q, khead, ldk, m, rows, scored, s, kept, kth)) return kReuseExact;
  s.pages_total += npg;
  s.pages_visited += chosen;
  finish_kept_row(p, q, khead, ldk, vhead, ldv, r, mid_lo, mid_hi, m, sink, y, s, kept, scored);
  return kReuseDone;
}

// One query row as attend_row's paths read it.
struct QueryRow {
  size_t hk = 0;  // b·Hkv + the row's KV head: its key cache head
  const float* q = nullptr;
  const float* khead = nullptr;  // the KV head's K and V rows, row strides ldk, ldv
  const float* vhead = nullptr;
  size_t ldk = 0, ldv = 0;
  float* y = nullptr;
  KeyRange r;
  MaskRow m;
  float sink = kNegInf;  // the softmax's extra logit (-inf: none)
};

// Exact attention over the row's whole range.
void exact_row(const CallPlan& p, const QueryRow& row, Scratch& s) {
  const size_t n = row.r.hi - row.r.lo;
  exact_scores(*p.kernels, p.score, row.q, p.call->dims.d, row.khead, row.ldk, row.m, row.r.lo, nullptr, n,
               s.scores.data());
  softmax_pv(*p.kernels, s.scores.data(), row.vhead, row.ldv, p.call->dims.dv, row.r.lo, nullptr, n, row.y, row.sink);
  s.keys_exact += n;
}

// Relative L2 distance of output a from output y.
float relative_gap(const float* a, const float* y, size_t dv) {
  double diff = 0.0, norm = 0.0;
  for (size_t t = 0; t < dv; ++t) {
    diff += (static_cast<double>(a[t]) - y[t]) * (static_cast<double>(a[t]) - y[t]);
    norm += static_cast<double>(y[t]) * y[t];
  }
  return static_cast<float>(std::sqrt(diff / std::max(norm, 1e-30)));
}

// A pages row with more unprotected keys than topk: its head's previous page choice reused where
// event-driven attention planned it (mem: the head's memory, null without the plan), else ranked
// here; a ranked row that stands for a budget reuse (kRankChecked) also computes that reuse, for the
// gap check. False: the row is left to exact attention.
bool attend_row_by_pages(const CallPlan& p, size_t b, size_t h, const QueryRow& row, HeadMemory* mem, Scratch& s) {
  const HeadAction action = mem ? (*p.actions)[b * p.call->dims.h + h] : HeadAction::kRank;
  ReuseResult reused = kReuseRank;
  bool done = false;
  if (action == HeadAction::kReuseCertified || action == HeadAction::kReuseBudget) {
    const bool certified = action == HeadAction::kReuseCertified;
    reused = attend_row_reused(p, row.hk, row.q, row.khead, row.ldk, row.vhead, row.ldv, row.r, row.m, row.sink,
                               row.y, s, *mem, certified);
    done = reused == kReuseDone;
    if (done) ++mem->age;
    if (reused == kReuseRank) ++(certified ? s.certified_ranked : s.budget_ranked);
  }
  if (action == HeadAction::kRankChecked) {
    // The reuse the budget chose, beside the ranked row it stands for: their relative L2 gap.
    const size_t dv = p.call->dims.dv;
    if (s.check.size() < dv) s.check.resize(dv);
    reused = attend_row_reused(p, row.hk, row.q, row.khead, row.ldk, row.vhead, row.ldv, row.r, row.m, row.sink,
                               s.check.data(), s, *mem, false);
    done = attend_row_pages(p, row.hk, row.q, row.khead, row.ldk, row.vhead, row.ldv, row.r, row.m, row.sink, row.y,
                            s, mem);
    if (reused == kReuseDone && done) {
      const float gap = relative_gap(s.check.data(), row.y, dv);
      s.gap_max = std::isnan(gap) ? gap : std::max(s.gap_max, gap);
    }
  } else if (reused == kReuseRank) {
    done = attend_row_pages(p, row.hk, row.q, row.khead, row.ldk, row.vhead, row.ldv, row.r, row.m, row.sink, row.y,
                            s, mem);
  }
  return done;
}

// The popcount / energy selector on a row with more keys than topk: approximate scores of the
// range, the protected keys forced in, the best candidates (candidates · topk) refined exactly and,
// when oversampled, the topk best exact scores kept; topk = 0: softmax of the approximate scores.
void attend_row_selected(const CallPlan& p, const QueryRow& row, Scratch& s) {
  const PopcountAttentionConfig& cfg = *p.config;
  const kernels::KernelSet& ks = *p.kernels;
  const AttentionDims& dd = p.call->dims;
  const KeyRange& r = row.r;
  const size_t n = r.hi - r.lo, topk = static_cast<size_t>(cfg.topk);
  float* sel = s.sel.data();
  selector_scores(p, row.q, row.hk, r, s);
  if (p.score.softcap > 0.0f) {  // monotone: only the approximate path's softmax sees it
    const float inv = 1.0f / p.score.softcap;
    for (size_t j = 0; j < n; ++j) sel[j] = p.score.softcap * std::tanh(sel[j] * inv);
  }
  add_mask(row.m, r.lo, sel, n);
  // A NaN selector score (NaN in q, in a key or its bias, or in the centering mean) ranks above the
  // protected keys' +inf and says nothing about the exact score: the row is computed exactly, so
  // NaN reaches the output exactly where exact attention puts it.
  if (topk > 0 && std::any_of(sel, sel + n, [](float v) { return std::isnan(v); })) return exact_row(p, row, s);
  if (topk == 0) {  // pure approximate path: softmax of the approximate scores
    softmax_pv(ks, sel, row.vhead, row.ldv, dd.dv, r.lo, nullptr, n, row.y, row.sink);
    return;
  }
  // Exported models mask with a huge finite value (finfo.min): such keys are out of the selection
  // as -inf ones are (never candidates, never protected); refine still adds the mask as given.
  if (row.m.add)
    for (size_t j = 0; j < n; ++j) sel[j] = sel[j] < kMaskedOut ? kNegInf : sel[j];
  // Protected keys (the first keep_first, the last keep_recent of the range) are always kept:
  // +inf outranks every selector score. Masked-out keys stay out.
  const size_t first = std::min(n, static_cast<size_t>(cfg.keep_first));
  const size_t recent_begin = n - std::min(n, static_cast<size_t>(cfg.keep_recent));
  size_t allowed = n, forced = 0;
  if (row.m.any()) {
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
  if (allowed <= topk + forced) return exact_row(p, row, s);

  const size_t want = std::min<size_t>(
      allowed, forced + std::max<size_t>(topk, static_cast<size_t>(std::ceil(static_cast<double>(cfg.candidates) * topk))));
  int32_t* kept = s.kept.data();
  const size_t count = kernels::select_top_k(*ks.select, sel, n, want, kept, s.select);
  exact_scores(ks, p.score, row.q, dd.d, row.khead, row.ldk, row.m, r.lo, kept, count, s.scores.data());
  s.keys_exact += count;
  if (count <= topk + forced)
    return softmax_pv(ks, s.scores.data(), row.vhead, row.ldv, dd.dv, r.lo, kept, count, row.y, row.sink);

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
  softmax_pv(ks, fs, row.vhead, row.ldv, dd.dv, r.lo, fin, nf, row.y, row.sink);
}

// One query row: exact attention, or selection + exact refine of the kept keys.
void attend_row(const CallPlan& p, size_t b, size_t h, size_t i, Scratch& s) {
  const AttentionCall& c = *p.call;
  const AttentionDims& dd = c.dims;
  const PopcountAttentionConfig& cfg = *p.config;
  const size_t hkv = h / (dd.h / dd.hkv);
  QueryRow row;
  row.hk = b * dd.hkv + hkv;
  row.q = c.q + c.q_rows.at(b, h, i);
  row.khead = c.k + c.k_rows.at(b, hkv, 0);
  row.vhead = c.v + c.v_rows.at(b, hkv, 0);
  row.ldk = c.k_rows.pos;
  row.ldv = c.v_rows.pos;
  row.y = c.y + c.y_rows.at(b, h, i);
  row.r = key_range(p, b, i);
  row.m = mask_row(c.mask, b, h, i);
  row.sink = c.head_sink ? c.head_sink[h] : cfg.smooth_softmax ? 0.0f : kNegInf;
  const size_t n = row.r.hi - row.r.lo, topk = static_cast<size_t>(cfg.topk);
  s.keys_total += n;
  // Rows with few keys are exact: per row, so a prompt's rows select exactly as decode steps would.
  if (p.keys == nullptr || n == 0 || (topk > 0 && n <= topk) || n < static_cast<size_t>(cfg.min_keys))
    return exact_row(p, row, s);
  if (cfg.select != Selector::kPages) return attend_row_selected(p, row, s);
  const size_t protected_keys = std::min(n, static_cast<size_t>(cfg.keep_first) + static_cast<size_t>(cfg.keep_recent));
  HeadMemory* mem = p.reuse ? &p.reuse->memory(b, h) : nullptr;
  if (n - protected_keys > topk && attend_row_by_pages(p, b, h, row, mem, s)) return;
  if (mem) mem->valid = false;  // the head's choice is not this row's: the next step ranks
  exact_row(p, row, s);
}

// Exact attention for the query heads that share a KV head, together: within a call whose mask
// does not depend on the head, the G = H / Hkv queries of one (batch, kv head, position) have the
// same keys, so each K and V row is read once for all G instead of G times (at long contexts the
// step is bound by those reads). The keys of a group may be split into parts (tasks of their own,
// so a decode step with few groups still spreads over the threads); each part yields, per query,
// its max score m, sum of exp(s - m) and unnormalised output, merged as an online softmax.
constexpr size_t kChunkKeys = 128;   // K rows scored for every query of the group while in L1
constexpr size_t kMinPartKeys = 256; // below this a part is not worth a task

// One part [a, e) of group (b, hk, i): scores of the G queries, exp, weighted V rows.
void exact_group_part(const CallPlan& p, size_t b, size_t hk, size_t i, size_t a, size_t e, float* part_out,
                      double* part_sum, float* part_max, Scratch& s) {
  const AttentionCall& c = *p.call;
  const AttentionDims& dd = c.dims;
  const kernels::KernelSet& ks = *p.kernels;
  const size_t G = dd.h / dd.hkv, n = e - a;
  const float* khead = c.k + c.k_rows.at(b, hk, 0);
  const float* vhead = c.v + c.v_rows.at(b, hk, 0);
  const MaskRow m = mask_row(c.mask, b, hk * G, i);  // head-independent mask
  if (s.group_scores.size() < G * n) s.group_scores.resize(G * n);
  float* scores = s.group_scores.data();
  const size_t v_bytes = dd.dv * sizeof(float);
  for (size_t c0 = a; c0 < e; c0 += kChunkKeys) {
    const size_t cnt = std::min(kChunkKeys, e - c0);
    // The chunk's V rows start their way to L2 while its keys are scored (the weighted sum below
    // then streams them from cache instead of waiting on memory).
    for (size_t j = c0; j < c0 + cnt; ++j) {
      const char* row = reinterpret_cast<const char*>(vhead + j * c.v_rows.pos);
      for (size_t byte = 0; byte < v_bytes; byte += 64) __builtin_prefetch(row + byte, 0, 2);
    }
    for (size_t g = 0; g < G; ++g) {
      const float* q = c.q + c.q_rows.at(b, hk * G + g, i);
      exact_scores(ks, p.score, q, dd.d, khead, c.k_rows.pos, m, c0, nullptr, cnt, scores + g * n + (c0 - a));
    }
  }
  constexpr size_t T = kernels::kTokenTile;
  if (s.group_weights.size() < T * n) s.group_weights.resize(T * n);
  float* w = s.group_weights.data();
  for (size_t g0 = 0; g0 < G; g0 += T) {
    const size_t tile = std::min(T, G - g0);
    std::fill(w, w + T * n, 0.0f);
    for (size_t t = 0; t < tile; ++t) {
      const float* sg = scores + (g0 + t) * n;
      float mx = kNegInf;
      for (size_t j = 0; j < n; ++j) mx = std::max(mx, sg[j]);
      double sum = 0.0;
      // std::max skips NaN: scores all NaN or -inf with a NaN still make the output NaN (a NaN sum
      // with a finite max marks the part used in merge_parts).
      if (mx == kNegInf && std::any_of(sg, sg + n, [](float v) { return std::isnan(v); })) {
        mx = 0.0f;
        sum = std::numeric_limits<double>::quiet_NaN();
      }
      part_max[g0 + t] = mx;
      if (mx != kNegInf && !std::isnan(sum)) {
        float* e = scores + (g0 + t) * n;  // the scores become their exp(s - max), then interleave
        sum = ks.attention->exp_sub(sg, n, mx, e);
        for (size_t j = 0; j < n; ++j) w[j * T + t] = e[j];
      }
      part_sum[g0 + t] = sum;
    }
    // Unused tile slots carry weight 0; their outputs land in the scratch row past the group's.
    float y[T * 1024];
    float* ys = part_out + g0 * dd.dv;
    const bool direct = tile == T;
    float* dst = direct ? ys : (dd.dv <= 1024 ? y : nullptr);
    if (dst == nullptr) {  // dv > 1024 with a partial tile: one query at a time
      for (size_t t = 0; t < tile; ++t) {
        std::vector<float> col(n);
        for (size_t j = 0; j < n; ++j) col[j] = w[j * T + t];
        ks.matmul->gemv_rows(vhead + a * c.v_rows.pos, c.v_rows.pos, nullptr, col.data(), n, ys + t * dd.dv, dd.dv, false);
      }
      continue;
    }
    ks.matmul->gemm_rows(vhead + a * c.v_rows.pos, c.v_rows.pos, nullptr, w, n, dst, dd.dv, dd.dv, false);
    if (!direct) std::copy_n(y, tile * dd.dv, ys);
  }
}

// y = the softmax-weighted V rows of a query from its parts' max, sum of exp(s - max) and
// unnormalised output (part t at maxes[t·stat_stride], sums[t·stat_stride], outs[t·out_stride]),
// with the sink logit in the normaliser. No attendable key: y = 0.
void merge_parts(size_t parts, const float* maxes, const double* sums, size_t stat_stride, const float* outs,
                 size_t out_stride, size_t dv, float sink, float* y) {
  auto used = [&](size_t t) { return sums[t * stat_stride] > 0.0 || std::isnan(sums[t * stat_stride]); };
  float top = kNegInf;
  for (size_t t = 0; t < parts; ++t)
    if (used(t)) top = std::max(top, maxes[t * stat_stride]);
  if (top == kNegInf) {
    // Every score -inf (or no key): the keys' weights are 0, y = 0·V (the parts' outputs, computed
    // with zero weights; 0 for an empty part), so a NaN/Inf V entry gives NaN as in onnxruntime.
    std::fill(y, y + dv, !(sink < kPosInf) ? std::numeric_limits<float>::quiet_NaN() : 0.0f);  // NaN / +inf sink
    for (size_t t = 0; t < parts; ++t)
      for (size_t j = 0; j < dv; ++j) y[j] += outs[t * out_stride + j];
    return;
  }
  const double base = std::max(top, sink);
  double total = sink == kNegInf ? 0.0 : std::exp(static_cast<double>(sink) - base);
  double acc[1024];
  std::vector<double> big(dv > 1024 ? dv : 0);
  double* sum_v = dv > 1024 ? big.data() : acc;
  std::fill(sum_v, sum_v + dv, 0.0);
  for (size_t t = 0; t < parts; ++t) {
    if (!used(t)) continue;
    const double f = std::exp(static_cast<double>(maxes[t * stat_stride]) - base);
    total += sums[t * stat_stride] * f;
    const float* o = outs + t * out_stride;
    for (size_t j = 0; j < dv; ++j) sum_v[j] += o[j] * f;
  }
  const double inv = 1.0 / total;
  for (size_t j = 0; j < dv; ++j) y[j] = static_cast<float>(sum_v[j] * inv);
}

// onnxruntime's attention ops multiply the probabilities with every V row in [0, keys), those of keys
// a query does not attend (causal future, outside the local window) being 0: a NaN or Inf in such a
// row makes that output column NaN (0·Inf) for every query of the KV head. Exact attention reads only
// [lo, hi); this pass, for calls computed exactly, adds the rest so NaN propagates as there. Rows
// with no key in their range (Y = 0 by contract) are left alone.
void poison_unread_value_columns(const CallPlan& p, const TaskRunner& runner) {
  const AttentionCall& c = *p.call;
  const AttentionDims& dd = c.dims;
  if (!p.config->causal || dd.hkv == 0 || dd.h % dd.hkv != 0) return;  // without causal every query reads all
  const size_t G = dd.h / dd.hkv;
  runner.run(std::min<size_t>(dd.b * dd.hkv, 64), [&](size_t task) {
    const size_t n_pairs = dd.b * dd.hkv, tasks = std::min<size_t>(n_pairs, 64);
    std::vector<size_t> first, last;
    for (size_t pair = n_pairs * task / tasks; pair < n_pairs * (task + 1) / tasks; ++pair) {
      const size_t b = pair / dd.hkv, hv = pair % dd.hkv, keys = c.keys(b);
      bool partial = false;  // does some query of this entry leave rows of [0, keys) unread?
      for (size_t i = 0; i < dd.sq && !partial; ++i) {
        const KeyRange r = key_range(p, b, i);
        partial = r.lo < r.hi && (r.lo > 0 || r.hi < keys);
      }
      if (!partial) continue;
      first.assign(dd.dv, keys);
      last.assign(dd.dv, 0);
      bool bad = false;
      for (size_t j = 0; j < keys; ++j) {
        const float* row = c.v + c.v_rows.at(b, hv, j);
        // Exponent bits all set <=> NaN or Inf; an OR over integer compares vectorises (the pass
        // reads all of V, as onnxruntime's P·V does).
        const uint32_t* bits = reinterpret_cast<const uint32_t*>(row);
        uint32_t any = 0;
        for (size_t d = 0; d < dd.dv; ++d) any |= static_cast<uint32_t>((bits[d] & 0x7f800000u) == 0x7f800000u);
        if (!any) continue;
        for (size_t d = 0; d < dd.dv; ++d) {
          if (std::isfinite(row[d])) continue;
          first[d] = std::min(first[d], j);
          last[d] = j;
          bad = true;
        }
      }
      if (!bad) continue;
      for (size_t i = 0; i < dd.sq; ++i) {
        const KeyRange r = key_range(p, b, i);
        if (r.lo == r.hi) continue;
        for (size_t g = 0; g < G; ++g) {
          const size_t h = hv * G + g;
          float* y = c.y + c.y_rows.at(b, h, i);
          for (size_t d = 0; d < dd.dv; ++d)
            if (first[d] < r.lo || (first[d] < keys && last[d] >= r.hi)) y[d] = std::numeric_limits<float>::quiet_NaN();
        }
      }
    }
  });
}


// The scale of the call's scores: the attribute, else the caller's rounding of 1/sqrt(D), else
// 1/sqrt(D); and the soft-cap.
ScoreParams call_score(const PopcountAttentionConfig& config, size_t d, float scale) {
  ScoreParams score;
  score.scale = config.scale > 0.0f ? config.scale
                : scale > 0.0f      ? scale
                                    : static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  score.softcap = config.softcap;
  return score;
}

// A prompt's rows through the tiled kernel (tiled_prefill.h) with the call's selective prefill;
// tiled_rows (all 0 on entry) marks the rows it computed. True when nothing is left for the row
// path: every row computed and no V row non-finite (whose NaN reaches the columns of rows that do
// not attend its key, the pass after the row path, as in any exact call).
bool run_tiled_prompt(const CallPlan& p, const TaskRunner& runner, std::vector<char>& tiled_rows,
                      AttentionStats& stats) {
  const PopcountAttentionConfig& config = *p.config;
  TiledParams params{p.score.scale, p.score.softcap, config.causal, config.local_window, config.smooth_softmax};
  params.select = config.prefill_select;
  params.eps = config.prefill_eps;
  params.budget_tiles = static_cast<size_t>((config.prefill_budget + kernels::kFlashKeys - 1) / kernels::kFlashKeys);
  params.sink_keys = static_cast<size_t>(std::max<int64_t>(config.keep_first, 1));
  params.recent_keys = std::max(static_cast<size_t>(config.keep_recent), kernels::kFlashKeys);
  params.min_keys = static_cast<size_t>(config.min_keys);
  TiledStats tiled_stats;
  if (!tiled_attention(*p.call, *p.kernels, params, runner, tiled_rows, &tiled_stats)) return false;
  stats.keys_total = tiled_stats.keys_total;
  stats.keys_exact = tiled_stats.keys_total - tiled_stats.keys_skipped;
  stats.prefill_tiles = tiled_stats.tiles;
  stats.prefill_tiles_skipped = tiled_stats.tiles_skipped;
  return tiled_stats.rows_left == 0 && !tiled_stats.values_nonfinite;
}

// Grouped exact attention: items = groups x parts (exact_group_part) over n_tasks tasks, then
// each query row's parts merged (merge_parts). tiled_p: rows already computed (null: none).
void run_grouped(const CallPlan& plan, const TaskRunner& runner, size_t parts, size_t n_tasks, Scratch* scratch_p,
                 const char* tiled_p) {
  const AttentionDims& dims = plan.call->dims;
  const size_t G = dims.h / dims.hkv, groups = dims.b * dims.hkv * dims.sq, items = groups * parts;
  const CallPlan* pp = &plan;
  // Per (item, query of the group): the part's unnormalised output [dv], max and sum.
  const size_t dv = dims.dv;
  std::vector<float> outs(items * G * dv), maxes(items * G);
  std::vector<double> sums(items * G);
  float* outs_p = outs.data();
  float* maxes_p = maxes.data();
  double* sums_p = sums.data();
  runner.run(n_tasks, [=](size_t task) {
    const AttentionDims& dd = pp->call->dims;
    const size_t begin = items * task / n_tasks, end = items * (task + 1) / n_tasks;
    for (size_t item = begin; item < end; ++item) {
      const size_t group = item / parts, part = item % parts;
      const size_t b = group / (dd.hkv * dd.sq), hk = (group / dd.sq) % dd.hkv, i = group % dd.sq;
      const KeyRange r = key_range(*pp, b, i);
      const size_t n = r.hi - r.lo, a = r.lo + n * part / parts, e = r.lo + n * (part + 1) / parts;
      float* out = outs_p + item * G * dv;
      float* mx = maxes_p + item * G;
      double* sm = sums_p + item * G;
      size_t rows_left = G;
      if (tiled_p != nullptr)
        for (size_t g = 0; g < G; ++g) rows_left -= tiled_p[(b * dd.h + hk * G + g) * dd.sq + i];
      if (a == e || rows_left == 0) {
        std::fill(mx, mx + G, kNegInf);
        std::fill(sm, sm + G, 0.0);
      } else {
        exact_group_part(*pp, b, hk, i, a, e, out, sm, mx, scratch_p[task]);
      }
      if (part == 0) {
        scratch_p[task].keys_total += rows_left * n;
        scratch_p[task].keys_exact += rows_left * n;
      }
    }
  });
  runner.run(std::min<size_t>(groups * G, 64), [=](size_t task) {
    const AttentionCall& c = *pp->call;
    const AttentionDims& dd = c.dims;
    const size_t n_rows = groups * G, begin = n_rows * task / std::min<size_t>(n_rows, 64),
                 end = n_rows * (task + 1) / std::min<size_t>(n_rows, 64);
    for (size_t row = begin; row < end; ++row) {
      const size_t group = row / G, g = row % G;
      const size_t b = group / (dd.hkv * dd.sq), hk = (group / dd.sq) % dd.hkv, i = group % dd.sq;
      const size_t h = hk * G + g;
      if (tiled_p != nullptr && tiled_p[(b * dd.h + h) * dd.sq + i]) continue;
      const float sink = c.head_sink ? c.head_sink[h] : pp->config->smooth_softmax ? 0.0f : kNegInf;
      const size_t first = group * parts;
      merge_parts(parts, maxes_p + first * G + g, sums_p + first * G + g, G, outs_p + first * G * dv + g * dv,
                  G * dv, dv, sink, c.y + c.y_rows.at(b, h, i));
    }
  });
}

// Every query row on its own (attend_row), rows_total over n_tasks tasks. tiled_p: rows already
// computed (null: none).
void run_each_row(const CallPlan& plan, const TaskRunner& runner, size_t rows_total, size_t n_tasks,
                  Scratch* scratch_p, const char* tiled_p) {
  const CallPlan* pp = &plan;
  runner.run(n_tasks, [=](size_t task) {
    const AttentionDims& dd = pp->call->dims;
    const size_t begin = rows_total * task / n_tasks, end = rows_total * (task + 1) / n_tasks;
    for (size_t r = begin; r < end; ++r) {
      const size_t b = r / (dd.sq * dd.h), h = (r / dd.sq) % dd.h, i = r % dd.sq;
      if (tiled_p != nullptr && tiled_p[r]) continue;
      attend_row(*pp, b, h, i, scratch_p[task]);
    }
  });
}

// The tasks' counters into the call's stats (and event-driven attention's gap checks).
void add_task_stats(const CallPlan& plan, const Scratch* scratch, size_t n_tasks, AttentionStats& stats) {
  for (size_t t = 0; t < n_tasks; ++t) {
    stats.keys_total += scratch[t].keys_total;
    stats.keys_exact += scratch[t].keys_exact;
    stats.pages_total += scratch[t].pages_total;
    stats.pages_visited += scratch[t].pages_visited;
    stats.rows_paged += scratch[t].rows_paged;
    stats.rows_certified += scratch[t].rows_certified;
    stats.event.reused_certified -= scratch[t].certified_ranked;
    stats.event.reused_budget -= scratch[t].budget_ranked;
    stats.event.ranked += scratch[t].certified_ranked + scratch[t].budget_ranked;
    if (plan.reuse != nullptr && scratch[t].gap_max != -1.0f) plan.reuse->report_gap(scratch[t].gap_max, stats.event);
  }
}

// The row path: every query row the tiled prompt did not compute (tiled_p: its marks, null: no
// prompt) — with exact attention and a head-independent mask the query heads of a KV head
// together, else row by row; then the NaN of V rows no query read (exact calls); then the
// counters. scratch: the run's per-task buffers.
void run_row_path(const CallPlan& plan, const TaskRunner& runner, size_t max_keys, const char* tiled_p,
                  std::vector<Scratch>& scratch, AttentionStats& stats) {
  const AttentionCall& call = *plan.call;
  const AttentionDims& dims = call.dims;
  const size_t rows_total = dims.b * dims.h * dims.sq;
  const bool head_free_mask = (call.mask.keep == nullptr && call.mask.add == nullptr) || call.mask.stride[1] == 0;
  const bool grouped = plan.keys == nullptr && head_free_mask && dims.hkv > 0 && dims.h % dims.hkv == 0;
  const size_t groups = dims.b * dims.hkv * dims.sq;
  // Few groups (a decode step): split each group's keys in parts, so every thread has work.
  const size_t parts = !grouped || groups >= 16 ? 1
                       : std::max<size_t>(1, std::min((16 + groups - 1) / groups, max_keys / kMinPartKeys));
  const size_t items = grouped ? groups * parts : rows_total;
  const size_t n_tasks = std::min<size_t>(items, 64);
  if (scratch.size() < n_tasks) scratch.resize(n_tasks);
  const size_t packed_dim = plan.config->proj_bits > 0 ? static_cast<size_t>(plan.config->proj_bits) : dims.d;
  for (size_t t = 0; t < n_tasks; ++t) scratch[t].start_call(max_keys, packed_dim);
  if (grouped) {
    run_grouped(plan, runner, parts, n_tasks, scratch.data(), tiled_p);
  } else {
    run_each_row(plan, runner, rows_total, n_tasks, scratch.data(), tiled_p);
  }
  if (plan.keys == nullptr) poison_unread_value_columns(plan, runner);
  add_task_stats(plan, scratch.data(), n_tasks, stats);
}

using ScratchPool = std::vector<std::unique_ptr<void, void (*)(void*)>>;

// A run's per-task buffers from the engine's pool (one set per concurrent run; grown once, reused
// across calls), and back.
std::unique_ptr<std::vector<Scratch>> take_scratch(std::mutex& mutex, ScratchPool& pool) {
  std::unique_ptr<std::vector<Scratch>> scratch;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (!pool.empty()) {
      scratch.reset(static_cast<std::vector<Scratch>*>(pool.back().release()));
      pool.pop_back();
    }
  }
  if (!scratch) scratch = std::make_unique<std::vector<Scratch>>();
  return scratch;
}

void give_back_scratch(std::mutex& mutex, ScratchPool& pool, std::unique_ptr<std::vector<Scratch>> scratch) {
  std::lock_guard<std::mutex> lock(mutex);
  pool.emplace_back(scratch.release(), [](void* p) { delete static_cast<std::vector<Scratch>*>(p); });
}

}  // namespace

PopcountAttention::PopcountAttention(const PopcountAttentionConfig& config, const kernels::KernelSet& kernels)
    : config_(config), kernels_(&kernels), keys_(key_summary(config), config.cache_keys, config.verify_keys) {
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
  if (!(config.candidates >= 1.0f && config.candidates <= 1024.0f) &&
      !(config.select == Selector::kPages && config.candidates == 0.0f))
    fail("attribute candidates=", config.candidates, " must be in [1, 1024]",
         config.select == Selector::kPages ? " (or 0: no budget, certified top-k)" : "");
  if (!(config.softcap >= 0.0f) || !std::isfinite(config.softcap))
    fail("attribute softcap=", config.softcap, " must be a finite number >= 0 (0: none)");
  if (config.topk == 0 && (config.select == Selector::kEnergy || config.select == Selector::kPages))
    fail("attribute topk=0 (approximate scores, no refine) needs select='popcount'; select='",
         selector_name(config.select), "' has no approximate score");
  if (config.prefill_rows < 0) fail("attribute prefill_rows=", config.prefill_rows, " must be >= 0 (0: never tiled)");
  if (!(config.prefill_eps >= 0.0f && config.prefill_eps < 1.0f))
    fail("attribute prefill_eps=", config.prefill_eps, " must be in [0, 1) (the softmax mass a row may drop)");
  if (config.prefill_budget < 0)
    fail("attribute prefill_budget=", config.prefill_budget, " must be >= 0 (keys besides the first and recent ones)");
  if (!(config.mass_eps >= 0.0f && config.mass_eps < 1.0f))
    fail("attribute mass_eps=", config.mass_eps, " must be in [0, 1) (the softmax mass a batch of pages may carry)");
  if (config.mass_eps > 0.0f && (config.select != Selector::kPages || config.candidates == 0.0f || config.event.enabled))
    fail("attribute mass_eps=", config.mass_eps, " needs select='pages' with candidates > 0 (the budget) and event=0; got select='",
         selector_name(config.select), "', candidates=", config.candidates, ", event=", config.event.enabled ? 1 : 0);
  if (config.page_size < 1 || config.page_size > 4096)
    fail("attribute page_size=", config.page_size, " must be in [1, 4096]");
  if (!popcnt_path_supported(kernels.popcnt_path))
    fail("popcount path ", kernels::popcnt_path_name(kernels.popcnt_path), " is not supported by this CPU");
  if (!isa_supported(kernels.isa)) fail("ISA ", isa_name(kernels.isa), " is not supported by this CPU");
  if (config.event.enabled) reuse_ = std::make_unique<HeadReuse>(config.event);
}

AttentionStats PopcountAttention::run(const AttentionCall& call, const TaskRunner& runner,
                                      const KeyProvenance* provenance, float scale) const {
  AttentionStats stats;
  const AttentionDims& dims = call.dims;
  const size_t rows_total = dims.b * dims.h * dims.sq;
  if (rows_total == 0 || dims.dv == 0) return stats;
  // Scores of a 0-dim head are 0 · 1/sqrt(0): undefined, not "every key equal".
  if (dims.d == 0) fail("Q and K have head dim D = 0; attention needs D >= 1");
  size_t max_keys = 0;
  for (size_t b = 0; b < dims.b; ++b) max_keys = std::max(max_keys, call.keys(b));
  CallPlan plan{&call, &config_, kernels_, call_score(config_, dims.d, scale), nullptr};
  std::shared_ptr<const KeyCache> keys;  // the selector's key summaries, held for the call
  plan.keys = selector_keys(call, runner, provenance, max_keys, keys, stats);
  stats.packed = plan.keys != nullptr;
  // A prompt (a call of at least prefill_rows query rows) is computed exactly, every row, with the
  // tiled kernel: key selection is for decode steps, where one row reads the whole cache; a prompt
  // reads it once per query block and selecting row by row would cost more than it saves. The key
  // cache is still built (above), so the decode steps after the prompt can select. Selecting
  // prompts row by row (what teacher-forced quality measurement needs to see decode's numerics on
  // every row) is prefill_rows = 0.
  const bool prompt = config_.prefill_rows > 0 && dims.sq >= static_cast<size_t>(config_.prefill_rows);
  // Event-driven attention: a decode step of the budgeted page selector, without a mask, whose
  // caller says which key rows are unchanged. The lease is held for the call.
  const uint64_t call_number = reuse_ ? reuse_->call_number() : 0;
  HeadReuse::Lease lease;
  std::vector<HeadAction> actions;
  if (reuse_ && plan.keys != nullptr && !prompt && config_.select == Selector::kPages && config_.candidates > 0.0f &&
      dims.sq == 1 && call.mask.keep == nullptr && call.mask.add == nullptr) {
    lease = reuse_->lease();
    if (lease) {
      actions = plan_head_reuse(call, *keys, provenance, call_number, plan.score.scale, stats.event);
      plan.reuse = reuse_.get();
      plan.actions = &actions;
    }
  }
  std::vector<char> tiled_rows;  // a prompt's rows the tiled kernel computed, (b·H + h)·Sq + i
  if (prompt) {
    // The rows it leaves (they read a non-finite input) are computed exactly by the row path.
    plan.keys = nullptr;
    tiled_rows.assign(rows_total, 0);
    if (run_tiled_prompt(plan, runner, tiled_rows, stats)) return stats;
  }
  std::unique_ptr<std::vector<Scratch>> scratch = take_scratch(scratch_mutex_, scratch_pool_);
  run_row_path(plan, runner, max_keys, tiled_rows.empty() ? nullptr : tiled_rows.data(), *scratch, stats);
  give_back_scratch(scratch_mutex_, scratch_pool_, std::move(scratch));
  return stats;
}

// The selector's key summaries for the call (keys, held by the caller) and whether the selector
// runs: null when it does not — select = none, too few keys (the cache then only tracks K's rows,
// for the next call's reuse), or a binary / ternary packing denser than density_max.
const KeyCache* PopcountAttention::selector_keys(const AttentionCall& call, const TaskRunner& runner,
                                                 const KeyProvenance* provenance, size_t max_keys,
                                                 std::shared_ptr<const KeyCache>& keys, AttentionStats& stats) const {
  const bool select = config_.select != Selector::kNone && max_keys >= static_cast<size_t>(config_.min_keys) &&
                      max_keys > 0 && (config_.topk == 0 || max_keys > static_cast<size_t>(config_.topk));
  if (!select) {
    if (config_.select != Selector::kNone) keys_.track(call, provenance);
    return nullptr;
  }
  keys = keys_.prepare(call, *kernels_, runner, stats.keys_packed, provenance);
  if (config_.select != Selector::kPopcount) return keys.get();
  for (size_t hk = 0; hk < keys->heads; ++hk) {
    stats.bits_set += keys->bits_set[hk];
    stats.bits_total += static_cast<uint64_t>(keys->rows[hk]) * keys->packed_dim;
  }
  const double density = static_cast<double>(stats.bits_set) / static_cast<double>(stats.bits_total ? stats.bits_total : 1);
  // Sign packing is dense by construction (half the bits set); the sparsity check is for the
  // eps-thresholded modes.
  if (config_.mode != PackMode::kSign && density > config_.density_max) return nullptr;
  return keys.get();
}

// Event-driven attention's plan of a decode step (head_reuse.h): each (b, h)'s action. The rows
// left unchanged since the last call are what the key cache decided its reuse by: the caller's
// facts, or (no facts, or verify_keys: an app may rewrite rows in place) the row hashes.
std::vector<HeadAction> PopcountAttention::plan_head_reuse(const AttentionCall& call, const KeyCache& keys,
                                                           const KeyProvenance* provenance, uint64_t call_number,
                                                           float scale, HeadReuseStats& stats) const {
  const AttentionDims& dims = call.dims;
  const bool hashed = provenance == nullptr || config_.verify_keys;
  KeyProvenance by_hash;
  if (hashed) {
    by_hash.unchanged.assign(dims.b, std::numeric_limits<size_t>::max());
    for (size_t hk = 0; hk < keys.heads; ++hk)
      by_hash.unchanged[hk / dims.hkv] = std::min(by_hash.unchanged[hk / dims.hkv], keys.reused[hk]);
  }
  return reuse_->plan(call_number, dims.b, dims.h, dims.d, scale, hashed ? &by_hash : provenance,
                      [&call](size_t b, size_t h) { return call.q + call.q_rows.at(b, h, 0); }, stats);
}

}  // namespace ortsparse::attention
