// The `kwta` input gate: per token, keep the top-K blocks of X by score (or those above a
// calibrated threshold), with the duty schedule (duty/duty_mode). See docs/ops.md#kwtablockmatmul.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "engine/gated_rows.h"
#include "engine/input_gate.h"
#include "kernels/kernel_set.h"

namespace ortsparse::engine {

enum class KwtaScore { kL2, kMeanAbs, kL2Weighted };
enum class DutyMode { kDense, kHold };

struct KwtaConfig {
  double k_frac = 0.5;
  int64_t k_abs = 0;
  KwtaScore score = KwtaScore::kL2;
  float threshold = 0.0f;
  float temp = 1.0f;
  int64_t duty = 1;
  DutyMode duty_mode = DutyMode::kDense;
  bool renorm = false;
  int64_t max_gated_rows = 0;  // > 0: a call with more rows than this runs dense (the composer's option)
};

KwtaScore parse_kwta_score(const std::string& name);  // throws Error naming the valid values
DutyMode parse_duty_mode(const std::string& name);

class KwtaGate final : public RowGate {
 public:
  // block_weight_norms: ||W_b||_F per block, needed for KwtaScore::kL2Weighted (else may be empty).
  KwtaGate(BlockPartition partition, KwtaConfig config, std::vector<float> block_weight_norms);

  size_t keep_count() const { return keep_count_; }
  const KwtaConfig& config() const { return config_; }

  // Thread-safe: concurrent calls share the step counter (and, in hold mode, the held masks under
  // a mutex). A dense call counts as a step of the duty schedule.
  GateStats plan(const float* x, size_t m, bool dense, const kernels::KernelSet& kernels, GatedRows& out) override;

  // Selection keys of one token's blocks, monotone in the score: the squared score for l2 and
  // l2_weighted (no sqrt needed to rank), the score for mean_abs — and the score itself, computed
  // in double, for a token whose squared keys overflow float. Returns whether the keys are squared.
  bool block_keys(const float* x, const kernels::KernelSet& kernels, float* keys) const;
  // The published score (||x_b||, mean|x_b|, ||x_b||·||W_b||) from a key.
  float score_from_key(float key, bool squared) const;
  // Kept blocks of one token from its keys (threshold and top-K rules); returns the count.
  size_t select(const kernels::KernelSet& kernels, const float* keys, bool squared, int32_t* kept,
                std::vector<uint32_t>& scratch) const;

 private:
  GateStats plan_hold(const float* x, size_t m, const kernels::KernelSet& kernels, GatedRows& out, bool recompute);

  KwtaConfig config_;
  std::vector<float> weight_norms_sq_;
  std::vector<float> inv_block_len_;
  float threshold_key_ = 0.0f;  // threshold^2, compared with squared keys
  size_t keep_count_ = 1;
  std::atomic<uint64_t> step_{0};

  // hold mode: per token position, the held mask and log(sum of p) since the last recompute.
  std::mutex hold_mutex_;
  std::vector<std::vector<int32_t>> held_blocks_;
  std::vector<std::vector<double>> log_p_sum_;
};

}  // namespace ortsparse::engine
