// The dense weight backend: W pre-packed once as fp32 rows (DenseWeights), the gated product
// streamed row by row (decode) or in token tiles over column panels (prefill).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "common/aligned_buffer.h"
#include "common/measured_dispatch.h"
#include "common/task_runner.h"
#include "engine/gated_rows.h"
#include "engine/weight_backend.h"
#include "kernels/kernel_set.h"

namespace ortsparse::engine {

class DenseWeights {
 public:
  // Packs W [K, N] (row-major) once; rows padded to 16 floats so every row starts 64-byte aligned.
  DenseWeights(const float* w, size_t k, size_t n);

  // Shared packing: two kernels (one session or several) that see the same initializer — same
  // data pointer, shape and bit-identical contents — get one packed copy.
  static std::shared_ptr<const DenseWeights> pack_shared(const float* w, size_t k, size_t n);
  // W [K, N] (row-major) equals the packed rows bit for bit.
  bool same_contents(const float* w) const;

  size_t k() const { return k_; }
  size_t n() const { return n_; }
  size_t ldw() const { return ldw_; }
  const float* data() const { return data_.data(); }
  size_t bytes() const { return data_.size() * sizeof(float); }
  // ||W_b||_F of each block of `partition`.
  std::vector<float> block_norms(const BlockPartition& partition) const;

 private:
  size_t k_, n_, ldw_;
  AlignedBuffer<float> data_;
};

struct MatMulTuning {
  // M <= 2 (decode): a token's kept rows are split into at most this many tasks, each at least
  // gemv_min_chunk_rows rows (partial sums are added at the end).
  size_t gemv_row_chunks = 4;
  size_t gemv_min_chunk_rows = 128;
  // W bytes of one column panel at M > kSmallM, sized to stay in L2 across token tiles.
  size_t panel_bytes = 384 * 1024;
  // Decode calls time the calling thread against the pool and keep the faster, from 32 KiB of
  // weights (common/measured_dispatch.h; QuantTuning::decode_dispatch). Results do not depend on it.
  MeasuredDispatch::Settings gemv_dispatch = MeasuredDispatch::Settings::from_units(size_t{32} << 10);
};

class DenseBackend final : public WeightBackend {
 public:
  explicit DenseBackend(std::shared_ptr<const DenseWeights> weights, MatMulTuning tuning = {});

  size_t k() const override { return weights_->k(); }
  size_t n() const override { return weights_->n(); }
  size_t bytes() const override { return weights_->bytes(); }
  std::vector<float> block_norms(const BlockPartition& partition) const override {
    return weights_->block_norms(partition);
  }
  BackendStats run(const float* x, size_t m, const GatedRows& gated, const float* bias, float* y,
                   const kernels::KernelSet& kernels, const TaskRunner& runner) const override;

  const DenseWeights& weights() const { return *weights_; }

 private:
  BackendStats run_per_token(const float* x, size_t m, const GatedRows& gated, const float* bias, float* y,
                             const kernels::MatMulKernels& kernels, const TaskRunner& runner) const;
  void run_tiled(const float* x, size_t m, const GatedRows& gated, const float* bias, float* y,
                 const kernels::MatMulKernels& kernels, const TaskRunner& runner) const;

  std::shared_ptr<const DenseWeights> weights_;
  MatMulTuning tuning_;
  // This node's decode dispatch, timed (logically const: it changes how, never what, run computes).
  std::unique_ptr<MeasuredDispatch> gemv_dispatch_;
};

}  // namespace ortsparse::engine
