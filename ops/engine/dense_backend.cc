#include "engine/dense_backend.h"

#include "common/copy.h"
#include "common/scratch.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <tuple>

namespace ortsparse::engine {
namespace {

constexpr size_t kSmallM = 2;

size_t round_up(size_t value, size_t multiple) { return (value + multiple - 1) / multiple * multiple; }

// Splits [0, n) into `parts` spans whose starts are multiples of 16 columns.
struct ColumnSpans {
  size_t n, span, count;
  ColumnSpans(size_t n_, size_t parts) : n(n_) {
    parts = std::max<size_t>(1, parts);
    span = std::max<size_t>(16, round_up((n + parts - 1) / parts, 16));
    count = (n + span - 1) / span;
  }
  size_t begin(size_t i) const { return i * span; }
  size_t width(size_t i) const { return std::min(n, (i + 1) * span) - i * span; }
};

void fill_bias(float* y, const float* bias, size_t width) {
  if (bias) copy_floats(y, bias, width);
}

// The inputs token t uses, in row-list order, times its scale (dense: all K).
void gather_token(const float* xt, const GatedRows& gated, size_t t, size_t k, float* dst) {
  const float s = gated.scale[t];
  if (gated.dense[t]) {
    for (size_t r = 0; r < k; ++r) dst[r] = xt[r] * s;
    return;
  }
  const int32_t* rows = gated.rows.data() + gated.offset[t];
  const size_t count = gated.offset[t + 1] - gated.offset[t];
  for (size_t i = 0; i < count; ++i) dst[i] = xt[rows[i]] * s;
}

}  // namespace

DenseWeights::DenseWeights(const float* w, size_t k, size_t n) : k_(k), n_(n), ldw_(round_up(n, 16)) {
  data_.resize(k_ * ldw_);
  if (n_ == 0) return;  // N = 0: nothing to pack (w may be null)
  for (size_t r = 0; r < k_; ++r) {
    float* dst = data_.data() + r * ldw_;
    copy_floats(dst, w + r * n_, n_);
    std::fill(dst + n_, dst + ldw_, 0.0f);
  }
}

std::shared_ptr<const DenseWeights> DenseWeights::pack_shared(const float* w, size_t k, size_t n) {
  // Keyed by where the initializer lives and its shape; a hit is used only when its contents are
  // bit-identical (two sessions can place different weights at one address in turn).
  using Key = std::tuple<const float*, size_t, size_t>;
  static std::mutex mutex;
  static auto* cache = new std::map<Key, std::weak_ptr<const DenseWeights>>();
  std::lock_guard<std::mutex> lock(mutex);
  for (auto it = cache->begin(); it != cache->end();) it = it->second.expired() ? cache->erase(it) : std::next(it);
  auto& slot = (*cache)[Key{w, k, n}];
  if (auto existing = slot.lock())
    if (existing->same_contents(w)) return existing;
  auto packed = std::make_shared<const DenseWeights>(w, k, n);
  slot = packed;
  return packed;
}

bool DenseWeights::same_contents(const float* w) const {
  for (size_t r = 0; r < k_; ++r)
    if (n_ != 0 && std::memcmp(data_.data() + r * ldw_, w + r * n_, n_ * sizeof(float)) != 0) return false;
  return true;
}

std::vector<float> DenseWeights::block_norms(const BlockPartition& partition) const {
  std::vector<float> norms(partition.num_blocks, 0.0f);
  for (size_t b = 0; b < partition.num_blocks; ++b) {
    double s = 0.0;
    for (size_t r = partition.begin(b); r < partition.end(b); ++r) {
      const float* row = data_.data() + r * ldw_;
      for (size_t j = 0; j < n_; ++j) s += static_cast<double>(row[j]) * row[j];
    }
    norms[b] = static_cast<float>(std::sqrt(s));
  }
  return norms;
}

DenseBackend::DenseBackend(std::shared_ptr<const DenseWeights> weights, MatMulTuning tuning)
    : weights_(std::move(weights)), tuning_(tuning),
      gemv_dispatch_(std::make_unique<MeasuredDispatch>(tuning.gemv_dispatch)) {}

BackendStats DenseBackend::run(const float* x, size_t m, const GatedRows& gated, const float* bias, float* y,
                               const kernels::KernelSet& kernels, const TaskRunner& runner) const {
  if (m == 0 || weights_->n() == 0) return {};
  if (m <= kSmallM) return run_per_token(x, m, gated, bias, y, *kernels.matmul, runner);
  run_tiled(x, m, gated, bias, y, *kernels.matmul, runner);
  return {};
}

// Decode: gather each token's kept inputs once, then split its row list into a few chunks; each
// task streams whole W rows (full N, so hardware prefetch sees long runs) into a partial sum, and
// the partials are added at the end. Splitting rows rather than columns keeps the streams long
// at one thread and still feeds every thread of the pool.
BackendStats DenseBackend::run_per_token(const float* x, size_t m, const GatedRows& gated, const float* bias,
                                         float* y, const kernels::MatMulKernels& kernels,
                                         const TaskRunner& runner) const {
  const DenseWeights& w = *weights_;
  const size_t k = w.k(), n = w.n();
  // Reused per calling thread. The tasks below run on pool threads, where these names would mean
  // other (empty) objects: they only see the pointers taken here.
  thread_local std::vector<float> xv_buffer;
  thread_local std::vector<float> partial_buffer;
  thread_local std::vector<const float*> input_buffer;
  xv_buffer.resize(m * k);
  input_buffer.resize(m);
  float* const xv = xv_buffer.data();
  const float** const inputs = input_buffer.data();
  for (size_t t = 0; t < m; ++t) {
    if (gated.dense[t] && gated.scale[t] == 1.0f) {
      inputs[t] = x + t * k;  // all rows, unscaled: x itself
    } else {
      gather_token(x + t * k, gated, t, k, xv + t * k);
      inputs[t] = xv + t * k;
    }
  }
  // Chunks from the rows actually kept (not K): a short list in several chunks would pay the
  // partial outputs' zeroing and reduction (O(N) each) for little work.
  size_t max_rows = 0;
  for (size_t t = 0; t < m; ++t) max_rows = std::max(max_rows, gated.row_count(t, k));
  const size_t chunks = std::max<size_t>(1, std::min(tuning_.gemv_row_chunks, max_rows / tuning_.gemv_min_chunk_rows));
  if (chunks > 1) partial_buffer.resize(m * chunks * n);
  float* const partial = partial_buffer.data();
  size_t stream_bytes = 0;
  for (size_t t = 0; t < m; ++t) stream_bytes += gated.row_count(t, k) * n * sizeof(float);
  const std::function<void(size_t)> task_fn = [&](size_t task) {
    const size_t t = task / chunks, chunk = task % chunks;
    const size_t count = gated.row_count(t, k);
    const size_t begin = count * chunk / chunks, end = count * (chunk + 1) / chunks;
    const int32_t* rows = gated.dense[t] ? nullptr : gated.rows.data() + gated.offset[t];
    float* out = chunks == 1 ? y + t * n : partial + task * n;
    if (chunks == 1) fill_bias(out, bias, n);
    const float* wbase = w.data();
    if (rows == nullptr) wbase += begin * w.ldw();
    kernels.gemv_rows(wbase, w.ldw(), rows ? rows + begin : nullptr, inputs[t] + begin, end - begin, out, n,
                      chunks == 1 && bias != nullptr);
  };
  BackendStats stats;
  stats.count_decode(m * chunks, gemv_dispatch_->run(runner, m * chunks, stream_bytes, task_fn));
  if (chunks > 1) {
    for (size_t t = 0; t < m; ++t) {  // chunk by chunk: contiguous adds that vectorise
      float* yt = y + t * n;
      const float* p = partial + t * chunks * n;
      for (size_t j = 0; j < n; ++j) yt[j] = (bias ? bias[j] : 0.0f) + p[j];
      for (size_t c = 1; c < chunks; ++c)
        for (size_t j = 0; j < n; ++j) yt[j] += p[c * n + j];
    }
  }
  release_if_large(xv_buffer, partial_buffer, input_buffer);
  return stats;
}

// Prefill: tokens go in tiles of kernels::kTokenTile sharing one row list (the union of their rows, with
// zeros where a token skips a row) when that union is dense enough, else one by one; columns go
// in panels whose W slice stays in L2 while every tile passes over it.
void DenseBackend::run_tiled(const float* x, size_t m, const GatedRows& gated, const float* bias, float* y,
                                 const kernels::MatMulKernels& kernels, const TaskRunner& runner) const {
  const DenseWeights& w = *weights_;
  const size_t k = w.k(), n = w.n();
  const size_t tiles = (m + kernels::kTokenTile - 1) / kernels::kTokenTile;

  struct TilePlan {
    bool shared;                // one union row list for the whole tile
    size_t rows_begin, nrows;   // into union_rows (shared) — per token lists live in `gated`
    size_t xv_begin;            // into xv
  };
  std::vector<TilePlan> plans(tiles);
  std::vector<int32_t> union_rows;
  std::vector<float> xv;
  std::vector<uint8_t> used(k);
  union_rows.reserve(tiles * k);
  for (size_t tile = 0; tile < tiles; ++tile) {
    const size_t t0 = tile * kernels::kTokenTile;
    const size_t count = std::min(kernels::kTokenTile, m - t0);
    TilePlan& plan = plans[tile];
    size_t sum_rows = 0;
    std::fill(used.begin(), used.end(), 0);
    for (size_t j = 0; j < count; ++j) {
      const size_t t = t0 + j;
      sum_rows += gated.row_count(t, k);
      if (gated.dense[t]) {
        for (size_t r = 0; r < k; ++r) used[r] |= static_cast<uint8_t>(1u << j);
      } else {
        for (size_t i = gated.offset[t]; i < gated.offset[t + 1]; ++i) used[gated.rows[i]] |= static_cast<uint8_t>(1u << j);
      }
    }
    size_t union_count = 0;
    for (size_t r = 0; r < k; ++r) union_count += used[r] != 0;
    // A shared row costs ~half a per-token row (the W load is reused by kernels::kTokenTile tokens).
    plan.shared = count == kernels::kTokenTile && union_count * kernels::kTokenTile <= 2 * sum_rows;
    plan.xv_begin = xv.size();
    if (plan.shared) {
      plan.rows_begin = union_rows.size();
      plan.nrows = union_count;
      xv.resize(xv.size() + union_count * kernels::kTokenTile);
      float* dst = xv.data() + plan.xv_begin;
      for (size_t r = 0; r < k; ++r) {
        if (!used[r]) continue;
        union_rows.push_back(static_cast<int32_t>(r));
        for (size_t j = 0; j < kernels::kTokenTile; ++j)
          *dst++ = (used[r] >> j) & 1 ? x[(t0 + j) * k + r] * gated.scale[t0 + j] : 0.0f;
      }
    } else {
      plan.rows_begin = 0;
      plan.nrows = 0;
      xv.resize(xv.size() + count * k);
      for (size_t j = 0; j < count; ++j) gather_token(x + (t0 + j) * k, gated, t0 + j, k, xv.data() + plan.xv_begin + j * k);
    }
  }

  const size_t panel_cols = std::max<size_t>(64, tuning_.panel_bytes / (k * sizeof(float)) / 64 * 64);
  const ColumnSpans spans(n, (n + panel_cols - 1) / panel_cols);
  runner.run(spans.count, [&](size_t task) {
    const size_t col = spans.begin(task), width = spans.width(task);
    const float* wp = w.data() + col;
    for (size_t tile = 0; tile < tiles; ++tile) {
      const TilePlan& plan = plans[tile];
      const size_t t0 = tile * kernels::kTokenTile;
      const size_t count = std::min(kernels::kTokenTile, m - t0);
      for (size_t j = 0; j < count; ++j) fill_bias(y + (t0 + j) * n + col, bias ? bias + col : nullptr, width);
      if (plan.shared) {
        kernels.gemm_rows(wp, w.ldw(), union_rows.data() + plan.rows_begin, xv.data() + plan.xv_begin, plan.nrows,
                          y + t0 * n + col, n, width, bias != nullptr);
      } else {
        for (size_t j = 0; j < count; ++j) {
          const size_t t = t0 + j;
          const int32_t* rows = gated.dense[t] ? nullptr : gated.rows.data() + gated.offset[t];
          kernels.gemv_rows(wp, w.ldw(), rows, xv.data() + plan.xv_begin + j * k, gated.row_count(t, k),
                            y + t * n + col, width, bias != nullptr);
        }
      }
    }
  });
}

}  // namespace ortsparse::engine
