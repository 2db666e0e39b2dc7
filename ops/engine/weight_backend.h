// A weight backend supplies Y = X·W over the K-rows an input gate kept (GatedRows), from its own
// representation of W: dense packed fp32 rows, procedural base + sparse deltas, tensor-train
// cores. Backends never decide which rows are kept; gates never see how W is stored.
#pragma once

#include <cstddef>
#include <vector>

#include "common/task_runner.h"
#include "engine/gated_rows.h"
#include "kernels/kernel_set.h"

namespace ortsparse::engine {

// What a backend counts about one run (the proc backend's fanout metric); zero for the others.
struct BackendStats {
  uint64_t blocks = 0;       // weight blocks reconstructed
  uint64_t unit_passes = 0;  // (output unit, token tile) passes
  uint64_t decode_calls = 0;       // decode calls of more than one task (quant and dense backends)
  uint64_t decode_pool_calls = 0;  // ... of which ran on the intra-op pool (common/measured_dispatch.h)

  void count_decode(size_t tasks, bool pooled) {
    decode_calls += tasks > 1;
    decode_pool_calls += pooled;
  }
};

class WeightBackend {
 public:
  virtual ~WeightBackend() = default;

  virtual size_t k() const = 0;
  virtual size_t n() const = 0;
  // Bytes the backend keeps for W (memory metrics: mem_ratio = bytes / (K * N * 4)).
  virtual size_t bytes() const = 0;
  // ||W_b||_F per block of `partition` (the kwta gate's l2_weighted score; called at kernel
  // creation). The default probes the backend with unit inputs; backends that store rows override it.
  virtual std::vector<float> block_norms(const BlockPartition& partition) const;

  // y [M, N] = per token m: gated.scale[m] * sum over its rows r of x[m, r] * W[r, :] (+ bias).
  // A backend whose W is approximate uses its approximation; rows outside the token's list add 0.
  virtual BackendStats run(const float* x, size_t m, const GatedRows& gated, const float* bias, float* y,
                           const kernels::KernelSet& kernels, const TaskRunner& runner) const = 0;
};

}  // namespace ortsparse::engine
