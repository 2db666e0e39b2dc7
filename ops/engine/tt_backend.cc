#include "engine/tt_backend.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "common/error.h"
#include "common/scratch.h"

namespace ortsparse::engine {
namespace {

// Below this many multiply-adds a pool task costs more than it saves.
constexpr double kMinTaskMacs = 1 << 17;
constexpr size_t kMaxStepTasks = 8;
// Steps with at most this many rows (decode) and at least kGemvMinSpan outputs run on gemv_rows, in
// column spans of >= kGemvMinSpan (narrower outputs make short row streams: the TT GEMM does better).
constexpr size_t kGemvRows = 2;
constexpr size_t kGemvMinSpan = 256;
// From this many tokens up, tasks take whole token chunks through every core (no barrier per core).
constexpr size_t kTokenChunkMin = 4;
// Scratch of one pass over the rows of a call (floats): 64 MiB; and the most one row may need.
constexpr size_t kScratchBudgetFloats = size_t{16} << 20;
constexpr size_t kMaxRowScratchFloats = size_t{64} << 20;

size_t checked_product(const std::vector<size_t>& v, const char* what) {
  size_t p = 1;
  for (size_t x : v) {
    if (x != 0 && p > std::numeric_limits<int32_t>::max() / x) fail("product of ", what, " is too large");
    p *= x;
  }
  return p;
}

}  // namespace

size_t TTShape::k() const { return checked_product(in_modes, "in_modes"); }
size_t TTShape::n() const { return checked_product(out_modes, "out_modes"); }
size_t TTShape::cores_size() const {
  size_t s = 0;
  for (size_t t = 0; t < d(); ++t) s += core_size(t);
  return s;
}
size_t TTShape::max_rank() const { return ranks.empty() ? 0 : *std::max_element(ranks.begin(), ranks.end()); }

TTShape make_tt_shape(const std::vector<int64_t>& in_modes, const std::vector<int64_t>& out_modes,
                      const std::vector<int64_t>& ranks, size_t cores_length) {
  if (in_modes.empty()) fail("attribute in_modes is missing or empty (one mode per core: K = prod in_modes)");
  if (out_modes.size() != in_modes.size())
    fail("attributes in_modes ", shape_string(in_modes), " and out_modes ", shape_string(out_modes),
         " must have the same length d (one pair of modes per core)");
  if (ranks.size() != in_modes.size() + 1)
    fail("attribute ranks ", shape_string(ranks), " must have d + 1 = ", in_modes.size() + 1,
         " entries (r_0 .. r_d, with r_0 = r_d = 1)");
  if (ranks.front() != 1 || ranks.back() != 1)
    fail("attribute ranks ", shape_string(ranks), " must start and end with 1 (r_0 = r_d = 1)");
  TTShape s;
  for (size_t t = 0; t < in_modes.size(); ++t) {
    if (in_modes[t] < 1 || in_modes[t] > std::numeric_limits<int32_t>::max())
      fail("attribute in_modes ", shape_string(in_modes), ": every mode must be in [1, 2^31 - 1]");
    if (out_modes[t] < 1 || out_modes[t] > std::numeric_limits<int32_t>::max())
      fail("attribute out_modes ", shape_string(out_modes), ": every mode must be in [1, 2^31 - 1]");
    s.in_modes.push_back(static_cast<size_t>(in_modes[t]));
    s.out_modes.push_back(static_cast<size_t>(out_modes[t]));
  }
  for (int64_t r : ranks) {
    if (r < 1 || r > 65536) fail("attribute ranks ", shape_string(ranks), ": every rank must be in [1, 65536]");
    s.ranks.push_back(static_cast<size_t>(r));
  }
  s.k();
  s.n();
  double total = 0;
  for (size_t t = 0; t < s.d(); ++t) total += static_cast<double>(s.ranks[t]) * s.in_modes[t] * s.out_modes[t] * s.ranks[t + 1];
  if (total > 4e9) fail("the cores described by in_modes/out_modes/ranks are too large (", total, " floats)");
  if (s.cores_size() != cores_length)
    fail("input cores has ", cores_length, " floats but in_modes ", shape_string(in_modes), ", out_modes ",
         shape_string(out_modes), ", ranks ", shape_string(ranks), " need ", s.cores_size(),
         " (sum over cores of r_{t-1} * k_t * n_t * r_t)");
  return s;
}

// Layouts (m = token; every step is one GEMM [rows x b] . [b x a] on contiguous memory, then a 2-D
// transpose that brings the next core's mode beside its rank):
// first core first, before step t = 1..d:  [i_{t+1}..i_d, m, j_1..j_{t-1}, (r_{t-1} i_t)]
//   GEMM out:                               [i_{t+1}..i_d, m, j_1..j_{t-1}, (j_t r_t)]
//   transpose [i_{t+1} x rest] -> [rest x i_{t+1}] gives step t+1's input; X needs one transpose
//   [(m i_1) x (i_2..i_d)] first, and step d's output is Y [m, j_1..j_d] as it stands.
// last core first, before step t = d..1:   [j_{t+1}..j_d, m, i_1..i_{t-1}, (i_t r_t)]
//   GEMM out:                               [j_{t+1}..j_d, m, i_1..i_{t-1}, (r_{t-1} j_t)]
//   transpose [rest x j_t] -> [j_t x rest] (t > 1); after step 1, [(j_2..j_d) x (m j_1)] -> Y.
// X [m, K] is step d's input as it stands.  A transpose with a side of 1 is skipped.
double TTBackend::order_macs(const TTShape& s, bool rtl) {
  double total = 0;
  const size_t d = s.d();
  for (size_t step = 0; step < d; ++step) {
    const size_t t = rtl ? d - 1 - step : step;
    double pf = 1, q = 1;
    for (size_t u = 0; u < t; ++u) pf *= rtl ? s.in_modes[u] : s.out_modes[u];
    for (size_t u = t + 1; u < d; ++u) q *= rtl ? s.out_modes[u] : s.in_modes[u];
    total += pf * q * static_cast<double>(s.ranks[t]) * s.in_modes[t] * s.out_modes[t] * s.ranks[t + 1];
  }
  return total;
}

TTBackend::TTBackend(TTShape shape, const float* cores, int right_to_left)
    : shape_(std::move(shape)), k_(shape_.k()), n_(shape_.n()), bytes_(shape_.cores_size() * sizeof(float)) {
  const double ltr_macs = order_macs(shape_, false), rtl_macs = order_macs(shape_, true);
  right_to_left_ = right_to_left < 0 ? rtl_macs < ltr_macs : right_to_left == 1;
  macs_ = right_to_left_ ? rtl_macs : ltr_macs;
  const size_t d = shape_.d();
  const auto& km = shape_.in_modes;
  const auto& nm = shape_.out_modes;
  std::vector<size_t> core_offset(d + 1, 0);
  for (size_t t = 0; t < d; ++t) core_offset[t + 1] = core_offset[t] + shape_.core_size(t);
  mats_.resize(std::max<size_t>(1, core_offset[d]));
  scratch_per_token_ = 0;
  if (!right_to_left_ && d > 1) {
    pre_c_ = 1;
    for (size_t u = 1; u < d; ++u) pre_c_ *= km[u];
    if (pre_c_ == 1) pre_c_ = 0;
    scratch_per_token_ = k_;
  }
  for (size_t step = 0; step < d; ++step) {
    const size_t t = right_to_left_ ? d - 1 - step : step;
    const size_t r0 = shape_.ranks[t], kt = km[t], nt = nm[t], r1 = shape_.ranks[t + 1];
    Step s{1, 0, 0, core_offset[t], 0, 0};
    for (size_t u = 0; u < t; ++u) s.rows_per_token *= right_to_left_ ? km[u] : nm[u];
    for (size_t u = t + 1; u < d; ++u) s.rows_per_token *= right_to_left_ ? nm[u] : km[u];
    s.a = right_to_left_ ? r0 * nt : nt * r1;
    s.b = right_to_left_ ? kt * r1 : r0 * kt;
    if (!right_to_left_) {
      if (t + 1 < d) s.tr_r = km[t + 1];
    } else if (t > 0) {
      s.tr_c = nt;
    } else {
      s.tr_r = 1;
      for (size_t u = 1; u < d; ++u) s.tr_r *= nm[u];
    }
    if (s.tr_r == 1 || s.tr_c == 1) s.tr_r = s.tr_c = 0;
    const float* g = cores + core_offset[t];
    float* dst = mats_.data() + s.offset;
    // G[x0, i, j, x1] sits at ((x0 * kt + i) * nt + j) * r1 + x1; the step multiplies by mat [b x a].
    for (size_t x0 = 0; x0 < r0; ++x0)
      for (size_t i = 0; i < kt; ++i)
        for (size_t j = 0; j < nt; ++j)
          for (size_t x1 = 0; x1 < r1; ++x1) {
            const size_t col_a = right_to_left_ ? x0 * nt + j : j * r1 + x1;
            const size_t row_b = right_to_left_ ? i * r1 + x1 : x0 * kt + i;
            dst[row_b * s.a + col_a] = g[((x0 * kt + i) * nt + j) * r1 + x1];
          }
    const double intermediate = static_cast<double>(s.rows_per_token) * static_cast<double>(s.a);
    if (intermediate > static_cast<double>(kMaxRowScratchFloats))
      fail("the TT contraction of one input row needs an intermediate of ", intermediate, " floats (core ", t,
           " of in_modes ", shape_string(shape_.in_modes), ", out_modes ", shape_string(shape_.out_modes),
           ", ranks ", shape_string(shape_.ranks), "); at most ", kMaxRowScratchFloats,
           " are allowed: choose modes with smaller partial products (e.g. balanced modes)");
    scratch_per_token_ = std::max(scratch_per_token_, s.rows_per_token * s.a);
    steps_.push_back(s);
  }
}

namespace {

// dst [c x r] = src [r x c]^T, in 16 x 16 tiles so both sides stay in cache lines.
void transpose(const float* src, float* dst, size_t rows, size_t cols) {
  constexpr size_t kTile = 16;
  for (size_t r0 = 0; r0 < rows; r0 += kTile) {
    const size_t r1 = std::min(rows, r0 + kTile);
    for (size_t c0 = 0; c0 < cols; c0 += kTile) {
      const size_t c1 = std::min(cols, c0 + kTile);
      for (size_t r = r0; r < r1; ++r)
        for (size_t c = c0; c < c1; ++c) dst[c * rows + r] = src[r * cols + c];
    }
  }
}

}  // namespace

void TTBackend::run_chunk(const float* x, size_t count, float* y, float* s0, float* s1, const kernels::KernelSet& kernels,
                          const TaskRunner* step_runner) const {
  const float* cur = x;
  if (pre_c_) {
    transpose(x, s0, count * k_ / pre_c_, pre_c_);
    cur = s0;
  }
  const size_t d = steps_.size();
  for (size_t i = 0; i < d; ++i) {
    const Step& s = steps_[i];
    const bool last = i + 1 == d;
    const size_t rows = count * s.rows_per_token, total = rows * s.a;
    const size_t tr_rows = s.tr_r ? s.tr_r : (s.tr_c ? total / s.tr_c : 0);
    const size_t tr_cols = tr_rows ? total / tr_rows : 0;
    const bool transposed = tr_rows > 1 && tr_cols > 1;
    float* out = last && !transposed ? y : (cur == s0 ? s1 : s0);
    const float* mat = mats_.data() + s.offset;
    const double macs = static_cast<double>(rows) * s.a * s.b;
    const size_t want =
        step_runner ? static_cast<size_t>(std::min<double>(kMaxStepTasks, std::max(1.0, macs / kMinTaskMacs))) : 1;
    if (rows <= kGemvRows && s.a >= kGemvMinSpan) {
      // Decode: the engine's row-streaming GEMV (the dense backend's M = 1 kernel) over whole rows
      // of mat, in column spans of >= 256 floats so each row read stays one long stream. The span
      // count depends on the shape only, so results do not depend on the thread count.
      const kernels::MatMulKernels& gemv = *kernels.matmul;
      const size_t spans = std::max<size_t>(1, std::min<size_t>(kMaxStepTasks, s.a / kGemvMinSpan));
      const auto span = [&, cur, out, mat, rows](size_t task) {
        const size_t c0 = s.a * task / spans / 16 * 16, c1 = task + 1 == spans ? s.a : s.a * (task + 1) / spans / 16 * 16;
        for (size_t r = 0; r < rows; ++r)
          gemv.gemv_rows(mat + c0, s.a, nullptr, cur + r * s.b, s.b, out + r * s.a + c0, c1 - c0, false);
      };
      if (step_runner && spans > 1 && want > 1) {
        step_runner->run(spans, span);
      } else {
        for (size_t task = 0; task < spans; ++task) span(task);
      }
    } else if (want <= 1) {
      kernels.tt->gemm(cur, s.b, mat, s.a, out, s.a, rows, s.b, s.a);
    } else if (rows >= 4 * want) {
      step_runner->run(want, [&, cur, out, mat, rows](size_t task) {
        const size_t r0 = rows * task / want, r1 = rows * (task + 1) / want;
        kernels.tt->gemm(cur + r0 * s.b, s.b, mat, s.a, out + r0 * s.a, s.a, r1 - r0, s.b, s.a);
      });
    } else {
      // Few rows (decode): column spans in multiples of 32 (whole SIMD panels).
      const size_t span = std::max<size_t>(32, ((s.a + want - 1) / want + 31) / 32 * 32);
      const size_t tasks = (s.a + span - 1) / span;
      step_runner->run(tasks, [&, cur, out, mat, rows, span](size_t task) {
        const size_t c0 = task * span, c1 = std::min(s.a, c0 + span);
        kernels.tt->gemm(cur, s.b, mat + c0, s.a, out + c0, s.a, rows, s.b, c1 - c0);
      });
    }
    if (transposed) {
      float* dst = last ? y : (out == s0 ? s1 : s0);
      transpose(out, dst, tr_rows, tr_cols);
      cur = dst;
    } else {
      cur = out;
    }
  }
}

BackendStats TTBackend::run(const float* x, size_t m, const GatedRows& gated, const float* bias, float* y,
                            const kernels::KernelSet& kernels, const TaskRunner& runner) const {
  if (m == 0 || n_ == 0) return {};
  // Rows go in passes whose scratch (two intermediates per row) stays within kScratchBudget.
  const size_t per_row = 2 * scratch_per_token_ + k_;
  const size_t rows_per_pass = std::max<size_t>(1, kScratchBudgetFloats / std::max<size_t>(1, per_row));
  for (size_t t0 = 0; t0 < m; t0 += rows_per_pass)
    run_rows(x, t0, std::min(m, t0 + rows_per_pass), gated, bias, y, kernels, runner);
  return {};
}

void TTBackend::run_rows(const float* x_all, size_t t0, size_t t1, const GatedRows& gated, const float* bias,
                         float* y_all, const kernels::KernelSet& kernels, const TaskRunner& runner) const {
  const size_t m = t1 - t0;
  const float* x = x_all + t0 * k_;
  float* y = y_all + t0 * n_;
  // Reused per calling thread; pool tasks only see the raw pointers taken here.
  thread_local std::vector<float> xin_buffer;
  thread_local std::vector<float> scratch_buffer;
  const float* xin = x;
  bool plain = true;
  for (size_t t = 0; t < m && plain; ++t) plain = gated.dense[t0 + t] && gated.scale[t0 + t] == 1.0f;
  if (!plain) {
    xin_buffer.assign(m * k_, 0.0f);
    for (size_t t = 0; t < m; ++t) {
      const size_t g = t0 + t;  // the row's token in `gated`
      const float s = gated.scale[g];
      const float* xt = x + t * k_;
      float* dst = xin_buffer.data() + t * k_;
      if (gated.dense[g]) {
        for (size_t r = 0; r < k_; ++r) dst[r] = xt[r] * s;
      } else {
        for (size_t i = gated.offset[g]; i < gated.offset[g + 1]; ++i) dst[gated.rows[i]] = xt[gated.rows[i]] * s;
      }
    }
    xin = xin_buffer.data();
  }
  const size_t per = scratch_per_token_;
  scratch_buffer.resize(std::max<size_t>(1, 2 * m * per));
  float* const s0 = scratch_buffer.data();
  float* const s1 = s0 + m * per;
  const size_t k = k_, n = n_;
  if (m >= kTokenChunkMin) {
    // Token chunks through the whole chain: no barrier per core, every chunk's cores stay in cache.
    const size_t tokens_per_task = std::max<size_t>(kTokenChunkMin, (m + 15) / 16);
    const size_t tasks = (m + tokens_per_task - 1) / tokens_per_task;
    runner.run(tasks, [&, xin, s0, s1, y, bias](size_t task) {
      const size_t t0 = task * tokens_per_task, t1 = std::min(m, t0 + tokens_per_task);
      run_chunk(xin + t0 * k, t1 - t0, y + t0 * n, s0 + t0 * per, s1 + t0 * per, kernels, nullptr);
      if (bias)
        for (size_t t = t0; t < t1; ++t)
          for (size_t j = 0; j < n; ++j) y[t * n + j] += bias[j];
    });
    release_if_large(xin_buffer, scratch_buffer);
    return;
  }
  // Few tokens (decode): one chain, each core's GEMM split over rows or columns when big enough.
  run_chunk(xin, m, y, s0, s1, kernels, &runner);
  if (bias)
    for (size_t t = 0; t < m; ++t)
      for (size_t j = 0; j < n; ++j) y[t * n + j] += bias[j];
  release_if_large(xin_buffer, scratch_buffer);
}

}  // namespace ortsparse::engine
