#include "engine/kwta_gate.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "common/error.h"

namespace ortsparse::engine {

KwtaScore parse_kwta_score(const std::string& name) {
  if (name == "l2") return KwtaScore::kL2;
  if (name == "mean_abs") return KwtaScore::kMeanAbs;
  if (name == "l2_weighted") return KwtaScore::kL2Weighted;
  fail("attribute score='", name, "' is not one of l2, mean_abs, l2_weighted");
}

DutyMode parse_duty_mode(const std::string& name) {
  if (name == "dense") return DutyMode::kDense;
  if (name == "hold") return DutyMode::kHold;
  fail("attribute duty_mode='", name, "' is not one of dense, hold");
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
    scratch.kept.resize(blocks + kIndexSlack);
  }
  return scratch;
}

}  // namespace

size_t select_top_k(const KernelTable& kernels, const float* values, size_t n, size_t k, int32_t* kept,
                    std::vector<uint32_t>& scratch) {
  if (k >= n) {
    for (size_t i = 0; i < n; ++i) kept[i] = static_cast<int32_t>(i);
    return n;
  }
  if (k == 0) return 0;
  constexpr size_t kFew = 64;
  if (scratch.size() < 2 * n + kIndexSlack) scratch.resize(2 * n + kIndexSlack);
  uint32_t* keys = scratch.data();
  uint32_t min_key = 0, max_key = 0;
  kernels.order_keys(values, n, keys, &min_key, &max_key);
  // Narrow [lo, hi) around the k-th largest key with vectorised counting passes: count(>= lo) >= k
  // > count(>= hi). A step interpolates the count linearly in key space (keys of floats are close
  // to log-scale, where score distributions are smooth); a step that did not at least halve the
  // candidates is followed by a bisection, so any input converges in a bounded number of passes.
  uint64_t lo = min_key, hi = uint64_t{max_key} + 1;
  size_t count_lo = n, count_hi = 0;
  bool bisect = false;
  while (count_lo - count_hi > kFew && hi - lo > 1) {
    uint64_t mid;
    if (bisect) {
      mid = lo + (hi - lo) / 2;
    } else {
      const double above = static_cast<double>(count_lo - k) + 0.5;
      const double fraction = above / static_cast<double>(count_lo - count_hi);
      mid = lo + static_cast<uint64_t>(fraction * static_cast<double>(hi - lo));
    }
    mid = std::min(std::max(mid, lo + 1), hi - 1);
    const size_t before = count_lo - count_hi;
    const size_t count = kernels.count_at_least(keys, n, static_cast<uint32_t>(mid));
    if (count == k) return kernels.indices_in_range(keys, n, static_cast<uint32_t>(mid), 0xFFFFFFFFu, kept);
    if (count > k) {
      lo = mid;
      count_lo = count;
    } else {
      hi = mid;
      count_hi = count;
    }
    bisect = !bisect && 2 * (count_lo - count_hi) > before;
  }
  // The k-th largest key tau is among the few keys in [lo, hi): every key >= hi is kept, plus the
  // k - count_hi largest of them.
  const size_t take = k - count_hi;
  uint32_t tau = static_cast<uint32_t>(lo);  // when [lo, hi) is one key value, many equal keys
  if (count_lo - count_hi <= kFew) {
    int32_t* few_index = reinterpret_cast<int32_t*>(keys + n);
    const size_t n_few =
        kernels.indices_in_range(keys, n, static_cast<uint32_t>(lo), static_cast<uint32_t>(hi - 1), few_index);
    uint32_t few[kFew];
    for (size_t i = 0; i < n_few; ++i) few[i] = keys[few_index[i]];
    std::nth_element(few, few + (take - 1), few + n_few, std::greater<uint32_t>());
    tau = few[take - 1];
  }
  if (kernels.count_at_least(keys, n, tau) == k) return kernels.indices_in_range(keys, n, tau, 0xFFFFFFFFu, kept);
  // Several keys equal tau and only some fit: all keys above tau, then the lowest-index equal ones.
  const size_t greater = tau == 0xFFFFFFFFu ? 0 : kernels.count_at_least(keys, n, tau + 1);
  size_t equal_left = k - greater;
  size_t out = 0;
  for (size_t i = 0; i < n; ++i) {
    if (keys[i] > tau || (keys[i] == tau && equal_left > 0)) {
      if (keys[i] == tau) --equal_left;
      kept[out++] = static_cast<int32_t>(i);
    }
  }
  return out;
}

KwtaGate::KwtaGate(BlockPartition partition, KwtaConfig config, std::vector<float> block_weight_norms)
    : partition_(partition), config_(config) {
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
  threshold_key_ = config_.score == KwtaScore::kMeanAbs ? config_.threshold : config_.threshold * config_.threshold;
}

void KwtaGate::block_keys(const float* x, const KernelTable& kernels, float* keys) const {
  const size_t nb = partition_.num_blocks;
  if (config_.score == KwtaScore::kMeanAbs) {
    kernels.block_sumabs(x, partition_.k, partition_.block, keys);
    if (!inv_block_len_.empty())
      for (size_t b = 0; b < nb; ++b) keys[b] *= inv_block_len_[b];
    return;
  }
  kernels.block_sumsq(x, partition_.k, partition_.block, keys);  // squared l2: same order, no sqrt
  if (config_.score == KwtaScore::kL2Weighted)
    for (size_t b = 0; b < nb; ++b) keys[b] *= weight_norms_sq_[b];
}

float KwtaGate::score_from_key(float key) const {
  return config_.score == KwtaScore::kMeanAbs ? key : std::sqrt(key);
}

size_t KwtaGate::select(const KernelTable& kernels, const float* keys, int32_t* kept,
                        std::vector<uint32_t>& scratch) const {
  const size_t nb = partition_.num_blocks;
  if (config_.threshold > 0.0f) {
    size_t count = 0;
    for (size_t b = 0; b < nb; ++b)
      if (!(keys[b] < threshold_key_)) kept[count++] = static_cast<int32_t>(b);  // NaN is kept
    if (count <= keep_count_) return count;
  }
  return select_top_k(kernels, keys, nb, keep_count_, kept, scratch);
}

KwtaStats KwtaGate::plan(const float* x, size_t m, const KernelTable& kernels, GatedRows& out) {
  const uint64_t step = step_.fetch_add(1, std::memory_order_relaxed);
  const uint64_t duty = static_cast<uint64_t>(config_.duty);
  const bool on_duty = step % duty == 0;
  out.clear();
  KwtaStats stats;
  stats.blocks_total = static_cast<uint64_t>(m) * partition_.num_blocks;
  const bool too_many_rows = config_.max_gated_rows > 0 && m > static_cast<size_t>(config_.max_gated_rows);
  if (config_.duty_mode == DutyMode::kHold && duty > 1 && !too_many_rows) return plan_hold(x, m, kernels, out, on_duty);
  if (!on_duty || too_many_rows) {
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
    block_keys(x + t * partition_.k, kernels, keys);
    const size_t count = select(kernels, keys, kept, scratch.select);
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
KwtaStats KwtaGate::plan_hold(const float* x, size_t m, const KernelTable& kernels, GatedRows& out,
                              bool recompute) {
  const size_t nb = partition_.num_blocks;
  KwtaStats stats;
  stats.blocks_total = static_cast<uint64_t>(m) * nb;
  stats.gated = recompute;
  std::vector<float> keys(nb), p(nb);
  std::vector<int32_t> kept(nb + kIndexSlack);
  std::vector<uint32_t> scratch;
  const float inv_temp = 1.0f / config_.temp;
  std::lock_guard<std::mutex> lock(hold_mutex_);
  if (held_blocks_.size() < m) {
    held_blocks_.resize(m);
    p_sum_.resize(m, std::vector<float>(nb, 0.0f));
    p_count_.resize(m, 0);
  }
  for (size_t t = 0; t < m; ++t) {
    block_keys(x + t * partition_.k, kernels, keys.data());
    float max_score = -std::numeric_limits<float>::infinity();
    for (size_t b = 0; b < nb; ++b) {
      p[b] = score_from_key(keys[b]) * inv_temp;
      max_score = std::max(max_score, p[b]);
    }
    float total = 0.0f;
    for (size_t b = 0; b < nb; ++b) {
      p[b] = std::exp(p[b] - max_score);
      total += p[b];
    }
    std::vector<float>& sum = p_sum_[t];
    for (size_t b = 0; b < nb; ++b) sum[b] += p[b] / total;
    ++p_count_[t];
    const bool fresh = held_blocks_[t].empty();
    if (recompute || fresh) {
      for (size_t b = 0; b < nb; ++b) p[b] = sum[b] / static_cast<float>(p_count_[t]);
      size_t limit = keep_count_;
      if (config_.threshold > 0.0f) {
        size_t candidates = 0;
        for (size_t b = 0; b < nb; ++b) {
          if (keys[b] < threshold_key_) {
            p[b] = -1.0f;
          } else {
            ++candidates;
          }
        }
        limit = std::min(limit, candidates);
      }
      const size_t count = select_top_k(kernels, p.data(), nb, limit, kept.data(), scratch);
      held_blocks_[t].assign(kept.begin(), kept.begin() + count);
      if (held_blocks_[t].empty()) held_blocks_[t].push_back(-1);  // "held, nothing kept"
      std::fill(sum.begin(), sum.end(), 0.0f);
      p_count_[t] = 0;
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
