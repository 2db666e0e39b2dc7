// Per-node counters readable from Python (ortsparse.metrics()). A kernel bumps a few relaxed
// atomics once per Run, so counting costs nothing measurable.
//
// Lifetime: a slot lives as long as some kernel holds it (kernels of the same op type and node name
// in several sessions share one slot). When the last holder goes, the slot leaves the registry and
// its counts move into its op type's total, so `metrics()` only lists live kernels while the totals
// keep counting everything since the last reset_metrics().
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace ortsparse {

// Turns raw counts into the published metrics (e.g. keep_ratio = kept / total).
using MetricsDescriber = std::vector<std::pair<std::string, double>> (*)(const uint64_t* counts,
                                                                        const double* constants);

class MetricsSlot {
 public:
  static constexpr size_t kMaxCounts = 20;
  static constexpr size_t kMaxConstants = 8;
  using Counts = std::array<uint64_t, kMaxCounts>;
  using Constants = std::array<double, kMaxConstants>;

  MetricsSlot(std::string op_type, std::string node_name, MetricsDescriber describer);
  MetricsSlot(const MetricsSlot&) = delete;
  MetricsSlot& operator=(const MetricsSlot&) = delete;

  // Inside a MetricsBatch (one Compute) the value is staged and published with the batch's other
  // adds; otherwise it is added at once.
  void add(size_t counter, uint64_t value);
  void set_constant(size_t index, double value) { constants_[index].store(value, std::memory_order_relaxed); }

  const std::string& op_type() const { return op_type_; }
  const std::string& node_name() const { return node_name_; }
  // Counts as of one instant between published batches.
  Counts snapshot_counts() const;
  Constants snapshot_constants() const;
  MetricsDescriber describer() const { return describer_; }
  void reset();

 private:
  friend class MetricsBatch;
  friend struct MetricsRegistryAccess;  // metrics.cc: retiring a slot into its op type's total
  void publish(const Counts& staged);

  std::string op_type_;
  std::string node_name_;
  MetricsDescriber describer_;
  mutable std::mutex batch_mutex_;  // publish (a whole batch) vs snapshot / reset
  bool retired_ = false;            // counts already moved into the op type's total (registry lock)
  std::array<std::atomic<uint64_t>, kMaxCounts> counts_{};
  std::array<std::atomic<double>, kMaxConstants> constants_{};
};

// Groups every MetricsSlot::add() made on this thread while it is alive, so a snapshot or a reset
// sees all of one Compute's counts or none of them: a ratio of two counters bumped by the same
// Compute (kept / total) then never exceeds 1, even with reset_metrics() running concurrently.
// Open one around each Compute (the kernel base class does); nesting is allowed (the outermost
// batch publishes).
class MetricsBatch {
 public:
  MetricsBatch();
  ~MetricsBatch();
  MetricsBatch(const MetricsBatch&) = delete;
  MetricsBatch& operator=(const MetricsBatch&) = delete;

 private:
  friend class MetricsSlot;
  static constexpr size_t kMaxSlots = 4;  // a Compute bumps one slot; more are published early
  bool stage(MetricsSlot* slot, size_t counter, uint64_t value);
  void publish_all();

  MetricsBatch* outer_;
  size_t used_ = 0;
  std::array<MetricsSlot*, kMaxSlots> slots_{};
  std::array<MetricsSlot::Counts, kMaxSlots> staged_{};
};

// Returns the slot for (op_type, node_name), creating it on first use. Kernels of the same node in
// several sessions share one slot: their counters add up.
std::shared_ptr<MetricsSlot> metrics_slot(const std::string& op_type, const std::string& node_name,
                                          MetricsDescriber describer);

// JSON object, one consistent snapshot:
//   {"<op type>/<node name>": {"op": "...", "node": "...", "<metric>": value, ...}, ...,
//    "total/<op type>": {"op": "...", "<metric>": value, ...}}
// Op types contain no '/' and none is named "total", so the part before the first '/' tells
// totals from nodes and no two entries share a key, whatever the node names are.
std::string metrics_json();
void reset_metrics();

}  // namespace ortsparse
