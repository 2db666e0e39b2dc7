#include "engine/kwta_gate.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "common/error.h"
#include "kernels/top_k.h"

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
  threshold_key_ = config_.score == KwtaScore::kMeanAbs ? config_.threshold : config_.threshold * config_.threshold;
}

void KwtaGate::block_keys(const float* x, const kernels::KernelSet& kernels, float* keys) const {
  const size_t nb = partition_.num_blocks;
  if (config_.score == KwtaScore::kMeanAbs) {
    kernels.matmul->block_sumabs(x, partition_.k, partition_.block, keys);
    if (!inv_block_len_.empty())
      for (size_t b = 0; b < nb; ++b) keys[b] *= inv_block_len_[b];
    return;
  }
  kernels.matmul->block_sumsq(x, partition_.k, partition_.block, keys);  // squared l2: same order, no sqrt
  if (config_.score == KwtaScore::kL2Weighted)
    for (size_t b = 0; b < nb; ++b) keys[b] *= weight_norms_sq_[b];
}

float KwtaGate::score_from_key(float key) const {
  return config_.score == KwtaScore::kMeanAbs ? key : std::sqrt(key);
}

size_t KwtaGate::select(const kernels::KernelSet& kernels, const float* keys, int32_t* kept,
                        std::vector<uint32_t>& scratch) const {
  const size_t nb = partition_.num_blocks;
  if (config_.threshold > 0.0f) {
    size_t count = 0;
    for (size_t b = 0; b < nb; ++b)
      if (!(keys[b] < threshold_key_)) kept[count++] = static_cast<int32_t>(b);  // NaN is kept
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
GateStats KwtaGate::plan_hold(const float* x, size_t m, const kernels::KernelSet& kernels, GatedRows& out,
                              bool recompute) {
  const size_t nb = partition_.num_blocks;
  GateStats stats;
  stats.blocks_total = static_cast<uint64_t>(m) * nb;
  stats.gated = recompute;
  std::vector<float> keys(nb), p(nb);
  std::vector<int32_t> kept(nb + kernels::kIndexSlack);
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
      const size_t count = kernels::select_top_k(*kernels.select, p.data(), nb, limit, kept.data(), scratch);
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
