// Per-node counters readable from Python (ortsparse.metrics()). A kernel bumps a few relaxed
// atomics once per Run, so counting costs nothing measurable.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace ortsparse {

// Turns raw counts into the published metrics (e.g. keep_ratio = kept / total).
using MetricsDescriber = std::vector<std::pair<std::string, double>> (*)(const uint64_t* counts,
                                                                        const double* constants);

class MetricsSlot {
 public:
  static constexpr size_t kMaxCounts = 16;
  static constexpr size_t kMaxConstants = 8;

  MetricsSlot(std::string op_type, std::string node_name, MetricsDescriber describer);

  void add(size_t counter, uint64_t value) { counts_[counter].fetch_add(value, std::memory_order_relaxed); }
  void set_constant(size_t index, double value) { constants_[index].store(value, std::memory_order_relaxed); }

  const std::string& op_type() const { return op_type_; }
  const std::string& node_name() const { return node_name_; }
  std::array<uint64_t, kMaxCounts> snapshot_counts() const;
  std::array<double, kMaxConstants> snapshot_constants() const;
  MetricsDescriber describer() const { return describer_; }
  void reset();

 private:
  std::string op_type_;
  std::string node_name_;
  MetricsDescriber describer_;
  std::array<std::atomic<uint64_t>, kMaxCounts> counts_{};
  std::array<std::atomic<double>, kMaxConstants> constants_{};
};

// Returns the slot for (op_type, node_name), creating it on first use. Kernels of the same node in
// several sessions share one slot: their counters add up.
std::shared_ptr<MetricsSlot> metrics_slot(const std::string& op_type, const std::string& node_name,
                                          MetricsDescriber describer);

// JSON object: {"<node>": {"op": "...", "<metric>": value, ...}, "total/<op>": {...}}
std::string metrics_json();
void reset_metrics();

}  // namespace ortsparse
