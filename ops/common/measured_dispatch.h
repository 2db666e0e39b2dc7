// Whether a node's decode tasks go to the intra-op pool or run on the calling thread, chosen by
// timing both on this node, in this session, on this machine.
//
// Why measured: what a second thread is worth depends on things a kernel cannot read. With ORT's
// pool spinning (its default) handing tasks over costs ~1 us and every layer of SmolLM2 gains from
// two threads; with spinning off (session.intra_op.allow_spinning=0) waking a sleeping thread
// costs more than a small layer's second task saves; a program busy on the other core changes it
// again. ORT's C API (version 21) does not tell a custom op its pool's size or spinning setting.
// Only the dispatch changes — the same tasks, partial sums and reduction order — so results do not.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <vector>

#include "common/task_runner.h"

namespace ortsparse {

class MeasuredDispatch {
 public:
  struct Settings {
    size_t trial_calls = 8;       // timed calls of each way before choosing
    size_t recheck_every = 1024;  // calls between trials (the machine's load changes)
    size_t min_units = 0;         // calls of less work run on the calling thread, untimed (too small to pay)
    bool measure = true;          // false: every call of more than one task on the pool (tests)

    static Settings from_units(size_t min_units) {
      Settings settings;
      settings.min_units = min_units;
      return settings;
    }
  };

  // The way one call runs; `timed`: pass its time to record().
  struct Choice {
    bool pool = false;
    bool timed = false;
  };

  MeasuredDispatch() = default;
  explicit MeasuredDispatch(Settings settings) : settings_(settings) {}

  // Runs fn(0..n_tasks) on `pool` or on the calling thread, as chosen, and times it when it is a
  // trial's sample; `work_units` (e.g. the weight bytes the call streams: a gated layer's kept rows
  // change from call to call) normalises the samples. A single task, or less work than min_units,
  // runs on the calling thread. Returns whether the pool ran it.
  bool run(const TaskRunner& pool, size_t n_tasks, size_t work_units, const std::function<void(size_t)>& fn);

  // The steps of run(), for tests: the way of the next call, and a timed call's seconds per unit.
  Choice next();
  void record(const Choice& choice, double seconds_per_unit);

  // The current choice (before the first trial ends: the calling thread).
  bool uses_pool() const;
  // Trials completed so far (tests, metrics).
  uint64_t trials() const;

 private:
  Settings settings_;
  mutable std::mutex mutex_;
  std::vector<double> serial_, pool_;  // this trial's samples
  bool pool_chosen_ = false;
  bool in_trial_ = true;
  size_t calls_since_trial_ = 0;
  uint64_t trials_ = 0;
};

}  // namespace ortsparse
