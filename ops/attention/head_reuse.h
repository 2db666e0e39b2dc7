// Event-driven attention by heads, in decode: a query head whose query moved little since the step
// its pages were last chosen reuses that choice (plus the keys that arrived since) instead of
// bounding every page again. At long contexts choosing the keys is the expensive part of the page
// selector (a bound per page of the whole cache), not scoring the few chosen.
//
// Per (batch entry, query head) the memory holds the reference query q_ref of the last step that
// ranked the pages, the pages it chose and the margin `gap` between the worst chosen page's bound
// and the best unchosen one's. A page bound moves by at most scale · sum_d |Δq_d| · max|k| when
// the query moves by Δq, so with gap > 2 · scale · |q - q_ref|_1 · max|k| (+ rounding slack) every
// chosen page still outranks every unchosen one: the selector would choose the same pages of the
// keys it ranked then. Such a reuse is *certified* — while the query's range (a local window
// slides) still holds the chosen pages: once it moved past one, the full ranking may fill its place
// with a page ranked below it then, which a reuse does not bound, so the head ranks. Beyond the
// certificate a budget decides: of the heads the certificate does not cover, the fraction `topk`
// with the largest relative query change re-ranks its pages, the others reuse uncertified (which
// fills a dropped page's place from the fresh pages). A head re-ranks after `age_max`
// reuses in a row (staleness). Every `gap_every` steps the uncertified reuses are also computed
// fresh and compared; a relative L2 gap above `gap_tol` disables reuse for the kernel's life.
// See docs/ops.md#event-driven-attention.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <atomic>
#include <mutex>
#include <vector>

#include "attention/key_cache.h"

namespace ortsparse::attention {

struct HeadReuseConfig {
  bool enabled = false;
  float topk = 1.0f;       // of the heads not certified, the fraction re-ranked (1: certified reuse only)
  int64_t age_max = 8;     // a head re-ranks after at most this many reuses in a row
  int64_t gap_every = 64;  // every N decode steps the uncertified reuses are checked (0: never)
  float gap_tol = 0.03f;   // relative L2 gap of a checked head's output that disables reuse
};

void validate(const HeadReuseConfig& config);  // throws Error naming the attribute

enum class HeadAction : uint8_t {
  kRank,            // rank the pages (and remember the choice)
  kReuseCertified,  // reuse: the certificate holds
  kReuseBudget,     // reuse beyond the certificate (the budget)
  kRankChecked,     // gap check: the reuse is computed too, then the head ranks
};

// What one (batch entry, query head) remembers from the step that last ranked its pages.
struct HeadMemory {
  bool valid = false;
  std::vector<float> q_ref;
  std::vector<int32_t> pages;  // chosen pages (absolute page indices in the head's keys)
  float gap = 0.0f;            // worst chosen page bound - best unchosen one (score space)
  float absmax = 0.0f;         // max |k| over the pages ranked then
  size_t ranked_lo = 0;        // the pages of keys [ranked_lo, ranked_hi) were ranked; later keys
  size_t ranked_hi = 0;        // are always scored
  uint32_t age = 0;            // reuses since
};

struct HeadReuseStats {
  uint64_t ranked = 0, reused_certified = 0, reused_budget = 0, gap_checks = 0, disables = 0;
};

// The memories of one op instance across its calls, and the per-call decision.
class HeadReuse {
 public:
  explicit HeadReuse(const HeadReuseConfig& config) : config_(config) { validate(config); }
  const HeadReuseConfig& config() const { return config_; }

  // A call of the op holding the memory (try_lock: a concurrent call runs without reuse).
  struct Lease {
    std::unique_lock<std::mutex> lock;
    explicit operator bool() const { return lock.owns_lock(); }
  };
  Lease lease() { return Lease{std::unique_lock<std::mutex>(mutex_, std::try_to_lock)}; }

  // Every call of the op takes a number first; a memory is only trusted by the call right after
  // the one that wrote it (a prompt, or any call that did not plan, breaks the chain).
  uint64_t call_number() { return calls_.fetch_add(1); }

  // Plans one decode step (call `call`) of `heads_per_entry` query heads per batch entry, head dim
  // d: forgets the memories whose ranked keys are not known unchanged (provenance: the same K
  // buffer as the previous call's, its leading rows unchanged), then decides an action per head
  // (b-major) from the queries q_row(b, h). scale: the score scale.
  template <typename QueryRow>
  std::vector<HeadAction> plan(uint64_t call, size_t batch, size_t heads_per_entry, size_t d, float scale,
                               const KeyProvenance* provenance, QueryRow&& q_row, HeadReuseStats& stats);

  HeadMemory& memory(size_t b, size_t h) { return memories_[b * heads_per_entry_ + h]; }

  // After a call: a checked head's gap (relative L2 between its reused and ranked outputs).
  void report_gap(float gap, HeadReuseStats& stats);
  bool disabled() const { return disabled_; }

 private:
  HeadReuseConfig config_;
  std::mutex mutex_;
  std::vector<HeadMemory> memories_;
  std::atomic<uint64_t> calls_{0};
  uint64_t last_planned_ = ~uint64_t{0};
  const void* last_buffer_ = nullptr;  // the K buffer of the last planned call, and its rows
  size_t last_rows_ = 0;
  size_t heads_per_entry_ = 0, d_ = 0;
  uint64_t steps_ = 0;
  bool disabled_ = false;
};

// Certificate: with the query moved by |Δq|_1 = delta_l1 from the reference, every page bound
// moves by at most scale · delta_l1 · absmax; margin `gap` keeps the choice when it exceeds twice
// that, with room for the bounds' own rounding (q_l1: |q|_1 + |q_ref|_1).
bool reuse_certified(const HeadMemory& m, float delta_l1, float q_l1, size_t d, float scale);

template <typename QueryRow>
std::vector<HeadAction> HeadReuse::plan(uint64_t call, size_t batch, size_t heads_per_entry, size_t d, float scale,
                                        const KeyProvenance* provenance, QueryRow&& q_row, HeadReuseStats& stats) {
  if (heads_per_entry != heads_per_entry_ || d != d_ || memories_.size() != batch * heads_per_entry) {
    memories_.assign(batch * heads_per_entry, HeadMemory{});
    heads_per_entry_ = heads_per_entry;
    d_ = d;
  }
  const bool chained = call == last_planned_ + 1 && provenance != nullptr && provenance->previous == last_buffer_ &&
                       provenance->previous_rows == last_rows_ && provenance->unchanged.size() >= batch;
  last_planned_ = call;
  last_buffer_ = provenance ? provenance->current : nullptr;
  last_rows_ = provenance ? provenance->current_rows : 0;
  std::vector<HeadAction> actions(batch * heads_per_entry, HeadAction::kRank);
  if (disabled_) {
    stats.ranked += actions.size();
    return actions;
  }
  ++steps_;
  const bool check = config_.gap_every > 0 && steps_ % static_cast<uint64_t>(config_.gap_every) == 0;
  struct Candidate {
    float change;
    size_t index;
  };
  std::vector<Candidate> budget;
  for (size_t b = 0; b < batch; ++b) {
    for (size_t h = 0; h < heads_per_entry; ++h) {
      const size_t index = b * heads_per_entry + h;
      HeadMemory& m = memories_[index];
      if (!chained || m.ranked_hi > provenance->unchanged[b]) m.valid = false;
      if (!m.valid || m.age >= static_cast<uint64_t>(config_.age_max)) continue;
      const float* q = q_row(b, h);
      float delta = 0.0f, q_l1 = 0.0f, ref_l1 = 0.0f;
      for (size_t i = 0; i < d; ++i) {
        delta += std::abs(q[i] - m.q_ref[i]);
        q_l1 += std::abs(q[i]);
        ref_l1 += std::abs(m.q_ref[i]);
      }
      if (reuse_certified(m, delta, q_l1 + ref_l1, d, scale)) {
        actions[index] = HeadAction::kReuseCertified;
      } else {
        budget.push_back({ref_l1 > 0.0f ? delta / ref_l1 : delta, index});
      }
    }
  }
  // Of the uncovered heads, the `topk` fraction that moved most ranks; the rest reuse.
  const size_t rank = static_cast<size_t>(std::ceil(static_cast<double>(config_.topk) * budget.size()));
  std::sort(budget.begin(), budget.end(), [](const Candidate& a, const Candidate& b) {
    return a.change > b.change || (a.change == b.change && a.index < b.index);
  });
  for (size_t t = rank; t < budget.size(); ++t)
    actions[budget[t].index] = check ? HeadAction::kRankChecked : HeadAction::kReuseBudget;
  for (const HeadAction a : actions) {
    stats.ranked += a == HeadAction::kRank || a == HeadAction::kRankChecked;
    stats.reused_certified += a == HeadAction::kReuseCertified;
    stats.reused_budget += a == HeadAction::kReuseBudget;
    stats.gap_checks += a == HeadAction::kRankChecked;
  }
  return actions;
}

}  // namespace ortsparse::attention
