// The `tt` weight backend: W [K, N] held as a tensor-train matrix (TT-matrix) with cores
// G_t [r_{t-1}, k_t, n_t, r_t], K = prod k_t, N = prod n_t, r_0 = r_d = 1:
//   W[(i_1..i_d), (j_1..j_d)] = G_1[:, i_1, j_1, :] . G_2[:, i_2, j_2, :] ... G_d[:, i_d, j_d, :]
// (multi-indices row-major: i_1 most significant). d = 2 with in_modes [K, 1], out_modes [1, N] is
// the plain low-rank product W = U V.
//
// Y = X W is never formed from W: X [M, k_1..k_d] goes through the cores one at a time, each step a
// small batched GEMM over a reshaped intermediate (see tt_backend.cc for the layouts). The order
// (first core first, or last core first) is the one with fewer FLOPs, chosen at creation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/aligned_buffer.h"
#include "kernels/kernel_set.h"
#include "engine/weight_backend.h"

namespace ortsparse::engine {

struct TTShape {
  std::vector<size_t> in_modes, out_modes, ranks;  // ranks: d + 1 entries, first and last 1

  size_t d() const { return in_modes.size(); }
  size_t k() const;
  size_t n() const;
  size_t core_size(size_t t) const { return ranks[t] * in_modes[t] * out_modes[t] * ranks[t + 1]; }
  size_t cores_size() const;
  size_t max_rank() const;
};

// Checks modes/ranks and the packed length; throws Error naming the attribute and values.
TTShape make_tt_shape(const std::vector<int64_t>& in_modes, const std::vector<int64_t>& out_modes,
                      const std::vector<int64_t>& ranks, size_t cores_length);

class TTBackend final : public WeightBackend {
 public:
  // cores: the d cores concatenated, each row-major [r_{t-1}, k_t, n_t, r_t]. Repacked here, once.
  // right_to_left: -1 = pick the order with fewer FLOPs, 0 = first core first, 1 = last core first.
  TTBackend(TTShape shape, const float* cores, int right_to_left = -1);

  size_t k() const override { return k_; }
  size_t n() const override { return n_; }
  size_t bytes() const override { return bytes_; }
  // Gated tokens: inputs outside the token's rows are zeroed before contracting (a TT core mixes
  // every row of W, so a skipped row saves no work here; the gate only changes the result).
  BackendStats run(const float* x, size_t m, const GatedRows& gated, const float* bias, float* y,
                   const kernels::KernelSet& kernels, const TaskRunner& runner) const override;

  const TTShape& shape() const { return shape_; }
  bool right_to_left() const { return right_to_left_; }
  // Multiply-adds per token of the chosen order (dense: K * N).
  double macs_per_token() const { return macs_; }
  static double order_macs(const TTShape& shape, bool right_to_left);

 private:
  // One core: a GEMM out [rows x a] = in [rows x b] . mat [b x a] with rows = tokens * rows_per_token,
  // then (unless trivial) a 2-D transpose of out, [R x C] -> [C x R], that moves the next core's
  // mode next to its rank so the next step is again a plain GEMM (layouts in tt_backend.cc).
  struct Step {
    size_t rows_per_token, a, b;
    size_t offset;            // of mat in mats_
    size_t tr_r, tr_c;        // transpose after: R = tr_r or C = tr_c (the other = total / it); 0, 0 = none
  };
  // Whole chain for `count` tokens: x [count, K] -> y [count, N], with two scratch buffers.
  // Rows [t0, t1) of the call (run() splits a call into passes of bounded scratch).
  void run_rows(const float* x, size_t t0, size_t t1, const GatedRows& gated, const float* bias, float* y,
                const kernels::KernelSet& kernels, const TaskRunner& runner) const;
  void run_chunk(const float* x, size_t count, float* y, float* s0, float* s1, const kernels::KernelSet& kernels,
                 const TaskRunner* step_runner) const;

  TTShape shape_;
  size_t k_, n_, bytes_;
  bool right_to_left_;
  double macs_;
  std::vector<Step> steps_;
  AlignedBuffer<float> mats_;
  size_t scratch_per_token_;  // floats of the largest intermediate of one token
  size_t pre_c_ = 0;  // first core first: X [(m k_1) x q_1] -> [q_1 x (m k_1)] before the first GEMM
};

}  // namespace ortsparse::engine
