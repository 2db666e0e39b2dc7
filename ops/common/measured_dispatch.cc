#include "common/measured_dispatch.h"

#include <algorithm>
#include <chrono>

namespace ortsparse {

namespace {
double median(std::vector<double> values) {
  const size_t mid = values.size() / 2;
  std::nth_element(values.begin(), values.begin() + static_cast<std::ptrdiff_t>(mid), values.end());
  return values[mid];
}
}  // namespace

bool MeasuredDispatch::run(const TaskRunner& pool, size_t n_tasks, size_t work_units,
                           const std::function<void(size_t)>& fn) {
  const SerialTaskRunner serial;
  if (n_tasks < 2 || work_units < settings_.min_units) {
    serial.run(n_tasks, fn);
    return false;
  }
  if (!settings_.measure) {
    pool.run(n_tasks, fn);
    return true;
  }
  const Choice choice = next();
  const auto started = std::chrono::steady_clock::now();
  (choice.pool ? pool : static_cast<const TaskRunner&>(serial)).run(n_tasks, fn);
  if (choice.timed) {
    const std::chrono::duration<double> took = std::chrono::steady_clock::now() - started;
    record(choice, took.count() / static_cast<double>(std::max<size_t>(1, work_units)));
  }
  return choice.pool;
}

MeasuredDispatch::Choice MeasuredDispatch::next() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!in_trial_ && ++calls_since_trial_ >= settings_.recheck_every) {
    in_trial_ = true;
    serial_.clear();
    pool_.clear();
  }
  if (!in_trial_) return {pool_chosen_, false};
  // Alternate, so that both ways see the same moments of the machine; a way that has its samples
  // (concurrent Runs took more) leaves the calls to the other.
  if (serial_.size() >= settings_.trial_calls) return {true, true};
  if (pool_.size() >= settings_.trial_calls) return {false, true};
  return {pool_.size() < serial_.size(), true};
}

void MeasuredDispatch::record(const Choice& choice, double seconds_per_unit) {
  if (!choice.timed) return;
  std::lock_guard<std::mutex> lock(mutex_);
  if (!in_trial_) return;  // a concurrent call finished the trial first
  (choice.pool ? pool_ : serial_).push_back(seconds_per_unit);
  if (serial_.size() < settings_.trial_calls || pool_.size() < settings_.trial_calls) return;
  // Medians: one call the OS interrupted does not decide.
  pool_chosen_ = median(pool_) < median(serial_);
  in_trial_ = false;
  calls_since_trial_ = 0;
  ++trials_;
}

bool MeasuredDispatch::uses_pool() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return pool_chosen_;
}

uint64_t MeasuredDispatch::trials() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return trials_;
}

}  // namespace ortsparse
