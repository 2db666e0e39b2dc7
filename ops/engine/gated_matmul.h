// The composer: one input gate over one weight backend. Every matmul op is this class plus an
// adapter that reads attributes and reports metrics (ops/ort/).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "common/task_runner.h"
#include "engine/input_gate.h"
#include "engine/weight_backend.h"
#include "kernels/kernel_set.h"

namespace ortsparse::engine {

struct GatedMatMulOptions {
  // > 0: a call with more rows than this runs every row (prefill); gates with state resync on it.
  int64_t max_gated_rows = 0;
  // Output NaN/Inf while X is finite (an approximate backend overflowed): recompute the call with
  // `fallback` if given, else fail naming the cause.
  bool nan_guard = false;
  std::shared_ptr<const WeightBackend> fallback;
};

struct MatMulStats {
  GateStats gate;  // gate.rows == 0: an empty call (adapters count nothing)
  BackendStats backend;
  bool nan_fallback = false;
};

class GatedMatMul {
 public:
  GatedMatMul(std::unique_ptr<InputGate> gate, std::shared_ptr<const WeightBackend> backend,
              GatedMatMulOptions options = {});

  const InputGate& gate() const { return *gate_; }
  const WeightBackend& backend() const { return *backend_; }
  size_t k() const { return backend_->k(); }
  size_t n() const { return backend_->n(); }

  // y [batch * seq, N] = gated x [batch * seq, K] · W (+ bias). Rows of one batch index are
  // consecutive positions of one sequence (what a gate with state follows). Thread-safe.
  MatMulStats run(const float* x, size_t batch, size_t seq, const float* bias, float* y, bool reset,
                  const kernels::KernelSet& kernels, const TaskRunner& runner) const;

 private:
  std::unique_ptr<InputGate> gate_;
  std::shared_ptr<const WeightBackend> backend_;
  GatedMatMulOptions options_;
};

}  // namespace ortsparse::engine
