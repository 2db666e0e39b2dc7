#include "engine/kwta_gate.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "common/error.h"
#include "common/named_values.h"
#include "kernels/order_key.h"
#include "kernels/top_k.h"

namespace ortsparse::engine {

KwtaScore parse_kwta_score(const std::string& name) {
  static constexpr Named<KwtaScore> kNames[] = {
      {"l2", KwtaScore::kL2}, {"mean_abs", KwtaScore::kMeanAbs}, {"l2_weighted", KwtaScore::kL2Weighted}};
  return parse_named("score", name, kNames);
}

DutyMode parse_duty_mode(const std::string& name) {
  static constexpr Named<DutyMode> kNames[] = {{"dense", DutyMode::kDense}, {"hold", DutyMode::kHold}};
  return parse_named("duty_mode", name, kNames);
}

namespace {

// Per-thread buffers of the gate, kept across calls so a decode step allocates nothing.
struct GateScratch {
  std::vector<float> keys;
  std::vector<int32_t> kept;
  std::vector<uint32_t> select;
};

GateScratch& gate_scratch(size_t blocks) {
  thread_local GateScratch scratch;
  if (scratch.keys.size() < blocks) {
    scratch.keys.resize(blocks);
    scratch.kept.resize(blocks + kernels::kIndexSlack);
  }
  return scratch;
}

}  // namespace

KwtaGate::KwtaGate(BlockPartition partition, KwtaConfig config, std::vector<float> block_weight_norms)
    : RowGate(partition), config_(config) {
  const size_t nb = partition_.num_blocks;
  if (config_.score == KwtaScore::kL2Weighted) {
    if (block_weight_norms.size() != nb) fail("l2_weighted needs one weight norm per block");
    weight_norms_sq_.resize(nb);
    for (size_t b = 0; b < nb; ++b) weight_norms_sq_[b] = block_weight_norms[b] * block_weight_norms[b];
  }
  if (config_.score == KwtaScore::kMeanAbs && partition_.block > 1) {
    inv_block_len_.resize(nb);
    for (size_t b = 0; b < nb; ++b)
      inv_block_len_[b] = 1.0f / static_cast<float>(partition_.end(b) - partition_.begin(b));
  }
  if (config_.k_abs > 0) {
    keep_count_ = (static_cast<size_t>(config_.k_abs) + partition_.block - 1) / partition_.block;
  } else {
    // k_frac arrives as float32 (0.1f * 100 = 10.0000001): a relative slack keeps it at 10.
    keep_count_ = static_cast<size_t>(std::ceil(config_.k_frac * static_cast<double>(nb) * (1.0 - 1e-6)));
  }
  keep_count_ = std::max<size_t>(1, std::min(keep_count_, nb));
  threshold_key_ = config_.threshold * config_.threshold;  // squared keys (l2, l2_weighted)
}

bool KwtaGate::block_keys(const float* x, const kernels::KernelSet& kernels, float* keys) const {
  const size_t nb = partition_.num_blocks;
  bool squared = config_.score != KwtaScore::kMeanAbs;
  if (squared) {
    kernels.matmul->block_sumsq(x, partition_.k, partition_.block, keys);  // squared l2: same order, no sqrt
    if (config_.score == KwtaScore::kL2Weighted)
      for (size_t b = 0; b < nb; ++b) keys[b] *= weight_norms_sq_[b];
  } else {
    kernels.matmul->block_sumabs(x, partition_.k, partition_.block, keys);
    if (!inv_block_len_.empty())
      for (size_t b = 0; b < nb; ++b) keys[b] *= inv_block_len_[b];
  }
  bool overflow = false;
  for (size_t b = 0; b < nb; ++b) overflow |= keys[b] == std::numeric_limits<float>::infinity();
  if (!overflow) return squared;
  // A float sum overflowed (|x| above ~1.8e19 for l2): then overflowed blocks would all tie at +inf
  // and the lower index would win over the larger one. Recompute this token's scores themselves
  // (not squared) in double; they fit a float unless the input itself is infinite.
  const double* norms_sq = nullptr;
  std::vector<double> weighted;
  if (config_.score == KwtaScore::kL2Weighted) {
    weighted.assign(weight_norms_sq_.begin(), weight_norms_sq_.end());
    norms_sq = weighted.data();
  }
  for (size_t b = 0; b < nb; ++b) {
    double sum = 0.0;
    for (size_t r = partition_.begin(b); r < partition_.end(b); ++r) {
      const double v = x[r];
      sum += config_.score == KwtaScore::kMeanAbs ? std::fabs(v) : v * v;
    }
    double score;
    if (config_.score == KwtaScore::kMeanAbs) {
      score = sum / static_cast<double>(partition_.end(b) - partition_.begin(b));
    } else {
      score = std::sqrt(norms_sq ? sum * norms_sq[b] : sum);
    }
    keys[b] = static_cast<float>(score);
  }
  return false;
}

float KwtaGate::score_from_key(float key, bool squared) const { return squared ? std::sqrt(key) : key; }

size_t KwtaGate::select(const kernels::KernelSet& kernels, const float* keys, bool squared, int32_t* kept,
                        std::vector<uint32_t>& scratch) const {
  const size_t nb = partition_.num_blocks;
  if (config_.threshold > 0.0f) {
    // Blocks whose key reaches the threshold (NaN is kept: its order key is the highest), on order
    // keys with the SIMD select kernels: a branch per block mispredicts on a quarter of them.
    const float limit = squared ? threshold_key_ : config_.threshold;
    if (scratch.size() < nb) scratch.resize(nb);
    uint32_t lo = 0, hi = 0;
    kernels.select->order_keys(keys, nb, scratch.data(), &lo, &hi);
    const size_t count = kernels.select->indices_in_range(scratch.data(), nb, kernels::order_key(limit), 0xFFFFFFFFu, kept);
    if (count <= keep_count_) return count;
  }
  return kernels::select_top_k(*kernels.select, keys, nb, keep_count_, kept, scratch);
}

GateStats KwtaGate::plan(const float* x, size_t m, bool dense, const kernels::KernelSet& kernels, GatedRows& out) {
  const uint64_t step = step_.fetch_add(1, std::memory_order_relaxed);
  const uint64_t duty = static_cast<uint64_t>(config_.duty);
  const bool on_duty = step % duty == 0;
  out.clear();
  GateStats stats;
  stats.blocks_total = static_cast<uint64_t>(m) * partition_.num_blocks;
  if (config_.duty_mode == DutyMode::kHold && duty > 1 && !dense) return plan_hold(x, m, kernels, out, on_duty);
  if (!on_duty || dense) {
    for (size_t t = 0; t < m; ++t) out.add_dense_token();
    stats.blocks_kept = stats.blocks_total;
    return stats;
  }
  stats.gated = true;
  const size_t nb = partition_.num_blocks;
  if (keep_count_ == nb && config_.threshold <= 0.0f) {  // keeps everything: no scoring needed
    for (size_t t = 0; t < m; ++t) out.add_dense_token();
    stats.blocks_kept = stats.blocks_total;
    return stats;
  }
  GateScratch& scratch = gate_scratch(nb);
  float* keys = scratch.keys.data();
  int32_t* kept = scratch.kept.data();
  for (size_t t = 0; t < m; ++t) {
    const bool squared = block_keys(x + t * partition_.k, kernels, keys);
    const size_t count = select(kernels, keys, squared, kept, scratch.select);
    const float scale = config_.renorm && count > 0 ? static_cast<float>(nb) / static_cast<float>(count) : 1.0f;
    out.add_token_blocks(partition_, kept, count, scale);
    stats.blocks_kept += count;
  }
  return stats;
}

// hold: p = softmax(score / temp) is summed over the calls since the last recompute; every
// duty-th call the mask becomes the top-K blocks of the mean p over that window (the threshold,
// if set, limits the candidates to blocks whose score on this call reaches it); in between, each
// token position reuses its held mask. temp shapes how strongly a brief spike moves the mean.
// The sums are kept as log-sum-exp in double, so neither a tiny temp nor a huge score overflows;
// where mean p still ties (p of all but the top block underflowing), the call's score decides.
// A block with a NaN score has NaN mean p and ranks highest (it is kept and the NaN reaches the
// output).
GateStats KwtaGate::plan_hold(const float* x, size_t m, const kernels::KernelSet& kernels, GatedRows& out,
                              bool recompute) {
  const size_t nb = partition_.num_blocks;
  GateStats stats;
  stats.blocks_total = static_cast<uint64_t>(m) * nb;
  stats.gated = recompute;
  constexpr double kNegInfD = -std::numeric_limits<double>::infinity();
  std::vector<float> keys(nb);
  std::vector<double> log_p(nb), rank(nb), score(nb);
  std::vector<int32_t> kept(nb + kernels::kIndexSlack);
  const double inv_temp = 1.0 / static_cast<double>(config_.temp);
  std::lock_guard<std::mutex> lock(hold_mutex_);
  if (held_blocks_.size() < m) {
    held_blocks_.resize(m);
    log_p_sum_.resize(m, std::vector<double>(nb, kNegInfD));
  }
  for (size_t t = 0; t < m; ++t) {
    const bool squared = block_keys(x + t * partition_.k, kernels, keys.data());
    // log p_b = s_b - logsumexp(s), s = score / temp, over the finite scores; +inf scores share p = 1.
    double top = kNegInfD;
    size_t infinite = 0;
    for (size_t b = 0; b < nb; ++b) {
      score[b] = static_cast<double>(score_from_key(keys[b], squared));
      log_p[b] = score[b] * inv_temp;
      if (std::isinf(log_p[b]) && log_p[b] > 0) ++infinite;
      if (std::isfinite(log_p[b])) top = std::max(top, log_p[b]);
    }
    if (infinite > 0) {
      const double share = -std::log(static_cast<double>(infinite));
      for (size_t b = 0; b < nb; ++b)
        if (!std::isnan(log_p[b])) log_p[b] = std::isinf(log_p[b]) && log_p[b] > 0 ? share : kNegInfD;
    } else {
      double total = 0.0;
      for (size_t b = 0; b < nb; ++b)
        if (std::isfinite(log_p[b])) total += std::exp(log_p[b] - top);
      const double lse = top + std::log(total);
      for (size_t b = 0; b < nb; ++b) log_p[b] -= lse;
    }
    std::vector<double>& sum = log_p_sum_[t];
    for (size_t b = 0; b < nb; ++b) {  // log(exp(sum) + exp(log_p)), NaN sticks
      const double a = sum[b], c = log_p[b];
      if (std::isnan(a) || std::isnan(c)) {
        sum[b] = std::numeric_limits<double>::quiet_NaN();
      } else if (a != kNegInfD || c != kNegInfD) {
        const double hi = std::max(a, c);
        sum[b] = hi + std::log1p(std::exp(std::min(a, c) - hi));
      }
    }
    const bool fresh = held_blocks_[t].empty();
    if (recompute || fresh) {
      size_t limit = keep_count_;
      for (size_t b = 0; b < nb; ++b) rank[b] = sum[b];
      if (config_.threshold > 0.0f) {
        size_t candidates = 0;
        for (size_t b = 0; b < nb; ++b) {
          if (score_from_key(keys[b], squared) < config_.threshold) {
            rank[b] = kNegInfD;
          } else {
            ++candidates;  // NaN scores stay candidates
          }
        }
        limit = std::min(limit, candidates);
      }
      // Equal mean p (e.g. every block but one underflowing at a tiny temp): the larger score of
      // this call decides, then the lower index.
      const size_t count = kernels::select_top_k(rank.data(), score.data(), nb, limit, kept.data());
      held_blocks_[t].assign(kept.begin(), kept.begin() + count);
      if (held_blocks_[t].empty()) held_blocks_[t].push_back(-1);  // "held, nothing kept"
      std::fill(sum.begin(), sum.end(), kNegInfD);
    }
    const std::vector<int32_t>& held = held_blocks_[t];
    const size_t count = held.size() == 1 && held[0] < 0 ? 0 : held.size();
    const float scale = config_.renorm && count > 0 ? static_cast<float>(nb) / static_cast<float>(count) : 1.0f;
    out.add_token_blocks(partition_, held.data(), count, scale);
    stats.blocks_kept += count;
  }
  return stats;
}

}  // namespace ortsparse::engine
