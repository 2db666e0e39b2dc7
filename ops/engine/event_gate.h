// The `event` input gate: per row stream, refresh only the K-blocks whose input changed most since
// the input last used for them, and reuse the rest. Implemented as delta coding over the weight
// backend: the gate picks the refreshed rows, the backend computes the product of the DELTA inputs
// over them (WeightProduct), and the result is added onto the stream's previous output, so a stream
// keeps O(K + N) state (x_ref, y, ages) instead of per-block partial products. A kwta gate may act
// as its prior: the event ordering then runs among the blocks the kwta rule keeps (one ordering).
// See docs/ops.md#eventdrivenmatmul for the semantics (ages, staleness weights, budget, gap check).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine/gated_rows.h"
#include "engine/input_gate.h"
#include "engine/kwta_gate.h"
#include "kernels/kernel_set.h"

namespace ortsparse::engine {

enum class EventAxis { kSequence, kCall };
EventAxis parse_event_axis(const std::string& name);  // throws Error naming the valid values

struct EventConfig {
  EventAxis axis = EventAxis::kSequence;
  double topk = 0.4;           // fraction of blocks refreshed per row (ceil, at least 1)
  float delta_theta = 0.01f;   // refresh only blocks with delta > delta_theta * ||x_b||
  float stale_beta = 1.0f;     // weight of a reused block: stale_beta * exp(-stale_lambda * age)
  float stale_lambda = 0.0f;
  int64_t age_max = 0;         // > 0: no block is reused for more than age_max rows
  double budget_ms = 0.0;      // per row deadline; 0 = none
  double quorum = 0.6;         // fraction of the selected blocks computed even past the deadline
  int64_t gap_every = 64;      // every gap_every-th event row also computes the dense row; 0 = never
  float gap_tol = 0.03f;       // gap above this switches the kernel to dense until a reset
  double kwta_k = 0.0;         // > 0: KWTA prior (the adapter builds it), candidates = top ceil(kwta_k * blocks) by ||x_b||
  int64_t max_gated_rows = 0;  // > 0: a call with more rows runs dense (prefill) and resyncs the streams (composer option)
};

class EventGate final : public InputGate {
 public:
  // prior: a kwta gate (l2 score) whose kept blocks are the event rule's candidates, or null.
  EventGate(BlockPartition partition, EventConfig config, std::unique_ptr<KwtaGate> prior = nullptr);

  const BlockPartition& partition() const override { return partition_; }
  const EventConfig& config() const { return config_; }
  size_t refresh_count() const { return refresh_count_; }
  bool enabled() const;

  // Rows b * seq + s of the call are position s of stream b. axis sequence: stream b's rows are
  // consecutive tokens continuing its previous call; axis call: row (b, s) continues row (b, s) of
  // the previous call (fresh when the previous call had no such row). call.reset clears every
  // stream and re-arms an auto-disabled gate before the call runs; call.dense (prefill) computes
  // every row and resyncs the streams. Calls are serialised by a mutex: concurrent callers share
  // the streams.
  GateStats apply(const GateCall& call, const WeightProduct& product, const kernels::KernelSet& kernels) override;

 private:
  struct Stream {
    std::vector<float> x_ref;   // [K] input last used per block
    std::vector<float> y;       // [N] current output without bias
    std::vector<float> fresh;   // [N] product of the blocks refreshed on the last row (stale_beta < 1 only)
    std::vector<uint32_t> age;  // [blocks] rows since the block was last refreshed
    bool live = false;
    bool finite = true;         // y has no NaN/Inf (else the next row is dense: delta coding would keep it)
    // Sum of max|delta product| since y was last computed densely: y's accumulated rounding error
    // is at most ~eps * drift, so when drift outgrows max|y| (a spike came and went: y carries
    // +big - big) the row is recomputed densely instead of carrying the error.
    double drift = 0.0;
    bool resync = false;        // this row's drift went over the limit: recompute it densely
  };
  // One row of a wave (rows of a wave are independent, so they share one backend run).
  struct RowPlan {
    size_t row;
    Stream* stream;
    bool dense;             // full product of x (fresh stream, disabled kernel, or every block selected)
    bool gap_check;
    size_t order_begin;     // refreshed blocks: order_[order_begin .. +order_count), forced first, then by delta
    size_t order_count;
    size_t forced_count;    // the forced (age_max) blocks lead the order
    size_t quorum_count;    // the first quorum_count blocks are computed whatever the deadline
  };

  Stream& stream_at(size_t b, size_t s);
  void plan_row(const float* xr, size_t wave_rows, RowPlan& plan, const kernels::KernelSet& kernels, GateStats& stats);
  void run_dense_call(const GateCall& call, const WeightProduct& product);
  void run_wave(const float* x, std::vector<RowPlan>& wave, const float* bias, float* y, const WeightProduct& product,
                GateStats& stats);
  // run_wave's steps: the wave without a deadline (dense rows in one product, gated rows one by
  // one), with one (row by row, chunks between clock reads), and the wave's gap checks.
  void run_wave_unbounded(const float* x, std::vector<RowPlan>& wave, const float* bias, float* y,
                          const WeightProduct& product, GateStats& stats);
  void run_wave_deadline(const float* x, std::vector<RowPlan>& wave, const float* bias, float* y,
                         const WeightProduct& product, GateStats& stats);
  void check_gaps(const float* x, const std::vector<RowPlan>& wave, const float* bias, float* y,
                  const WeightProduct& product, GateStats& stats);
  // y's row of `plan`: its stream's output plus the bias.
  void finish_row(const RowPlan& plan, const float* bias, float* y) const;
  // The stream update after its refreshed blocks order_[begin, begin + done) were computed.
  void commit_row(const float* xr, const RowPlan& plan, size_t done, const float* delta_product,
                  const float* fresh_product);
  // Recomputes densely the rows of `wave` (indices `rows`) whose stream drifted, and writes their y.
  void resync_rows(const float* x, const std::vector<RowPlan>& wave, const std::vector<size_t>& rows,
                   const float* bias, float* y, const WeightProduct& product, GateStats& stats);
  void set_dense_state(const float* xr, Stream& s, const float* product);
  // Delta inputs of the refreshed blocks of a row: x - c * x_ref with c the weight the block would
  // have had if reused (1 in exact mode).
  void write_delta(const float* xr, const Stream& s, const int32_t* blocks, size_t count, float* d) const;

  BlockPartition partition_;
  EventConfig config_;
  std::unique_ptr<KwtaGate> prior_;
  size_t n_ = 0;  // outputs, known from the first product
  size_t refresh_count_ = 1;
  bool exact_weights_ = true;  // stale_beta == 1 and stale_lambda == 0
  float decay_ = 1.0f;         // exp(-stale_lambda)

  mutable std::mutex mutex_;
  bool enabled_ = true;
  uint64_t gap_counter_ = 0;
  size_t prev_batch_ = 0, prev_seq_ = 0;  // axis call: the previous call's shape
  std::vector<std::vector<Stream>> streams_;  // [batch][position] (sequence axis: position 0)

  // Scratch reused across calls (guarded by mutex_).
  std::vector<float> sq_delta_, energy_, prior_keys_, masked_;
  std::vector<uint8_t> candidate_;
  std::vector<int32_t> kept_, forced_;
  std::vector<uint32_t> select_scratch_;
  std::vector<int32_t> order_;
  std::vector<float> inputs_, out_, fresh_out_, dense_out_;
  std::vector<size_t> dense_rows_, resync_rows_;
  GatedRows gated_;
};

}  // namespace ortsparse::engine
