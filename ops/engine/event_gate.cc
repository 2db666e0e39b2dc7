#include "engine/event_gate.h"

#include "common/copy.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>

#include "common/error.h"
#include "common/finite.h"
#include "common/named_values.h"
#include "kernels/top_k.h"

namespace ortsparse::engine {

EventAxis parse_event_axis(const std::string& name) {
  static constexpr Named<EventAxis> kNames[] = {{"sequence", EventAxis::kSequence}, {"call", EventAxis::kCall}};
  return parse_named("axis", name, kNames);
}

namespace {

using Clock = std::chrono::steady_clock;

// A fraction of `total` as a count: ceil with the same float32 slack as KWTA's k_frac.
size_t fraction_count(double fraction, size_t total) {
  return static_cast<size_t>(std::ceil(fraction * static_cast<double>(total) * (1.0 - 1e-6)));
}

// Deadline checks happen between chunks of about this many W rows, never inside a kernel.
constexpr size_t kDeadlineChunkRows = 256;

// In waves of more than 2 rows (no deadline), a row refreshing more than this fraction of its
// blocks runs as a dense row (see plan_row).
constexpr double kDenseAbove = 0.5;

// A stream is recomputed densely once its drift (sum of max|delta product| since its last dense
// row) exceeds this multiple of max|y|: fp32 delta coding then keeps y within ~512 * 2^-23 ~ 6e-5
// (worst case) of the dense product. Text decode (deltas ~ |y| every step) resyncs every ~500 rows.
constexpr double kDriftLimit = 512.0;

float max_abs(const float* v, size_t n) {
  float m = 0.0f;
  for (size_t j = 0; j < n; ++j) m = std::max(m, std::fabs(v[j]));
  return m;
}

}  // namespace

EventGate::EventGate(BlockPartition partition, EventConfig config, std::unique_ptr<KwtaGate> prior)
    : partition_(partition), config_(config), prior_(std::move(prior)) {
  const size_t nb = partition_.num_blocks;
  if (prior_ && (prior_->partition().k != partition_.k || prior_->partition().block != partition_.block))
    fail("the KWTA prior must use the event gate's block partition (K=", partition_.k, ", block=", partition_.block, ")");
  if (prior_ && prior_->config().score != KwtaScore::kL2)
    fail("the KWTA prior of the event gate ranks blocks by energy (score l2)");
  refresh_count_ = std::max<size_t>(1, std::min(fraction_count(config_.topk, nb), nb));
  exact_weights_ = config_.stale_beta == 1.0f && config_.stale_lambda == 0.0f;
  decay_ = std::exp(-config_.stale_lambda);
}

bool EventGate::enabled() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return enabled_;
}

EventGate::Stream& EventGate::stream_at(size_t b, size_t s) {
  if (streams_.size() <= b) streams_.resize(b + 1);
  std::vector<Stream>& row = streams_[b];
  if (row.size() <= s) row.resize(s + 1);
  return row[s];
}

void EventGate::set_dense_state(const float* xr, Stream& s, const float* product) {
  const size_t k = partition_.k, n = n_;
  s.x_ref.assign(xr, xr + k);
  s.y.assign(product, product + n);
  if (config_.stale_beta != 1.0f) s.fresh.assign(product, product + n);
  s.age.assign(partition_.num_blocks, 0);
  s.live = true;
  s.finite = all_finite(s.y.data(), n);
  s.drift = 0.0;
  s.resync = false;
}

void EventGate::write_delta(const float* xr, const Stream& s, const int32_t* blocks, size_t count, float* d) const {
  for (size_t i = 0; i < count; ++i) {
    const size_t b = static_cast<size_t>(blocks[i]);
    const float c = exact_weights_ ? 1.0f
                                   : config_.stale_beta * std::exp(-config_.stale_lambda * (static_cast<float>(s.age[b]) + 1.0f));
    for (size_t r = partition_.begin(b); r < partition_.end(b); ++r) d[r] = xr[r] - c * s.x_ref[r];
  }
}

void EventGate::plan_row(const float* xr, size_t wave_rows, RowPlan& plan, const kernels::KernelSet& kernels,
                         GateStats& stats) {
  Stream& s = *plan.stream;
  plan.dense = true;
  plan.gap_check = false;
  plan.order_begin = order_.size();
  plan.order_count = 0;
  plan.forced_count = 0;
  plan.quorum_count = 0;
  if (!enabled_ || !s.live || !s.finite) return;
  const size_t k = partition_.k, nb = partition_.num_blocks;
  ++stats.event_rows;
  stats.blocks_total += nb;
  float* diff = inputs_.data();  // free until the wave's inputs are written
  for (size_t r = 0; r < k; ++r) diff[r] = xr[r] - s.x_ref[r];
  kernels.matmul->block_sumsq(diff, k, partition_.block, sq_delta_.data());
  const bool use_prior = prior_ && prior_->keep_count() < nb;
  const bool need_energy = config_.delta_theta > 0.0f;
  if (need_energy) kernels.matmul->block_sumsq(xr, k, partition_.block, energy_.data());

  // KWTA prior: the candidates are the blocks the kwta rule keeps by energy (squared l2: its
  // selection key); the event ordering below runs inside them (non-candidates are reused, as any
  // block the ordering does not pick).
  if (use_prior) {
    std::fill(candidate_.begin(), candidate_.end(), uint8_t{0});
    const bool squared = prior_->block_keys(xr, kernels, prior_keys_.data());
    const size_t count = prior_->select(kernels, prior_keys_.data(), squared, kept_.data(), select_scratch_);
    for (size_t i = 0; i < count; ++i) candidate_[kept_[i]] = 1;
  }
  const bool use_age = config_.age_max > 0;
  const uint32_t age_limit = static_cast<uint32_t>(std::min<int64_t>(config_.age_max, UINT32_MAX));
  size_t forced = 0;
  if (use_age) {
    for (size_t b = 0; b < nb; ++b) {
      forced_[forced] = static_cast<int32_t>(b);
      forced += s.age[b] >= age_limit;
    }
  }
  // Eligible blocks, branch-free (eligibility is close to random per block): their delta in
  // masked_ (others -1, below every delta) and their indices, ascending, in kept_.
  const float theta_sq = config_.delta_theta * config_.delta_theta;
  const uint32_t* age = s.age.data();
  const float* sq_delta = sq_delta_.data();
  const float* energy = energy_.data();
  const uint8_t* candidate = candidate_.data();
  float* masked = masked_.data();
  int32_t* kept = kept_.data();
  size_t eligible = 0;
  constexpr uint32_t kMinusOneBits = 0xBF800000u;  // -1.0f
  for (size_t b = 0; b < nb; ++b) {
    const float d2 = sq_delta[b];
    const float limit = need_energy ? theta_sq * energy[b] : 0.0f;
    uint32_t ok = static_cast<uint32_t>(d2 > limit) | static_cast<uint32_t>(d2 != d2);  // NaN deltas are refreshed
    if (use_prior) ok &= candidate[b];
    if (use_age) ok &= static_cast<uint32_t>(age[b] < age_limit);
    // Integer selects: a float select here compiles to a branch that mispredicts.
    uint32_t bits;
    std::memcpy(&bits, &d2, sizeof(bits));
    const uint32_t keep_mask = 0u - ok;
    bits = (bits & keep_mask) | (kMinusOneBits & ~keep_mask);
    std::memcpy(masked + b, &bits, sizeof(bits));
    kept[eligible] = static_cast<int32_t>(b);
    eligible += ok;
  }
  const size_t keep = std::min(refresh_count_, eligible);
  size_t selected = eligible;  // every eligible block fits: no ranking needed
  if (keep < eligible)
    selected = kernels::select_top_k(*kernels.select, masked_.data(), nb, keep, kept_.data(), select_scratch_);
  stats.blocks_forced += forced;
  // Every block: a plain dense row (also resyncs the stream). In a wave of more than 2 rows
  // without a deadline, dense rows share token tiles and cost ~0.4-0.5 of a single-row pass over
  // W (measured at M = 12), so a row refreshing more than kDenseAbove of its blocks is cheaper,
  // and exact, as a dense row (0.5, not the ~0.4 break-even, so topk <= 0.5 keeps its meaning).
  const bool cheaper_dense = wave_rows > 2 && config_.budget_ms <= 0.0 &&
                             static_cast<double>(forced + selected) > kDenseAbove * static_cast<double>(nb);
  if (forced + selected == nb || cheaper_dense) {
    stats.blocks_kept += nb;
    return;
  }
  plan.dense = false;
  if (config_.gap_every > 0 && ++gap_counter_ % static_cast<uint64_t>(config_.gap_every) == 0) plan.gap_check = true;
  order_.insert(order_.end(), forced_.begin(), forced_.begin() + forced);
  const size_t by_delta = order_.size();
  order_.insert(order_.end(), kept_.begin(), kept_.begin() + selected);
  if (config_.budget_ms > 0.0) {
    // Largest change first (ties: lower block), so a deadline cuts the least informative blocks.
    const float* key = masked_.data();
    std::stable_sort(order_.begin() + by_delta, order_.end(), [key](int32_t a, int32_t b) {
      const float ka = key[a], kb = key[b];
      return std::isnan(ka) ? !std::isnan(kb) : ka > kb;
    });
  }
  plan.order_count = forced + selected;
  plan.forced_count = forced;
  plan.quorum_count = std::min(plan.order_count, forced + fraction_count(config_.quorum, selected));
}

void EventGate::commit_row(const float* xr, const RowPlan& plan, size_t done, const float* delta_product,
                           const float* fresh_product) {
  Stream& s = *plan.stream;
  const size_t n = n_;
  if (exact_weights_) {
    for (size_t j = 0; j < n; ++j) s.y[j] += delta_product[j];
  } else {
    // Every reused block's weight moves from w(a) to w(a + 1): a factor exp(-lambda) for blocks
    // already stale, stale_beta * exp(-lambda) for those fresh on the last row (kept in s.fresh).
    const float drop = config_.stale_beta != 1.0f ? decay_ * (1.0f - config_.stale_beta) : 0.0f;
    for (size_t j = 0; j < n; ++j) {
      float v = decay_ * s.y[j] + delta_product[j];
      if (drop != 0.0f) v -= drop * s.fresh[j];
      s.y[j] = v;
    }
    if (config_.stale_beta != 1.0f) {
      if (done > 0) {
        s.fresh.assign(fresh_product, fresh_product + n);
      } else {
        std::fill(s.fresh.begin(), s.fresh.end(), 0.0f);
      }
    }
  }
  s.finite = all_finite(s.y.data(), n);
  s.drift += max_abs(delta_product, n);
  s.resync = s.finite && s.drift > kDriftLimit * static_cast<double>(max_abs(s.y.data(), n));
  for (uint32_t& a : s.age) a = a == UINT32_MAX ? a : a + 1;
  const int32_t* blocks = order_.data() + plan.order_begin;
  for (size_t i = 0; i < done; ++i) {
    const size_t b = static_cast<size_t>(blocks[i]);
    s.age[b] = 0;
    for (size_t r = partition_.begin(b); r < partition_.end(b); ++r) s.x_ref[r] = xr[r];
  }
}

void EventGate::finish_row(const RowPlan& plan, const float* bias, float* y) const {
  float* yr = y + plan.row * n_;
  const float* sy = plan.stream->y.data();
  for (size_t j = 0; j < n_; ++j) yr[j] = sy[j] + (bias ? bias[j] : 0.0f);
}

void EventGate::run_wave(const float* x, std::vector<RowPlan>& wave, const float* bias, float* y,
                         const WeightProduct& product, GateStats& stats) {
  if (config_.budget_ms <= 0.0) {
    run_wave_unbounded(x, wave, bias, y, product, stats);
  } else {
    run_wave_deadline(x, wave, bias, y, product, stats);
  }
  check_gaps(x, wave, bias, y, product, stats);
}

void EventGate::run_wave_unbounded(const float* x, std::vector<RowPlan>& wave, const float* bias, float* y,
                                   const WeightProduct& product, GateStats& stats) {
  const size_t k = partition_.k, n = n_;
  const size_t m = wave.size();
  const bool need_fresh = config_.stale_beta != 1.0f;
  // No deadline. Dense rows (fresh streams, full refreshes) share one backend run: at M > 2 the
  // engine's token tiles reuse each W row across them. Gated rows each have their own row list,
  // whose union over a tile is most of W, so they run one by one on the decode path (whole W rows
  // streamed, y in L1), which measured faster than tiling them.
  out_.resize(m * n);
  if (need_fresh) fresh_out_.resize(m * n);
  inputs_.resize(std::max(inputs_.size(), m * k));
  gated_.clear();
  dense_rows_.clear();
  for (size_t i = 0; i < m; ++i) {
    if (!wave[i].dense) continue;
    copy_floats(inputs_.data() + dense_rows_.size() * k, x + wave[i].row * k, k);
    dense_rows_.push_back(i);
    gated_.add_dense_token();
  }
  if (!dense_rows_.empty()) {
    dense_out_.resize(dense_rows_.size() * n);
    product(inputs_.data(), dense_rows_.size(), gated_, nullptr, dense_out_.data());
    for (size_t d = 0; d < dense_rows_.size(); ++d)
      copy_floats(out_.data() + dense_rows_[d] * n, dense_out_.data() + d * n, n);
  }
  for (size_t i = 0; i < m; ++i) {
    RowPlan& plan = wave[i];
    if (plan.dense) continue;
    const float* xr = x + plan.row * k;
    int32_t* blocks = order_.data() + plan.order_begin;
    // Forced and by-delta blocks are each ascending already: W rows in memory order.
    if (plan.forced_count > 0) std::inplace_merge(blocks, blocks + plan.forced_count, blocks + plan.order_count);
    write_delta(xr, *plan.stream, blocks, plan.order_count, inputs_.data());
    gated_.clear();
    gated_.add_token_blocks(partition_, blocks, plan.order_count, 1.0f);
    product(inputs_.data(), 1, gated_, nullptr, out_.data() + i * n);
    if (need_fresh) product(xr, 1, gated_, nullptr, fresh_out_.data() + i * n);
  }
  resync_rows_.clear();
  for (size_t i = 0; i < m; ++i) {
    RowPlan& plan = wave[i];
    const float* xr = x + plan.row * k;
    if (plan.dense) {
      set_dense_state(xr, *plan.stream, out_.data() + i * n);
    } else {
      commit_row(xr, plan, plan.order_count, out_.data() + i * n, need_fresh ? fresh_out_.data() + i * n : nullptr);
      stats.blocks_kept += plan.order_count;
      if (plan.stream->resync) {
        resync_rows_.push_back(i);
        continue;
      }
    }
    finish_row(plan, bias, y);
  }
  resync_rows(x, wave, resync_rows_, bias, y, product, stats);
}

void EventGate::run_wave_deadline(const float* x, std::vector<RowPlan>& wave, const float* bias, float* y,
                                  const WeightProduct& product, GateStats& stats) {
  const size_t k = partition_.k, n = n_;
  const bool need_fresh = config_.stale_beta != 1.0f;
  // Deadline: row by row, the refreshed blocks in delta order in chunks; the clock is read
  // between chunks only, and the first quorum_count blocks run whatever it says.
  const size_t chunk_blocks = std::max<size_t>(1, kDeadlineChunkRows / partition_.block);
  const double budget_ns = config_.budget_ms * 1e6;
  inputs_.resize(std::max(inputs_.size(), k));
  out_.resize(2 * n);
  fresh_out_.resize(2 * n);
  for (RowPlan& plan : wave) {
    const auto start = Clock::now();
    const float* xr = x + plan.row * k;
    gated_.clear();
    if (plan.dense) {
      gated_.add_dense_token();
      product(xr, 1, gated_, nullptr, out_.data());
      set_dense_state(xr, *plan.stream, out_.data());
      finish_row(plan, bias, y);
      continue;
    }
    int32_t* blocks = order_.data() + plan.order_begin;
    float* acc = out_.data() + n;
    float* fresh_acc = fresh_out_.data() + n;
    std::fill(acc, acc + n, 0.0f);
    if (need_fresh) std::fill(fresh_acc, fresh_acc + n, 0.0f);
    write_delta(xr, *plan.stream, blocks, plan.order_count, inputs_.data());
    size_t done = 0;
    while (done < plan.order_count) {
      if (done >= plan.quorum_count &&
          static_cast<double>(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count()) >
              budget_ns) {
        ++stats.deadline_stops;
        break;
      }
      const size_t end = done < plan.quorum_count ? plan.quorum_count : std::min(plan.order_count, done + chunk_blocks);
      std::sort(blocks + done, blocks + end);  // same set, W rows in memory order
      gated_.clear();
      gated_.add_token_blocks(partition_, blocks + done, end - done, 1.0f);
      product(inputs_.data(), 1, gated_, nullptr, out_.data());
      for (size_t j = 0; j < n; ++j) acc[j] += out_[j];
      if (need_fresh) {
        product(xr, 1, gated_, nullptr, fresh_out_.data());
        for (size_t j = 0; j < n; ++j) fresh_acc[j] += fresh_out_[j];
      }
      done = end;
    }
    commit_row(xr, plan, done, acc, fresh_acc);
    stats.blocks_kept += done;
    if (plan.stream->resync) {
      resync_rows(x, wave, {static_cast<size_t>(&plan - wave.data())}, bias, y, product, stats);
      continue;
    }
    finish_row(plan, bias, y);
  }
}

void EventGate::check_gaps(const float* x, const std::vector<RowPlan>& wave, const float* bias, float* y,
                           const WeightProduct& product, GateStats& stats) {
  const size_t k = partition_.k, n = n_;
  const size_t m = wave.size();
  // The dense row too; the output takes the dense value and the stream resyncs on it.
  gated_.clear();
  inputs_.resize(std::max(inputs_.size(), m * k));
  std::vector<const RowPlan*> checks;
  for (const RowPlan& plan : wave) {
    if (!plan.gap_check) continue;
    copy_floats(inputs_.data() + checks.size() * k, x + plan.row * k, k);
    gated_.add_dense_token();
    checks.push_back(&plan);
  }
  if (checks.empty()) return;
  dense_out_.resize(checks.size() * n);
  product(inputs_.data(), checks.size(), gated_, nullptr, dense_out_.data());
  for (size_t i = 0; i < checks.size(); ++i) {
    const RowPlan& plan = *checks[i];
    const float* dense = dense_out_.data() + i * n;
    float* yr = y + plan.row * n;
    double diff = 0.0, ref = 0.0;
    for (size_t j = 0; j < n; ++j) {
      const double dv = dense[j] + (bias ? bias[j] : 0.0f);
      diff += (yr[j] - dv) * (yr[j] - dv);
      ref += dv * dv;
    }
    const double gap = ref > 0.0 ? std::sqrt(diff / ref) : (diff > 0.0 ? std::numeric_limits<double>::infinity() : 0.0);
    ++stats.gap_checks;
    stats.last_gap = gap;
    if (gap > config_.gap_tol && enabled_) {
      enabled_ = false;
      ++stats.disables;
    }
    set_dense_state(x + plan.row * k, *plan.stream, dense);
    finish_row(plan, bias, y);
  }
}

void EventGate::resync_rows(const float* x, const std::vector<RowPlan>& wave, const std::vector<size_t>& rows,
                            const float* bias, float* y, const WeightProduct& product, GateStats& stats) {
  if (rows.empty()) return;
  const size_t k = partition_.k, n = n_;
  std::vector<float> inputs(rows.size() * k), out(rows.size() * n);
  GatedRows every;
  for (size_t i = 0; i < rows.size(); ++i) {
    copy_floats(inputs.data() + i * k, x + wave[rows[i]].row * k, k);
    every.add_dense_token();
  }
  product(inputs.data(), rows.size(), every, nullptr, out.data());
  for (size_t i = 0; i < rows.size(); ++i) {
    const RowPlan& plan = wave[rows[i]];
    stats.blocks_kept += partition_.num_blocks - plan.order_count;
    ++stats.resyncs;
    set_dense_state(x + plan.row * k, *plan.stream, out.data() + i * n);
    float* yr = y + plan.row * n;
    for (size_t j = 0; j < n; ++j) yr[j] = plan.stream->y[j] + (bias ? bias[j] : 0.0f);
  }
}

// A call with more rows than max_gated_rows (a prefill): one dense product over all rows (the
// backend's tiled path), then every stream resyncs on its last row (axis sequence) or its row
// (axis call), so the next gated row continues from exact state.
void EventGate::run_dense_call(const GateCall& call, const WeightProduct& product) {
  const size_t k = partition_.k, n = n_, m = call.rows(), batch = call.batch, seq = call.seq;
  const float* x = call.x;
  gated_.clear();
  for (size_t i = 0; i < m; ++i) gated_.add_dense_token();
  out_.resize(std::max(out_.size(), m * n));
  product(x, m, gated_, nullptr, out_.data());
  for (size_t i = 0; i < m; ++i)
    for (size_t j = 0; j < n; ++j) call.y[i * n + j] = out_[i * n + j] + (call.bias ? call.bias[j] : 0.0f);
  const bool by_call = config_.axis == EventAxis::kCall;
  for (size_t b = 0; b < batch; ++b) {
    for (size_t s = by_call ? 0 : seq - 1; s < seq; ++s) {
      const size_t row = b * seq + s;
      set_dense_state(x + row * k, stream_at(b, by_call ? s : 0), out_.data() + row * n);
    }
  }
  if (by_call) {
    prev_batch_ = batch;
    prev_seq_ = seq;
  }
}

GateStats EventGate::apply(const GateCall& call, const WeightProduct& product, const kernels::KernelSet& kernels) {
  const float* x = call.x;
  const size_t batch = call.batch, seq = call.seq;
  GateStats stats;
  stats.rows = batch * seq;
  std::lock_guard<std::mutex> lock(mutex_);
  n_ = product.n();
  if (call.reset) {
    streams_.clear();
    enabled_ = true;
    gap_counter_ = 0;
    prev_batch_ = prev_seq_ = 0;
  }
  if (stats.rows == 0) {
    stats.enabled = enabled_;
    return stats;
  }
  const auto start = Clock::now();
  const size_t k = partition_.k, nb = partition_.num_blocks;
  inputs_.resize(std::max(inputs_.size(), k));
  sq_delta_.resize(nb);
  energy_.resize(nb);
  prior_keys_.resize(nb);
  masked_.resize(nb);
  candidate_.resize(nb);
  kept_.resize(nb + kernels::kIndexSlack);
  forced_.resize(nb);
  const bool by_call = config_.axis == EventAxis::kCall;
  // Sized before any pointer into streams_ is taken.
  for (size_t b = 0; b < batch; ++b) stream_at(b, by_call ? seq - 1 : 0);
  if (call.dense) {
    run_dense_call(call, product);
    stats.enabled = enabled_;
    stats.gate_ns = static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count());
    return stats;
  }
  std::vector<RowPlan> wave;
  const size_t waves = by_call ? 1 : seq;
  for (size_t t = 0; t < waves; ++t) {
    wave.clear();
    order_.clear();
    for (size_t b = 0; b < batch; ++b) {
      const size_t first = by_call ? 0 : t, last = by_call ? seq : t + 1;
      for (size_t s = first; s < last; ++s) {
        RowPlan plan{};
        plan.row = b * seq + s;
        plan.stream = &stream_at(b, by_call ? s : 0);
        if (by_call && (b >= prev_batch_ || s >= prev_seq_)) plan.stream->live = false;
        wave.push_back(plan);
      }
    }
    // Pointers into streams_ are stable from here: stream_at is not called again in this wave.
    for (RowPlan& plan : wave) plan_row(x + plan.row * k, wave.size(), plan, kernels, stats);
    run_wave(x, wave, call.bias, call.y, product, stats);
  }
  if (by_call) {
    prev_batch_ = batch;
    prev_seq_ = seq;
  }
  stats.gate_ns = static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count());
  stats.enabled = enabled_;
  return stats;
}

}  // namespace ortsparse::engine
