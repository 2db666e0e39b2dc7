#include "common/metrics.h"

#include <cmath>
#include <map>
#include <mutex>
#include <sstream>

namespace ortsparse {
namespace {

struct Registry {
  std::mutex mutex;
  std::map<std::pair<std::string, std::string>, std::shared_ptr<MetricsSlot>> slots;
};

Registry& registry() {
  static Registry* instance = new Registry();  // never destroyed: kernels may outlive static teardown
  return *instance;
}

void write_json_string(std::ostringstream& out, const std::string& text) {
  out << '"';
  for (char c : text) {
    switch (c) {
      case '"': out << "\\\""; break;
      case '\\': out << "\\\\"; break;
      case '\n': out << "\\n"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          out << "\\u00" << "0123456789abcdef"[(c >> 4) & 0xF] << "0123456789abcdef"[c & 0xF];
        } else {
          out << c;
        }
    }
  }
  out << '"';
}

void write_entry(std::ostringstream& out, const std::string& key, const std::string& op_type,
                 const std::vector<std::pair<std::string, double>>& values) {
  write_json_string(out, key);
  out << ":{\"op\":";
  write_json_string(out, op_type);
  for (const auto& kv : values) {
    out << ',';
    write_json_string(out, kv.first);
    out << ':';
    if (std::isfinite(kv.second)) {
      out.precision(17);
      out << kv.second;
    } else {
      out << "null";
    }
  }
  out << '}';
}

}  // namespace

MetricsSlot::MetricsSlot(std::string op_type, std::string node_name, MetricsDescriber describer)
    : op_type_(std::move(op_type)), node_name_(std::move(node_name)), describer_(describer) {
  reset();
  for (auto& c : constants_) c.store(0.0, std::memory_order_relaxed);
}

std::array<uint64_t, MetricsSlot::kMaxCounts> MetricsSlot::snapshot_counts() const {
  std::array<uint64_t, kMaxCounts> out{};
  for (size_t i = 0; i < kMaxCounts; ++i) out[i] = counts_[i].load(std::memory_order_relaxed);
  return out;
}

std::array<double, MetricsSlot::kMaxConstants> MetricsSlot::snapshot_constants() const {
  std::array<double, kMaxConstants> out{};
  for (size_t i = 0; i < kMaxConstants; ++i) out[i] = constants_[i].load(std::memory_order_relaxed);
  return out;
}

void MetricsSlot::reset() {
  for (auto& c : counts_) c.store(0, std::memory_order_relaxed);
}

std::shared_ptr<MetricsSlot> metrics_slot(const std::string& op_type, const std::string& node_name,
                                          MetricsDescriber describer) {
  Registry& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mutex);
  auto& slot = reg.slots[{op_type, node_name}];
  if (!slot) slot = std::make_shared<MetricsSlot>(op_type, node_name, describer);
  return slot;
}

std::string metrics_json() {
  Registry& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mutex);
  std::ostringstream out;
  out << '{';
  bool first = true;
  // Totals: counts summed per op type; constants from the last slot seen (they are per node).
  std::map<std::string, std::pair<std::array<uint64_t, MetricsSlot::kMaxCounts>, const MetricsSlot*>> totals;
  for (const auto& entry : reg.slots) {
    const MetricsSlot& slot = *entry.second;
    const auto counts = slot.snapshot_counts();
    const auto constants = slot.snapshot_constants();
    if (!first) out << ',';
    first = false;
    write_entry(out, slot.node_name(), slot.op_type(), slot.describer()(counts.data(), constants.data()));
    auto& total = totals[slot.op_type()];
    for (size_t i = 0; i < counts.size(); ++i) total.first[i] += counts[i];
    total.second = &slot;
  }
  for (const auto& entry : totals) {
    const auto constants = entry.second.second->snapshot_constants();
    auto values = entry.second.second->describer()(entry.second.first.data(), constants.data());
    if (!first) out << ',';
    first = false;
    write_entry(out, "total/" + entry.first, entry.first, values);
  }
  out << '}';
  return out.str();
}

void reset_metrics() {
  Registry& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mutex);
  for (auto& entry : reg.slots) entry.second->reset();
}

}  // namespace ortsparse
