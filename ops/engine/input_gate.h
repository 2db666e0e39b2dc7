// An input gate decides, per call, which K-rows of X take part in Y = X·W, and asks the weight
// backend for the product through WeightProduct. Stateless gates (dense, kwta, bitmap) only plan
// rows (RowGate); a gate with state (event) may ask for several products per call (delta inputs,
// dense checks) and combine them with what it kept from earlier calls. Gates compose: the bitmap
// gate hands its surviving blocks to a kwta gate, the event gate takes a kwta gate as its prior.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "engine/gated_rows.h"
#include "kernels/kernel_set.h"

namespace ortsparse::engine {

// Everything a gate counts in one call; each op reports the fields of its gates.
struct GateStats {
  uint64_t rows = 0;
  uint64_t blocks_total = 0;  // blocks of the rows the gate decided (kwta, bitmap, event rows)
  uint64_t blocks_kept = 0;   // ... of which computed (kept or refreshed)
  bool gated = false;         // kwta: the duty schedule applied (dense mode) or recomputed (hold) the mask
  // bitmap gate
  bool bitmap_ran = false;      // the bitmap looked at this call
  bool bitmap_applied = false;  // ... and decided its rows (not auto-off)
  uint64_t bitmap_active = 0;   // active blocks over all rows
  uint64_t bitmap_blocks = 0;   // blocks over all rows
  // event gate
  uint64_t event_rows = 0;      // rows that went through the event rule
  uint64_t blocks_forced = 0;   // refreshed because of age_max
  uint64_t deadline_stops = 0;  // event rows cut short by budget_ms (after the quorum)
  uint64_t gap_checks = 0;
  uint64_t resyncs = 0;         // rows recomputed densely because delta coding drifted (a spike)
  uint64_t disables = 0;        // gap checks that switched the gate to dense
  uint64_t gate_ns = 0;         // time spent on event rows (gate + refresh)
  double last_gap = -1.0;       // gap of the last check of this call, -1 if none
  bool enabled = true;          // event: the gate is live (not auto-disabled)
};

// The product a gate asks of the weight backend: y [M, N] = per token the rows-selected x · W (+ bias).
class WeightProduct {
 public:
  virtual ~WeightProduct() = default;
  virtual size_t k() const = 0;
  virtual size_t n() const = 0;
  virtual void operator()(const float* x, size_t m, const GatedRows& rows, const float* bias, float* y) const = 0;
};

// One call of the composer: X [batch * seq, K] (row b * seq + s), Y [batch * seq, N].
struct GateCall {
  const float* x = nullptr;
  size_t batch = 0, seq = 0;
  const float* bias = nullptr;
  float* y = nullptr;
  bool dense = false;  // more rows than max_gated_rows: every row takes part (gates with state resync)
  bool reset = false;  // clear the gate's state before this call (event)
  size_t rows() const { return batch * seq; }
};

class InputGate {
 public:
  virtual ~InputGate() = default;
  virtual const BlockPartition& partition() const = 0;
  // y for this call, every product through `product`. Thread-safe.
  virtual GateStats apply(const GateCall& call, const WeightProduct& product, const kernels::KernelSet& kernels) = 0;
};

// A gate without state across rows: it plans the rows of each token, then one product runs.
class RowGate : public InputGate {
 public:
  explicit RowGate(BlockPartition partition) : partition_(partition) {}
  const BlockPartition& partition() const override { return partition_; }
  GateStats apply(const GateCall& call, const WeightProduct& product, const kernels::KernelSet& kernels) override;
  // Fills `out` for the M rows of x [M, K]; `dense`: the composer wants every row (the gate may
  // still count the call, e.g. the kwta duty step). Thread-safe.
  virtual GateStats plan(const float* x, size_t m, bool dense, const kernels::KernelSet& kernels, GatedRows& out) = 0;

 protected:
  BlockPartition partition_;
};

// Every row of every token.
class DenseGate final : public RowGate {
 public:
  using RowGate::RowGate;
  GateStats plan(const float* x, size_t m, bool dense, const kernels::KernelSet& kernels, GatedRows& out) override;
};

}  // namespace ortsparse::engine
