#include "common/metrics.h"

#include <cmath>
#include <map>
#include <sstream>

namespace ortsparse {

// The registry's view of a slot's private state (declared a friend in metrics.h).
struct MetricsRegistryAccess {
  static bool& retired(MetricsSlot& slot) { return slot.retired_; }
};

namespace {

thread_local MetricsBatch* t_open_batch = nullptr;

// Counts of the slots whose kernels are gone, per op type, with the constants and describer of the
// last one (constants are per node; a total shows the last node's, as it does for live nodes).
struct RetiredTotal {
  MetricsSlot::Counts counts{};
  MetricsSlot::Constants constants{};
  MetricsDescriber describer = nullptr;
};

struct Entry {
  std::weak_ptr<MetricsSlot> owner;  // expired once every kernel holding the slot is gone
  MetricsSlot* slot = nullptr;       // valid while in the map: the deleter removes it under the lock
};

struct Registry {
  // Recursive: if allocating a shared_ptr's control block throws inside metrics_slot(), the
  // deleter runs on the same thread with the lock held.
  std::recursive_mutex mutex;
  std::map<std::string, std::map<std::string, Entry>> slots;  // op type -> node name -> slot
  std::map<std::string, RetiredTotal> retired;
};

Registry& registry() {
  static Registry* instance = new Registry();  // never destroyed: kernels may outlive static teardown
  return *instance;
}

bool any_nonzero(const MetricsSlot::Counts& counts) {
  for (uint64_t c : counts)
    if (c != 0) return true;
  return false;
}

// Registry lock held. Moves the slot's counts into its op type's total, once. A slot that never
// counted anything (a kernel that never ran, a failed session creation) leaves nothing behind.
void retire_locked(Registry& reg, MetricsSlot& slot) {
  bool& retired = MetricsRegistryAccess::retired(slot);
  if (retired) return;
  retired = true;
  const MetricsSlot::Counts counts = slot.snapshot_counts();
  if (!any_nonzero(counts)) return;
  RetiredTotal& total = reg.retired[slot.op_type()];
  for (size_t i = 0; i < counts.size(); ++i) total.counts[i] += counts[i];
  total.constants = slot.snapshot_constants();
  total.describer = slot.describer();
}

// shared_ptr deleter: the last kernel holding the slot is gone.
void delete_slot(MetricsSlot* slot) {
  {
    Registry& reg = registry();
    std::lock_guard<std::recursive_mutex> lock(reg.mutex);
    retire_locked(reg, *slot);
    auto op = reg.slots.find(slot->op_type());
    if (op != reg.slots.end()) {
      auto node = op->second.find(slot->node_name());
      if (node != op->second.end() && node->second.slot == slot) op->second.erase(node);
      if (op->second.empty()) reg.slots.erase(op);
    }
  }
  delete slot;
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

void write_entry(std::ostringstream& out, bool& first, const std::string& key, const std::string& op_type,
                 const std::string* node_name, const std::vector<std::pair<std::string, double>>& values) {
  if (!first) out << ',';
  first = false;
  write_json_string(out, key);
  out << ":{\"op\":";
  write_json_string(out, op_type);
  if (node_name != nullptr) {
    out << ",\"node\":";
    write_json_string(out, *node_name);
  }
  for (const auto& kv : values) {
    out << ',';
    write_json_string(out, kv.first);
    out << ':';
    if (std::isfinite(kv.second)) {
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
  for (auto& c : counts_) c.store(0, std::memory_order_relaxed);
  for (auto& c : constants_) c.store(0.0, std::memory_order_relaxed);
}

void MetricsSlot::add(size_t counter, uint64_t value) {
  MetricsBatch* batch = t_open_batch;
  if (batch != nullptr && batch->stage(this, counter, value)) return;
  counts_[counter].fetch_add(value, std::memory_order_relaxed);
}

void MetricsSlot::publish(const Counts& staged) {
  std::lock_guard<std::mutex> lock(batch_mutex_);
  for (size_t i = 0; i < kMaxCounts; ++i)
    if (staged[i] != 0) counts_[i].fetch_add(staged[i], std::memory_order_relaxed);
}

MetricsSlot::Counts MetricsSlot::snapshot_counts() const {
  Counts out{};
  std::lock_guard<std::mutex> lock(batch_mutex_);
  for (size_t i = 0; i < kMaxCounts; ++i) out[i] = counts_[i].load(std::memory_order_relaxed);
  return out;
}

MetricsSlot::Constants MetricsSlot::snapshot_constants() const {
  Constants out{};
  for (size_t i = 0; i < kMaxConstants; ++i) out[i] = constants_[i].load(std::memory_order_relaxed);
  return out;
}

void MetricsSlot::reset() {
  std::lock_guard<std::mutex> lock(batch_mutex_);
  for (auto& c : counts_) c.store(0, std::memory_order_relaxed);
}

MetricsBatch::MetricsBatch() : outer_(t_open_batch) {
  if (outer_ == nullptr) t_open_batch = this;
}

MetricsBatch::~MetricsBatch() {
  if (t_open_batch != this) return;  // nested: the outermost batch publishes
  publish_all();
  t_open_batch = nullptr;
}

bool MetricsBatch::stage(MetricsSlot* slot, size_t counter, uint64_t value) {
  size_t index = 0;
  while (index < used_ && slots_[index] != slot) ++index;
  if (index == used_) {
    if (used_ == kMaxSlots) {
      publish_all();
      index = 0;
    }
    slots_[index] = slot;
    staged_[index].fill(0);
    used_ = index + 1;
  }
  staged_[index][counter] += value;
  return true;
}

void MetricsBatch::publish_all() {
  for (size_t i = 0; i < used_; ++i) slots_[i]->publish(staged_[i]);
  used_ = 0;
}

std::shared_ptr<MetricsSlot> metrics_slot(const std::string& op_type, const std::string& node_name,
                                          MetricsDescriber describer) {
  Registry& reg = registry();
  std::lock_guard<std::recursive_mutex> lock(reg.mutex);
  Entry& entry = reg.slots[op_type][node_name];
  if (std::shared_ptr<MetricsSlot> live = entry.owner.lock()) return live;
  // The previous kernels of this node are gone but their deleter still waits for the lock: retire
  // the old slot now so its counts are never missing from the total.
  if (entry.slot != nullptr) retire_locked(reg, *entry.slot);
  entry = Entry{};
  std::shared_ptr<MetricsSlot> slot(new MetricsSlot(op_type, node_name, describer), delete_slot);
  entry.owner = slot;
  entry.slot = slot.get();
  return slot;
}

std::string metrics_json() {
  Registry& reg = registry();
  std::lock_guard<std::recursive_mutex> lock(reg.mutex);
  std::ostringstream out;
  out.precision(17);
  out << '{';
  bool first = true;
  std::map<std::string, RetiredTotal> totals = reg.retired;  // plus the live slots, below
  for (const auto& op : reg.slots) {
    for (const auto& node : op.second) {
      MetricsSlot* slot = node.second.slot;
      if (slot == nullptr || MetricsRegistryAccess::retired(*slot)) continue;
      const MetricsSlot::Counts counts = slot->snapshot_counts();
      const MetricsSlot::Constants constants = slot->snapshot_constants();
      RetiredTotal& total = totals[op.first];
      for (size_t i = 0; i < counts.size(); ++i) total.counts[i] += counts[i];
      total.constants = constants;
      total.describer = slot->describer();
      // A slot whose kernels are gone but whose deleter waits for this lock still counts in the
      // total; it is no longer listed.
      if (!node.second.owner.expired())
        write_entry(out, first, op.first + "/" + node.first, op.first, &node.first,
                    slot->describer()(counts.data(), constants.data()));
    }
  }
  for (const auto& total : totals) {
    if (total.second.describer == nullptr) continue;
    write_entry(out, first, "total/" + total.first, total.first, nullptr,
                total.second.describer(total.second.counts.data(), total.second.constants.data()));
  }
  out << '}';
  return out.str();
}

void reset_metrics() {
  Registry& reg = registry();
  std::lock_guard<std::recursive_mutex> lock(reg.mutex);
  for (auto& op : reg.slots)
    for (auto& node : op.second)
      if (node.second.slot != nullptr) node.second.slot->reset();
  reg.retired.clear();
}

}  // namespace ortsparse
