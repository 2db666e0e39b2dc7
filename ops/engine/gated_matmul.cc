#include "engine/gated_matmul.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "common/error.h"
#include "common/scratch.h"

namespace ortsparse::engine {
namespace {

// The backend bound to one call's kernels and threads; counts the backend's work over every
// product the gate asks for.
class BoundProduct final : public WeightProduct {
 public:
  BoundProduct(const WeightBackend& backend, const kernels::KernelSet& kernels, const TaskRunner& runner)
      : backend_(backend), kernels_(kernels), runner_(runner) {}
  size_t k() const override { return backend_.k(); }
  size_t n() const override { return backend_.n(); }
  void operator()(const float* x, size_t m, const GatedRows& rows, const float* bias, float* y) const override {
    const BackendStats s = backend_.run(x, m, rows, bias, y, kernels_, runner_);
    stats.blocks += s.blocks;
    stats.unit_passes += s.unit_passes;
    stats.decode_calls += s.decode_calls;
    stats.decode_pool_calls += s.decode_pool_calls;
  }
  mutable BackendStats stats;

 private:
  const WeightBackend& backend_;
  const kernels::KernelSet& kernels_;
  const TaskRunner& runner_;
};

// Any NaN or +-Inf: exponent bits all set. Integer test so the loop vectorises under strict FP.
bool has_nonfinite(const float* v, size_t count) {
  uint32_t any = 0;
  for (size_t i = 0; i < count; ++i) {
    uint32_t bits;
    std::memcpy(&bits, v + i, sizeof bits);
    any |= static_cast<uint32_t>((bits & 0x7F800000u) == 0x7F800000u);
  }
  return any != 0;
}

}  // namespace

std::vector<float> WeightBackend::block_norms(const BlockPartition& partition) const {
  // Row r of W is the product of the unit input e_r: probe a few rows at a time.
  constexpr size_t kProbeRows = 64;
  const size_t k_rows = k(), n_cols = n();
  std::vector<double> row_sq(k_rows, 0.0);
  std::vector<float> x(kProbeRows * k_rows), y(kProbeRows * n_cols);
  GatedRows every;
  for (size_t r0 = 0; r0 < k_rows; r0 += kProbeRows) {
    const size_t count = std::min(kProbeRows, k_rows - r0);
    std::fill(x.begin(), x.end(), 0.0f);
    every.clear();
    for (size_t i = 0; i < count; ++i) {
      x[i * k_rows + r0 + i] = 1.0f;
      every.add_dense_token();
    }
    run(x.data(), count, every, nullptr, y.data(), kernels::kernel_set(Isa::kScalar, kernels::PopcntPath::kPortable),
        SerialTaskRunner());
    for (size_t i = 0; i < count; ++i)
      for (size_t j = 0; j < n_cols; ++j) row_sq[r0 + i] += static_cast<double>(y[i * n_cols + j]) * y[i * n_cols + j];
  }
  std::vector<float> norms(partition.num_blocks, 0.0f);
  for (size_t b = 0; b < partition.num_blocks; ++b) {
    double s = 0.0;
    for (size_t r = partition.begin(b); r < partition.end(b); ++r) s += row_sq[r];
    norms[b] = static_cast<float>(std::sqrt(s));
  }
  return norms;
}

GateStats RowGate::apply(const GateCall& call, const WeightProduct& product, const kernels::KernelSet& kernels) {
  thread_local GatedRows rows;  // reused: a decode step allocates nothing
  const size_t m = call.rows();
  GateStats stats = plan(call.x, m, call.dense, kernels, rows);
  stats.rows = m;
  product(call.x, m, rows, call.bias, call.y);
  rows.release_if_large();
  return stats;
}

GateStats DenseGate::plan(const float*, size_t m, bool, const kernels::KernelSet&, GatedRows& out) {
  out.clear();
  for (size_t t = 0; t < m; ++t) out.add_dense_token();
  return GateStats{};
}

GatedMatMul::GatedMatMul(std::unique_ptr<InputGate> gate, std::shared_ptr<const WeightBackend> backend,
                         GatedMatMulOptions options)
    : gate_(std::move(gate)), backend_(std::move(backend)), options_(std::move(options)) {
  if (!gate_) gate_ = std::make_unique<DenseGate>(BlockPartition(backend_->k(), 1));
  if (gate_->partition().k != backend_->k())
    fail("the input gate covers K=", gate_->partition().k, " inputs but the weights have K=", backend_->k());
  if (options_.glu != Glu::kNone && backend_->n() % 2 != 0)
    fail("a GLU epilogue needs an even N (two halves, gate and up), got N=", backend_->n());
  if (options_.fallback && (options_.fallback->k() != backend_->k() || options_.fallback->n() != backend_->n()))
    fail("the fallback weights are [", options_.fallback->k(), ", ", options_.fallback->n(), "], not [",
         backend_->k(), ", ", backend_->n(), "]");
}

MatMulStats GatedMatMul::run(const float* x, size_t batch, size_t seq, const float* bias, float* y, bool reset,
                             const kernels::KernelSet& kernels, const TaskRunner& runner) const {
  MatMulStats stats;
  GateCall call;
  call.x = x;
  call.batch = batch;
  call.seq = seq;
  call.bias = bias;
  call.reset = reset;
  const size_t m = call.rows(), n_cols = backend_->n();
  // With an epilogue the product goes to a per-thread buffer first (kept: a decode step allocates nothing).
  thread_local std::vector<float> product_buffer;
  const bool epilogue = options_.glu != Glu::kNone;
  if (epilogue && product_buffer.size() < m * n_cols) product_buffer.resize(m * n_cols);
  float* const product_out = epilogue ? product_buffer.data() : y;
  call.y = product_out;
  call.dense = options_.max_gated_rows > 0 && m > static_cast<size_t>(options_.max_gated_rows);
  const BoundProduct product(*backend_, kernels, runner);
  stats.gate = gate_->apply(call, product, kernels);
  stats.backend = product.stats;
  if (options_.nan_guard && m > 0 && has_nonfinite(product_out, m * n_cols) && !has_nonfinite(x, m * backend_->k())) {
    if (!options_.fallback)
      fail("output has NaN/Inf while input X is finite: the approximate weights overflow on this input. Rebuild "
           "the layer (e.g. a lower rank) or keep it dense, or keep the dense fallback weight (input W_dense)");
    GatedRows every;
    for (size_t t = 0; t < m; ++t) every.add_dense_token();
    options_.fallback->run(x, m, every, bias, product_out, kernels, runner);
    stats.nan_fallback = true;
  }
  if (epilogue) {
    const size_t half = n_cols / 2;
    for (size_t r = 0; r < m; ++r)
      kernels.matmul->silu_glu(product_out + r * n_cols, product_out + r * n_cols + half, half, y + r * half);
    release_if_large(product_buffer);  // a prefill's buffer is not kept for the decode steps
  }
  return stats;
}

}  // namespace ortsparse::engine
