// EventDrivenMatMul(X, W, B?, reset?) = the composer with the `event` gate (optionally with a
// kwta gate as its prior) over the dense weight backend. State lives in the kernel instance (one per node and
// session); concurrent Run calls are serialised on it (see docs/ops.md#eventdrivenmatmul).
#include <cmath>
#include <limits>
#include <memory>

#include "common/metrics.h"
#include "engine/dense_backend.h"
#include "engine/event_gate.h"
#include "engine/gated_matmul.h"
#include "engine/kwta_gate.h"
#include "ort/matmul_io.h"
#include "ort/op_schema.h"
#include "ort/ops.h"

namespace ortsparse::ort {
namespace {

using Schema = schema::EventDrivenMatMul;  // attribute defaults: graph_rewrite/op_schema.json

enum Counter {
  kCalls, kRows, kEventRows, kBlocksTotal, kBlocksRefreshed, kBlocksForced, kDeadlineStops, kGapChecks,
  kDisables, kGateNs, kResets, kResyncs
};
enum Constant { kEnabled, kLastGap, kTopk };

std::vector<std::pair<std::string, double>> describe_event(const uint64_t* c, const double* constants) {
  const double total = static_cast<double>(c[kBlocksTotal]);
  const double refreshed = static_cast<double>(c[kBlocksRefreshed]);
  return {
      {"event.enabled", constants[kEnabled]},
      {"event.budget_ms_used", c[kRows] ? static_cast<double>(c[kGateNs]) / 1e6 / static_cast<double>(c[kRows]) : 0.0},
      {"event.quorum_hits", static_cast<double>(c[kDeadlineStops])},
      {"event.topk_kept", total > 0 ? refreshed / total : 1.0},
      {"event.quality_gap", constants[kLastGap]},
      {"event.stale_pct", total > 0 ? 100.0 * (1.0 - refreshed / total) : 0.0},
      {"event.topk", constants[kTopk]},
      {"calls", static_cast<double>(c[kCalls])},
      {"rows", static_cast<double>(c[kRows])},
      {"event_rows", static_cast<double>(c[kEventRows])},
      {"blocks_total", total},
      {"blocks_refreshed", refreshed},
      {"blocks_forced", static_cast<double>(c[kBlocksForced])},
      {"gap_checks", static_cast<double>(c[kGapChecks])},
      {"disables", static_cast<double>(c[kDisables])},
      {"resets", static_cast<double>(c[kResets])},
      {"resyncs", static_cast<double>(c[kResyncs])},
  };
}

engine::EventConfig read_config(const Attributes& attrs) {
  engine::EventConfig c;
  c.axis = engine::parse_event_axis(attrs.get_string("axis", Schema::axis));
  c.topk = attrs.get_float("topk", Schema::topk);
  c.delta_theta = attrs.get_float("delta_theta", Schema::delta_theta);
  c.stale_beta = attrs.get_float("stale_beta", Schema::stale_beta);
  c.stale_lambda = attrs.get_float("stale_lambda", Schema::stale_lambda);
  c.age_max = attrs.get_int("age_max", Schema::age_max);
  c.budget_ms = attrs.get_float("budget_ms", Schema::budget_ms);
  c.quorum = attrs.get_float("quorum", Schema::quorum);
  c.gap_every = attrs.get_int("gap_every", Schema::gap_every);
  c.gap_tol = attrs.get_float("gap_tol", Schema::gap_tol);
  c.kwta_k = attrs.get_float("kwta_k", Schema::kwta_k);
  c.max_gated_rows = attrs.get_int("max_gated_rows", Schema::max_gated_rows);
  if (c.max_gated_rows < 0) fail("attribute max_gated_rows=", c.max_gated_rows, " must be >= 0 (0: gate every call)");
  if (!(c.topk > 0.0 && c.topk <= 1.0)) fail("attribute topk=", c.topk, " must be in (0, 1]");
  if (!(c.delta_theta >= 0.0f && std::isfinite(c.delta_theta)))
    fail("attribute delta_theta=", c.delta_theta, " must be a finite number >= 0");
  if (!(c.stale_beta >= 0.0f && c.stale_beta <= 1.0f)) fail("attribute stale_beta=", c.stale_beta, " must be in [0, 1]");
  if (!(c.stale_lambda >= 0.0f && std::isfinite(c.stale_lambda)))
    fail("attribute stale_lambda=", c.stale_lambda, " must be a finite number >= 0");
  if (c.age_max < 0) fail("attribute age_max=", c.age_max, " must be >= 0 (0: no age limit)");
  if (!(c.budget_ms >= 0.0 && std::isfinite(c.budget_ms)))
    fail("attribute budget_ms=", c.budget_ms, " must be a finite number >= 0 (0: no deadline)");
  if (!(c.quorum >= 0.0 && c.quorum <= 1.0)) fail("attribute quorum=", c.quorum, " must be in [0, 1]");
  if (c.gap_every < 0) fail("attribute gap_every=", c.gap_every, " must be >= 0 (0: no gap check)");
  if (!(c.gap_tol >= 0.0f)) fail("attribute gap_tol=", c.gap_tol, " must be >= 0");
  if (!(c.kwta_k >= 0.0 && c.kwta_k <= 1.0)) fail("attribute kwta_k=", c.kwta_k, " must be in [0, 1] (0: no KWTA prior)");
  return c;
}

class EventDrivenMatMulKernel : public KernelBase<EventDrivenMatMulKernel> {
 public:
  static constexpr const char* kOpName = "EventDrivenMatMul";
  static std::vector<InputSpec> inputs() {
    return {{ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, false},
            {ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, false},
            {ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, true},
            {ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL, true}};
  }
  static size_t output_count() { return 1; }

  EventDrivenMatMulKernel(const OrtApi&, const OrtKernelInfo* info) : KernelBase(kOpName, info) {
    const Attributes attrs(info);
    kernel_set_or_fail();
    const engine::EventConfig config = read_config(attrs);
    const int64_t block = attrs.get_int("block", Schema::block);
    const ConstantTensor w = constant_float_input(info, 1, "W", 2);
    const size_t k = static_cast<size_t>(w.shape[0]), n = static_cast<size_t>(w.shape[1]);
    if (k == 0) fail("input W has shape ", shape_string(w.shape), ": K must be >= 1");
    if (block < 1 || static_cast<size_t>(block) > k) fail("attribute block=", block, " must be in [1, K=", k, "]");
    if (k > static_cast<size_t>(INT32_MAX)) fail("K=", k, " is too large");
    auto backend = std::make_shared<const engine::DenseBackend>(engine::DenseWeights::pack_shared(w.data, k, n));
    const engine::BlockPartition partition(k, static_cast<size_t>(block));
    std::unique_ptr<engine::KwtaGate> prior;
    if (config.kwta_k > 0.0) {  // the KWTA prior: the kwta rule by energy (l2) picks the candidates
      engine::KwtaConfig kwta;
      kwta.k_frac = config.kwta_k;
      prior = std::make_unique<engine::KwtaGate>(partition, kwta, std::vector<float>{});
    }
    auto event = std::make_unique<engine::EventGate>(partition, config, std::move(prior));
    event_ = event.get();
    engine::GatedMatMulOptions options;
    options.max_gated_rows = config.max_gated_rows;
    matmul_ = std::make_unique<engine::GatedMatMul>(std::move(event), std::move(backend), options);
    metrics_ = metrics_slot(kOpName, node(), describe_event);
    metrics_->set_constant(kEnabled, 1.0);
    metrics_->set_constant(kLastGap, std::numeric_limits<double>::quiet_NaN());
    metrics_->set_constant(kTopk, config.topk);
  }

  void Compute(OrtKernelContext* raw_context) {
    Ort::KernelContext context(raw_context);
    const bool reset = read_reset(context);
    const engine::MatMulStats run = run_matmul(raw_context, *matmul_, 2, reset);
    const engine::GateStats& stats = run.gate;
    metrics_->add(kCalls, 1);
    metrics_->add(kRows, stats.rows);
    metrics_->add(kEventRows, stats.event_rows);
    metrics_->add(kBlocksTotal, stats.blocks_total);
    metrics_->add(kBlocksRefreshed, stats.blocks_kept);
    metrics_->add(kBlocksForced, stats.blocks_forced);
    metrics_->add(kDeadlineStops, stats.deadline_stops);
    metrics_->add(kGapChecks, stats.gap_checks);
    metrics_->add(kDisables, stats.disables);
    metrics_->add(kGateNs, stats.gate_ns);
    metrics_->add(kResyncs, stats.resyncs);
    if (reset) metrics_->add(kResets, 1);
    if (stats.last_gap >= 0.0) metrics_->set_constant(kLastGap, stats.last_gap);
    metrics_->set_constant(kEnabled, event_->enabled() ? 1.0 : 0.0);
  }

 private:
  static bool read_reset(Ort::KernelContext& context) {
    if (context.GetInputCount() <= 3) return false;
    Ort::ConstValue r = context.GetInput(3);
    if (!r) return false;
    auto info = r.GetTensorTypeAndShapeInfo();
    if (info.GetElementCount() != 1)
      fail("input reset must be a bool scalar (one value), got shape ", shape_string(info.GetShape()));
    return r.GetTensorData<bool>()[0];
  }

  std::unique_ptr<engine::GatedMatMul> matmul_;
  const engine::EventGate* event_ = nullptr;  // the gate inside matmul_ (its enabled state)
  std::shared_ptr<MetricsSlot> metrics_;
};

}  // namespace

const OrtCustomOp* event_driven_matmul_op() {
  static const OpAdapter<EventDrivenMatMulKernel> op;
  return &op;
}

}  // namespace ortsparse::ort
