// The `quant` weight backend: W block-quantized along K exactly as com.microsoft.MatMulNBits stores
// it (4 or 8 bits, block_size 16..128, fp32 scales, optional uint8 zero points), repacked once into
// QuantPacked (quant_kernels.h) so that a gated-off input row costs no bytes. Tokens the gate keeps
// dense go through an int8 GEMM when there are enough of them (prefill); every other token is a
// decode pass over its kept rows only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "common/aligned_buffer.h"
#include "common/measured_dispatch.h"
#include "engine/gated_rows.h"
#include "engine/weight_backend.h"
#include "kernels/quant_kernels.h"

namespace ortsparse::engine {

// The packed layout and the kernel table are defined next to the kernels.
using kernels::kQuantGroup;
using kernels::QuantActivations;
using kernels::QuantDecodeActivations;
using kernels::QuantKernels;
using kernels::QuantPacked;

// MatMulNBits' weight inputs and attributes, as the op receives them (shapes as given).
//   B           uint8 [N, ceil(K / block_size), block_size * bits / 8]; at 4 bits the low nibble of a
//               byte is the even element. K need not be a multiple of block_size: the last block is
//               padded (its elements past K are ignored).
//   scales      float [N * ceil(K / block_size)] or [N, ceil(K / block_size)]
//   zero_points optional; uint8 [N, ceil(ceil(K / block_size) * bits / 8)] (4 bits: two blocks per
//               byte, low nibble = even block) or flat with that many bytes; absent: 8 at 4 bits, 128
//               at 8 bits. Float zero points (MatMulNBits allows them) are refused.
struct MatMulNBitsTensors {
  int64_t k = 0, n = 0, bits = 0, block_size = 0;
  const uint8_t* b = nullptr;
  std::vector<int64_t> b_shape;
  const float* scales = nullptr;
  std::vector<int64_t> scales_shape;
  const void* zero_points = nullptr;  // null: absent
  std::vector<int64_t> zero_points_shape;
  bool zero_points_are_float = false;
};

// Widest column panel. Wide panels make each kept row one long run of bytes and each dropped row a
// long gap: the hardware prefetchers run some lines past the end of every run, so with short rows
// (a 1-2 KB run) much of a dropped neighbour is fetched anyway; at 4096x11008 int4, keep 0.5 saved
// about half as much time with 1-2K-column panels as with full rows. The decode accumulators
// (2 x panel floats) then live in L2 rather than L1, which costs less than the bytes saved.
constexpr size_t kQuantMaxPanel = 16384;

class QuantWeights {
 public:
  // Checks every shape and attribute (fail() with the input and the values on any mismatch) and
  // repacks. max_panel (a multiple of kQuantGroup) bounds the panel width.
  explicit QuantWeights(const MatMulNBitsTensors& t, size_t max_panel = kQuantMaxPanel);

  const QuantPacked& packed() const { return packed_; }
  size_t k() const { return packed_.k; }
  size_t n() const { return packed_.n; }
  size_t bits() const { return packed_.bits; }
  size_t block() const { return packed_.block; }
  // Stored bytes: quantized values, scales and zero points (padding columns included).
  size_t bytes() const { return q_.size() + scales_.size() * sizeof(float) + zero_points_.size(); }
  // The dequantized W [K, N] (tests, the kwta gate's block norms).
  std::vector<float> dequantized() const;
  // ||W_b||_F of the dequantized W per block of `partition` (the kwta gate's l2_weighted score).
  std::vector<float> block_norms(const BlockPartition& partition) const;

 private:
  AlignedBuffer<uint8_t> q_;
  AlignedBuffer<float> scales_;
  AlignedBuffer<uint8_t> zero_points_;
  QuantPacked packed_;
};

struct QuantTuning {
  // Decode tokens with int8 activations (MatMulNBits accuracy_level 4: kernels' decode_int8) rather
  // than fp32 products of the dequantized weights (accuracy_level 0: decode).
  bool int8_decode = false;
  // A decode token's blocks are split into at most this many tasks of at least
  // decode_min_chunk_rows kept rows (partial sums added at the end; every task streams full rows).
  size_t decode_row_chunks = 4;
  size_t decode_min_chunk_rows = 128;
  // A layer with at least this many column panels (a wide head: Gemma-3's 640x262144 has 16) splits a
  // decode token by panel instead, one task per panel over every kept row: no partial sums to write
  // and add (4 x N floats per token at 4 chunks). Tasks never depend on the thread count, so neither
  // do the results.
  size_t decode_panel_tasks = 4;
  // Whether a decode call's tasks run on the pool or the calling thread: each node times both and
  // keeps the faster (common/measured_dispatch.h: spinning on, ORT's default, every SmolLM2 layer
  // gains from the pool; spinning off, waking a thread costs more than a 576x576 layer's second task
  // saves). min_units: the weight bytes below which a call stays on the calling thread (32 KiB);
  // measure = false: always the pool (tests). Results do not depend on it.
  MeasuredDispatch::Settings decode_dispatch = MeasuredDispatch::Settings::from_units(size_t{32} << 10);
  // Dense tokens go through the int8 GEMM when a call has at least this many of them.
  size_t prefill_min_tokens = 4;
  // The GEMM's column chunks are split into at most this many tasks.
  size_t prefill_max_tasks = 8;
};

// MatMulNBits' accuracy_level (0 unset, 1 fp32, 2 fp16, 3 bf16, 4 int8: the minimum precision of
// the activations in the products) as the decode numerics: int8 activations at 4, fp32 products of
// the dequantized weights below (fp16 / bf16 are not modelled: fp32 is at least as precise).
// Anything outside [0, 4] fail()s.
bool int8_decode_for_accuracy_level(int64_t accuracy_level);

class QuantBackend final : public WeightBackend {
 public:
  explicit QuantBackend(std::shared_ptr<const QuantWeights> weights, QuantTuning tuning = {});

  size_t k() const override { return weights_->k(); }
  size_t n() const override { return weights_->n(); }
  size_t bytes() const override { return weights_->bytes(); }
  std::vector<float> block_norms(const BlockPartition& partition) const override {
    return weights_->block_norms(partition);
  }
  BackendStats run(const float* x, size_t m, const GatedRows& gated, const float* bias, float* y,
                   const kernels::KernelSet& kernels, const TaskRunner& runner) const override;
  // The same with the quant kernel table given explicitly.
  BackendStats run_quant(const float* x, size_t m, const GatedRows& gated, const float* bias, float* y,
                         const QuantKernels& kernels, const TaskRunner& runner) const;

  const QuantWeights& weights() const { return *weights_; }
  const QuantTuning& tuning() const { return tuning_; }
  const MeasuredDispatch& decode_dispatch() const { return *decode_dispatch_; }

 private:
  void run_decode(const float* x, const std::vector<size_t>& tokens, const GatedRows& gated, const float* bias,
                  float* y, const QuantKernels& kernels, const TaskRunner& runner, BackendStats& stats) const;
  void run_prefill(const float* x, const std::vector<size_t>& tokens, const GatedRows& gated, const float* bias,
                   float* y, const QuantKernels& kernels, const TaskRunner& runner) const;

  std::shared_ptr<const QuantWeights> weights_;
  QuantTuning tuning_;
  // This node's decode dispatch, timed (logically const: it changes how, never what, run computes).
  std::unique_ptr<MeasuredDispatch> decode_dispatch_;
};


}  // namespace ortsparse::engine
