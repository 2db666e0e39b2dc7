#include "engine/proc_backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/error.h"
#include "common/scratch.h"

namespace ortsparse::engine {

ProcWeights::ProcWeights(size_t k, size_t n, size_t block, size_t fanout, uint64_t seed, float base_scale,
                         const uint16_t* index, const void* deltas, DeltaType delta_type) {
  if (k == 0 || block == 0 || block > k) fail("block=", block, " must be in [1, K=", k, "]");
  const size_t nb = (k + block - 1) / block;
  if (nb > 65536) fail("K=", k, " / block=", block, " gives ", nb, " blocks; block indices are uint16 (at most 65536 blocks)");
  if (fanout > nb) fail("fanout=", fanout, " exceeds the number of blocks ", nb);
  if (k >= (size_t{1} << 31) || n >= (size_t{1} << 31)) fail("K=", k, " or N=", n, " is too large");
  index_.resize(n * fanout);
  const size_t delta_size = delta_type == DeltaType::kF16 ? 2 : 4;
  deltas_.resize(n * fanout * block * delta_size + kProcDeltaPad);
  if (n * fanout != 0) std::memcpy(index_.data(), index, n * fanout * sizeof(uint16_t));
  if (n * fanout * block != 0) std::memcpy(deltas_.data(), deltas, n * fanout * block * delta_size);
  std::memset(deltas_.data() + n * fanout * block * delta_size, 0, kProcDeltaPad);
  for (size_t j = 0; j < n; ++j) {
    const uint16_t* row = index_.data() + j * fanout;
    for (size_t f = 0; f < fanout; ++f) {
      if (row[f] >= nb)
        fail("input indices[", j, ", ", f, "] = ", row[f], " is not a block index (K=", k, ", block=", block,
             ": ", nb, " blocks)");
      if (f > 0 && row[f] <= row[f - 1])
        fail("input indices[", j, ", :] must be strictly ascending; indices[", j, ", ", f - 1, "] = ", row[f - 1],
             ", indices[", j, ", ", f, "] = ", row[f]);
    }
  }
  packed_.k = k;
  packed_.n = n;
  packed_.block = block;
  packed_.fanout = fanout;
  packed_.num_blocks = nb;
  packed_.seed = seed;
  packed_.base_scale = base_scale;
  packed_.index = index_.data();
  packed_.deltas = deltas_.data();
  packed_.delta_type = delta_type;
  for (size_t j = 0; j < n; ++j)
    for (size_t f = 0; f < fanout; ++f) {
      const size_t b = index_.data()[j * fanout + f];
      const size_t len = std::min(block, k - b * block), at = (j * fanout + f) * block;
      for (size_t r = 0; r < len; ++r) {
        const bool zero = delta_type == DeltaType::kF16
                              ? (reinterpret_cast<const uint16_t*>(deltas_.data())[at + r] & 0x7FFFu) == 0
                              : reinterpret_cast<const float*>(deltas_.data())[at + r] == 0.0f;
        zero_deltas_ += zero;
      }
    }
}

std::vector<float> ProcWeights::block_norms(const BlockPartition& partition) const {
  std::vector<double> sums(partition.num_blocks, 0.0);
  const ProcPacked& p = packed_;
  std::vector<float> base(p.block);
  for (size_t j = 0; j < p.n; ++j)
    for (size_t f = 0; f < p.fanout; ++f) {
      const size_t b = p.index[j * p.fanout + f];
      const size_t start = b * p.block, len = std::min(p.block, p.k - start), at = (j * p.fanout + f) * p.block;
      for (size_t r = 0; r < len; ++r) {
        const float d = p.delta_type == DeltaType::kF16 ? half_to_float(static_cast<const uint16_t*>(p.deltas)[at + r])
                                                        : static_cast<const float*>(p.deltas)[at + r];
        const float w = (p.base_scale != 0.0f ? proc_base(p.seed, p.base_scale, j, start + r) : 0.0f) + d;
        sums[(start + r) / partition.block] += static_cast<double>(w) * w;
      }
    }
  std::vector<float> out(partition.num_blocks);
  for (size_t b = 0; b < out.size(); ++b) out[b] = static_cast<float>(std::sqrt(sums[b]));
  return out;
}

ProcBackend::ProcBackend(std::shared_ptr<const ProcWeights> weights, ProcTuning tuning)
    : weights_(std::move(weights)), tuning_(tuning) {}

// Per token: its input (scaled, zero outside its gated rows, so a computed block adds exactly the
// gated rows) and, for a gated token, which proc blocks hold any of its rows. A tile of up to
// kProcTokenTile tokens passes over the layout once, skipping blocks none of its tokens needs.
BackendStats ProcBackend::run(const float* x, size_t m, const GatedRows& gated, const float* bias, float* y,
                              const kernels::KernelSet& kernels, const TaskRunner& runner) const {
  BackendStats stats;
  const ProcPacked& p = weights_->packed();
  const size_t k = p.k, n = p.n, nb = p.num_blocks;
  if (m == 0 || n == 0) return stats;
  const kernels::ProcKernels& pk = *kernels.proc;
  const size_t tiles = (m + kProcTokenTile - 1) / kProcTokenTile;
  // Reused per calling thread; the tasks only see the raw pointers taken here.
  thread_local std::vector<float> xv_buffer;
  thread_local std::vector<uint8_t> mask_buffer;
  thread_local std::vector<const float*> input_buffer;
  thread_local std::vector<uint64_t> count_buffer;
  thread_local std::vector<uint8_t> tile_masked;
  input_buffer.resize(m);
  mask_buffer.assign(tiles * nb, 0);
  tile_masked.assign(tiles, 0);
  size_t gathered = 0;
  for (size_t t = 0; t < m; ++t) gathered += !(gated.dense[t] && gated.scale[t] == 1.0f);
  xv_buffer.resize(gathered * k);
  float* xv = xv_buffer.data();
  for (size_t t = 0, slot = 0; t < m; ++t) {
    const float* xt = x + t * k;
    const size_t tile = t / kProcTokenTile;
    if (gated.dense[t] && gated.scale[t] == 1.0f) {
      input_buffer[t] = xt;
      continue;
    }
    float* dst = xv + (slot++) * k;
    input_buffer[t] = dst;
    const float s = gated.scale[t];
    if (gated.dense[t]) {
      for (size_t r = 0; r < k; ++r) dst[r] = xt[r] * s;
      continue;
    }
    std::fill(dst, dst + k, 0.0f);
    uint8_t* mask = mask_buffer.data() + tile * nb;
    for (size_t i = gated.offset[t]; i < gated.offset[t + 1]; ++i) {
      const size_t r = static_cast<size_t>(gated.rows[i]);
      dst[r] = xt[r] * s;
      mask[r / p.block] = 1;
    }
  }
  // A tile is masked only when every token in it is gated (a dense token needs every block).
  for (size_t tile = 0; tile < tiles; ++tile) {
    bool all_gated = true;
    for (size_t t = tile * kProcTokenTile; t < std::min(m, (tile + 1) * kProcTokenTile); ++t) all_gated &= !gated.dense[t];
    tile_masked[tile] = all_gated;
  }

  const size_t delta_bytes = p.delta_type == DeltaType::kF16 ? 2 : 4;
  const size_t unit_bytes = std::max<size_t>(1, p.fanout * (p.block * delta_bytes + 2));
  size_t span;
  if (tiles == 1) {
    const size_t tasks = std::max<size_t>(1, std::min(tuning_.max_tasks, n / tuning_.min_units_per_task));
    span = (n + tasks - 1) / tasks;
  } else {
    span = std::max<size_t>(16, tuning_.panel_bytes / unit_bytes);
  }
  const size_t tasks = (n + span - 1) / span;
  count_buffer.assign(tasks, 0);
  const float* const* inputs = input_buffer.data();
  const uint8_t* masks = mask_buffer.data();
  const uint8_t* masked = tile_masked.data();
  uint64_t* counts = count_buffer.data();
  runner.run(tasks, [&, inputs, masks, masked, counts](size_t task) {
    const size_t n0 = task * span, n1 = std::min(n, n0 + span);
    uint64_t computed = 0;
    for (size_t tile = 0; tile < tiles; ++tile) {
      const size_t t0 = tile * kProcTokenTile, count = std::min(kProcTokenTile, m - t0);
      float* ys[kProcTokenTile];
      for (size_t i = 0; i < count; ++i) ys[i] = y + (t0 + i) * n;
      computed += pk.units(p, inputs + t0, count, masked[tile] ? masks + tile * nb : nullptr, n0, n1, bias, ys);
    }
    counts[task] = computed;
  });
  for (size_t task = 0; task < tasks; ++task) stats.blocks += counts[task];
  stats.unit_passes = static_cast<uint64_t>(tiles) * n;
  release_if_large(xv_buffer, mask_buffer, input_buffer, count_buffer, tile_masked);
  return stats;
}

}  // namespace ortsparse::engine
