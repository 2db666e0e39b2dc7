// How the engine splits work over threads: ORT's intra-op pool in the op library, a plain loop
// in the pybind module. Tasks must not throw (they run on ORT's threads).
#pragma once

#include <cstddef>
#include <functional>

namespace ortsparse {

class TaskRunner {
 public:
  virtual ~TaskRunner() = default;
  // Calls fn(i) for i in [0, n_tasks), possibly concurrently; returns when all are done.
  virtual void run(size_t n_tasks, const std::function<void(size_t)>& fn) const = 0;
};

class SerialTaskRunner final : public TaskRunner {
 public:
  void run(size_t n_tasks, const std::function<void(size_t)>& fn) const override {
    for (size_t i = 0; i < n_tasks; ++i) fn(i);
  }
};

}  // namespace ortsparse
