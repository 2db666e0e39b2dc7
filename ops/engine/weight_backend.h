// The engine's two independent choices meet here: an input gate decides per token which K-rows
// take part (GatedRows), a weight backend computes the product over exactly those rows from its
// own representation of W (dense packed rows, procedural base + sparse deltas, tensor-train cores).
// Gates never see how W is stored; backends never decide which rows are kept.
#pragma once

#include <cstddef>

#include "common/task_runner.h"
#include "engine/gated_rows.h"
#include "engine/kernels.h"

namespace ortsparse::engine {

class WeightBackend {
 public:
  virtual ~WeightBackend() = default;

  virtual size_t k() const = 0;
  virtual size_t n() const = 0;
  // Bytes the backend keeps for W (memory metrics: mem_ratio = bytes / (K * N * 4)).
  virtual size_t bytes() const = 0;

  // y [M, N] = per token m: gated.scale[m] * sum over its rows r of x[m, r] * W[r, :] (+ bias).
  // A backend whose W is approximate uses its approximation; rows outside the token's list add 0.
  virtual void run(const float* x, size_t m, const GatedRows& gated, const float* bias, float* y,
                   const KernelTable& kernels, const TaskRunner& runner) const = 0;
};

}  // namespace ortsparse::engine
