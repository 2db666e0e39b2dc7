// The `proc` weight backend (ProcSparseMatMul): W ~ procedural hash base + per output unit the
// deltas of its `fanout` kept K-blocks; outside its kept blocks a unit's weights are 0. Only
// (kept blocks ∩ the gate's rows) are reconstructed and multiplied. See docs/ops.md#procsparsematmul.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "common/aligned_buffer.h"
#include "engine/gated_rows.h"
#include "kernels/proc_kernels.h"
#include "engine/weight_backend.h"

namespace ortsparse::engine {

// The packed layout and its hash are defined next to their kernels.
using kernels::DeltaType;
using kernels::half_to_float;
using kernels::kProcDeltaPad;
using kernels::kProcTokenTile;
using kernels::proc_base;
using kernels::ProcPacked;

class ProcWeights {
 public:
  // Copies and checks the packed arrays (index [n, fanout] ascending block indices < num_blocks,
  // deltas [n, fanout, block]); throws Error naming the bad entry.
  ProcWeights(size_t k, size_t n, size_t block, size_t fanout, uint64_t seed, float base_scale,
              const uint16_t* index, const void* deltas, DeltaType delta_type);

  const ProcPacked& packed() const { return packed_; }
  size_t k() const { return packed_.k; }
  size_t n() const { return packed_.n; }
  // Stored bytes: indices + deltas (exactly the packed tensors' payload).
  size_t bytes() const { return index_.size() * sizeof(uint16_t) + deltas_.size() - kProcDeltaPad; }
  // Stored deltas that are exactly 0 on real rows of kept blocks (shed by the builder: the weight
  // there is the base alone).
  size_t zero_deltas() const { return zero_deltas_; }
  // ||W_b||_F of the reconstructed W per block of `partition` (the kwta gate's l2_weighted score).
  std::vector<float> block_norms(const BlockPartition& partition) const;

 private:
  AlignedBuffer<uint16_t> index_;
  AlignedBuffer<uint8_t> deltas_;
  ProcPacked packed_;
  size_t zero_deltas_ = 0;
};

struct ProcTuning {
  // Units per task at M <= 2 (at least; a decode step splits N into at most max_tasks tasks).
  size_t min_units_per_task = 64;
  size_t max_tasks = 8;
  // Packed bytes of one unit panel at M > 2, sized to stay in L2 while every token tile passes.
  size_t panel_bytes = 256 * 1024;
};

class ProcBackend final : public WeightBackend {
 public:
  explicit ProcBackend(std::shared_ptr<const ProcWeights> weights, ProcTuning tuning = {});

  size_t k() const override { return weights_->k(); }
  size_t n() const override { return weights_->n(); }
  size_t bytes() const override { return weights_->bytes(); }
  std::vector<float> block_norms(const BlockPartition& partition) const override {
    return weights_->block_norms(partition);
  }
  // Counts the work: blocks reconstructed and unit passes (one per unit and token tile; at M = 1 a
  // tile is the token), so proc.fanout_effective = blocks / unit_passes.
  BackendStats run(const float* x, size_t m, const GatedRows& gated, const float* bias, float* y,
                   const kernels::KernelSet& kernels, const TaskRunner& runner) const override;

  const ProcWeights& weights() const { return *weights_; }

 private:
  std::shared_ptr<const ProcWeights> weights_;
  ProcTuning tuning_;
};

}  // namespace ortsparse::engine
