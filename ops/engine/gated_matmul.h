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

// An epilogue on the product's columns. kSilu: the weights hold two halves [gate | up] along N and
// the output is silu(y[:, :N/2]) * y[:, N/2:] (SwiGLU), N/2 columns — an MLP's gate and up
// projections and their activation in one call.
enum class Glu { kNone, kSilu };

struct GatedMatMulOptions {
  // > 0: a call with more rows than this runs every row (prefill); gates with state resync on it.
  int64_t max_gated_rows = 0;
  // Output NaN/Inf while X is finite (an approximate backend overflowed): recompute the call with
  // `fallback` if given, else fail naming the cause.
  bool nan_guard = false;
  std::shared_ptr<const WeightBackend> fallback;
  Glu glu = Glu::kNone;
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
  size_t n() const { return backend_->n(); }                                       // the product's columns
  size_t out_n() const { return options_.glu == Glu::kNone ? n() : n() / 2; }  // y's columns

  // y [batch * seq, out_n()] = gated x [batch * seq, K] · W (+ bias), then the epilogue. Rows of one batch index are
  // consecutive positions of one sequence (what a gate with state follows). Thread-safe.
  MatMulStats run(const float* x, size_t batch, size_t seq, const float* bias, float* y, bool reset,
                  const kernels::KernelSet& kernels, const TaskRunner& runner) const;

 private:
  std::unique_ptr<InputGate> gate_;
  std::shared_ptr<const WeightBackend> backend_;
  GatedMatMulOptions options_;
};

}  // namespace ortsparse::engine
