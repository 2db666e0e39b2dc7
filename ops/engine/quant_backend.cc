#include "engine/quant_backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/error.h"

namespace ortsparse::engine {

namespace {

// True when `shape` is [d0, d1] or the flat [d0 * d1].
bool matrix_or_flat(const std::vector<int64_t>& shape, int64_t d0, int64_t d1) {
  return (shape.size() == 2 && shape[0] == d0 && shape[1] == d1) || (shape.size() == 1 && shape[0] == d0 * d1);
}

size_t round_up(size_t value, size_t multiple) { return (value + multiple - 1) / multiple * multiple; }

}  // namespace

QuantWeights::QuantWeights(const MatMulNBitsTensors& t, size_t max_panel) {
  if (t.bits != 4 && t.bits != 8) fail("attribute bits=", t.bits, " is not supported (4 or 8)");
  if (t.block_size < 16 || t.block_size > 128 || (t.block_size & (t.block_size - 1)) != 0)
    fail("attribute block_size=", t.block_size, " is not supported (a power of two in [16, 128])");
  if (t.k <= 0 || t.n <= 0) fail("attributes K=", t.k, " and N=", t.n, " must be positive");
  if (t.k >= (int64_t{1} << 31) || t.n >= (int64_t{1} << 31)) fail("attributes K=", t.k, " or N=", t.n, " are too large");
  const int64_t nb = (t.k + t.block_size - 1) / t.block_size;
  const int64_t blob = t.block_size * t.bits / 8;
  const std::vector<int64_t> b_expected{t.n, nb, blob};
  if (t.b_shape != b_expected)
    fail("input B has shape ", shape_string(t.b_shape), "; K=", t.k, ", N=", t.n, ", bits=", t.bits,
         ", block_size=", t.block_size, " need ", shape_string(b_expected));
  if (!matrix_or_flat(t.scales_shape, t.n, nb))
    fail("input scales has shape ", shape_string(t.scales_shape), "; K=", t.k, ", N=", t.n, ", block_size=",
         t.block_size, " need [", t.n, ", ", nb, "] or [", t.n * nb, "]");
  const int64_t zp_blob = (nb * t.bits + 7) / 8;
  if (t.zero_points) {
    if (t.zero_points_are_float)
      fail("input zero_points is a float tensor; only uint8 zero points (packed as MatMulNBits packs them) are "
           "supported");
    if (!matrix_or_flat(t.zero_points_shape, t.n, zp_blob))
      fail("input zero_points has shape ", shape_string(t.zero_points_shape), "; K=", t.k, ", N=", t.n,
           ", bits=", t.bits, ", block_size=", t.block_size, " need [", t.n, ", ", zp_blob, "] or [",
           t.n * zp_blob, "]");
  }
  if (t.b == nullptr || t.scales == nullptr) fail("inputs B and scales must hold data");
  if (max_panel < kQuantGroup || max_panel % kQuantGroup) fail("max_panel=", max_panel, " must be a multiple of ", kQuantGroup);

  QuantPacked& p = packed_;
  p.k = static_cast<size_t>(t.k);
  p.n = static_cast<size_t>(t.n);
  p.bits = static_cast<size_t>(t.bits);
  p.block = static_cast<size_t>(t.block_size);
  p.num_blocks = static_cast<size_t>(nb);
  const size_t groups = (p.n + kQuantGroup - 1) / kQuantGroup;
  const size_t panels_wanted = (groups * kQuantGroup + max_panel - 1) / max_panel;
  p.panel = (groups + panels_wanted - 1) / panels_wanted * kQuantGroup;
  p.num_panels = (p.n + p.panel - 1) / p.panel;
  p.row_bytes = p.panel * p.bits / 8;
  p.default_zp = p.bits == 4 ? 8 : 128;

  q_.resize(p.num_panels * p.k * p.row_bytes);
  scales_.resize(p.num_panels * p.num_blocks * p.panel);
  std::memset(q_.data(), 0, q_.size());
  std::fill(scales_.data(), scales_.data() + scales_.size(), 0.0f);
  const uint8_t* zp_src = static_cast<const uint8_t*>(t.zero_points);
  if (zp_src) {
    zero_points_.resize(scales_.size());
    std::memset(zero_points_.data(), 0, zero_points_.size());
  }
  // One column group at a time: its 64 source columns are read sequentially, its rows written whole.
  const size_t bs = p.block, k = p.k;
  for (size_t n0 = 0; n0 < p.n; n0 += kQuantGroup) {
    const size_t n1 = std::min(p.n, n0 + kQuantGroup);
    const size_t panel = n0 / p.panel, g = (n0 % p.panel) / kQuantGroup;
    uint8_t* dst = q_.data() + panel * k * p.row_bytes;
    for (size_t kk = 0; kk < k; ++kk) {
      const size_t b = kk / bs, e = kk % bs;
      uint8_t* row = dst + kk * p.row_bytes;
      for (size_t nn = n0; nn < n1; ++nn) {
        const uint8_t* src = t.b + (nn * p.num_blocks + b) * static_cast<size_t>(blob);
        const size_t i = nn - n0;
        if (p.bits == 8) {
          row[g * kQuantGroup + i] = src[e];
        } else {
          const uint8_t v = (src[e / 2] >> (4 * (e & 1))) & 0x0F;
          row[g * (kQuantGroup / 2) + i % 32] |= static_cast<uint8_t>(i < 32 ? v : v << 4);
        }
      }
    }
  }
  for (size_t nn = 0; nn < p.n; ++nn) {
    const size_t panel = nn / p.panel, j = nn % p.panel;
    for (size_t b = 0; b < p.num_blocks; ++b) {
      const size_t at = (panel * p.num_blocks + b) * p.panel + j;
      scales_[at] = t.scales[nn * p.num_blocks + b];
      if (zp_src) {
        const uint8_t* z = zp_src + nn * static_cast<size_t>(zp_blob);
        zero_points_[at] = p.bits == 8 ? z[b] : static_cast<uint8_t>((z[b / 2] >> (4 * (b & 1))) & 0x0F);
      }
    }
  }
  p.q = q_.data();
  p.scales = scales_.data();
  p.zero_points = zp_src ? zero_points_.data() : nullptr;
}

std::vector<float> QuantWeights::dequantized() const {
  const QuantPacked& p = packed_;
  std::vector<float> w(p.k * p.n);
  for (size_t nn = 0; nn < p.n; ++nn) {
    const size_t panel = nn / p.panel, j = nn % p.panel, g = j / kQuantGroup, i = j % kQuantGroup;
    for (size_t kk = 0; kk < p.k; ++kk) {
      const uint8_t* row = p.panel_q(panel) + kk * p.row_bytes;
      const int q = p.bits == 8 ? row[g * kQuantGroup + i]
                                : (i < 32 ? row[g * 32 + i] & 0x0F : row[g * 32 + i - 32] >> 4);
      const size_t b = kk / p.block, at = b * p.panel + j;
      const float zp = p.zero_points ? p.panel_zero_points(panel)[at] : p.default_zp;
      w[kk * p.n + nn] = p.panel_scales(panel)[at] * (static_cast<float>(q) - zp);
    }
  }
  return w;
}

std::vector<float> QuantWeights::block_norms(const BlockPartition& partition) const {
  const std::vector<float> w = dequantized();
  std::vector<float> norms(partition.num_blocks, 0.0f);
  for (size_t b = 0; b < partition.num_blocks; ++b) {
    double s = 0.0;
    for (size_t r = partition.begin(b); r < partition.end(b); ++r)
      for (size_t j = 0; j < packed_.n; ++j) s += static_cast<double>(w[r * packed_.n + j]) * w[r * packed_.n + j];
    norms[b] = static_cast<float>(std::sqrt(s));
  }
  return norms;
}

bool int8_decode_for_accuracy_level(int64_t accuracy_level) {
  if (accuracy_level < 0 || accuracy_level > 4)
    fail("attribute accuracy_level=", accuracy_level, " is not one of MatMulNBits' levels 0-4");
  return accuracy_level == 4;
}

QuantBackend::QuantBackend(std::shared_ptr<const QuantWeights> weights, QuantTuning tuning)
    : weights_(std::move(weights)), tuning_(tuning),
      decode_dispatch_(std::make_unique<MeasuredDispatch>(tuning.decode_dispatch)) {}

BackendStats QuantBackend::run(const float* x, size_t m, const GatedRows& gated, const float* bias, float* y,
                               const kernels::KernelSet& kernels, const TaskRunner& runner) const {
  return run_quant(x, m, gated, bias, y, *kernels.quant, runner);
}

BackendStats QuantBackend::run_quant(const float* x, size_t m, const GatedRows& gated, const float* bias, float* y,
                                     const QuantKernels& kernels, const TaskRunner& runner) const {
  BackendStats stats;
  if (m == 0) return stats;
  // Reused per calling thread (the tasks only see what is taken from them here).
  thread_local std::vector<size_t> dense_tokens, decode_tokens;
  dense_tokens.clear();
  decode_tokens.clear();
  for (size_t t = 0; t < m; ++t) (gated.dense[t] ? dense_tokens : decode_tokens).push_back(t);
  if (dense_tokens.size() < std::max<size_t>(1, tuning_.prefill_min_tokens)) {
    decode_tokens.insert(decode_tokens.end(), dense_tokens.begin(), dense_tokens.end());
    dense_tokens.clear();
  }
  if (!decode_tokens.empty()) run_decode(x, decode_tokens, gated, bias, y, kernels, runner, stats);
  if (!dense_tokens.empty()) run_prefill(x, dense_tokens, gated, bias, y, kernels, runner);
  return stats;
}

namespace {

// One decode task: token `token`'s kept rows within K-blocks [b0, b1) (rows: the sorted list, null:
// every row) over panels [panel0, panel1), summed into partial sum `slot` (partial + slot · width).
struct DecodeTask {
  size_t token, b0, b1, nrows, lookahead;  // lookahead: list entries after this task's (prefetched only)
  const int32_t* rows;
  size_t panel0, panel1, slot;
};

// A decode call's work buffers, one set per calling thread, kept across calls (the tasks only see
// what is taken from them here).
struct DecodeBuffers {
  std::vector<DecodeTask> tasks;
  std::vector<size_t> token_tasks;  // first task of each token, then the end
  AlignedBuffer<float> partial, acc;
  // int8 decode: each token's kept activations, quantized (x_q, per-block scale and sum); masked:
  // a token's row with its gated-off entries zeroed.
  AlignedBuffer<float> masked;
  AlignedBuffer<int8_t> x_q;
  std::vector<float> x_scale;
  std::vector<int32_t> x_sum;
  AlignedBuffer<int32_t> iacc;
};

// The decode tasks of `tokens` into buf.tasks / buf.token_tasks; returns the partial sums they
// write. Per token, its K-blocks in a few chunks (each streams the kept rows of its blocks, whole
// panel rows, into a partial sum of its own), or, for a layer of decode_panel_tasks panels or
// more, one task per panel.
size_t plan_decode_tasks(const QuantPacked& p, const std::vector<size_t>& tokens, const GatedRows& gated,
                         const QuantTuning& tuning, DecodeBuffers& buf) {
  const size_t k = p.k, nb = p.num_blocks;
  buf.tasks.clear();
  buf.token_tasks.clear();
  size_t slots = 0;
  for (size_t t : tokens) {
    buf.token_tasks.push_back(buf.tasks.size());
    const size_t count = gated.row_count(t, k);
    // A gated token's list may be empty (and its pointer null): the kernels read rows == nullptr as
    // "every row", so an empty list points at a dummy entry instead.
    static const int32_t kNoRow = 0;
    const int32_t* rows = gated.dense[t] ? nullptr : count ? gated.rows.data() + gated.offset[t] : &kNoRow;
    if (p.num_panels >= tuning.decode_panel_tasks) {
      // A wide layer (a head): one task per panel, every kept row; the panels' columns are disjoint,
      // so the tasks write one partial sum and nothing is added up at the end.
      for (size_t panel = 0; panel < p.num_panels; ++panel)
        buf.tasks.push_back(DecodeTask{t, 0, nb, rows ? count : 0, 0, rows, panel, panel + 1, slots});
      ++slots;
      continue;
    }
    const size_t chunks = std::max<size_t>(
        1, std::min({tuning.decode_row_chunks, nb, count / std::max<size_t>(1, tuning.decode_min_chunk_rows)}));
    for (size_t c = 0; c < chunks; ++c) {
      DecodeTask task{t, nb * c / chunks, nb * (c + 1) / chunks, 0, 0, nullptr, 0, p.num_panels, slots++};
      if (rows) {
        const int32_t* lo = std::lower_bound(rows, rows + count, static_cast<int32_t>(task.b0 * p.block));
        const int32_t* hi = std::lower_bound(lo, rows + count, static_cast<int32_t>(std::min(k, task.b1 * p.block)));
        task.rows = lo;
        task.nrows = static_cast<size_t>(hi - lo);
        task.lookahead = static_cast<size_t>(rows + count - hi);
      }
      buf.tasks.push_back(task);
    }
  }
  buf.token_tasks.push_back(buf.tasks.size());
  return slots;
}

// int8 decode: each token's kept activations quantized once (its gated-off rows zeroed first, so
// that a block's scale is its kept rows' amax), shared by the token's tasks; and the tasks' int32
// accumulators.
void quantize_decode_tokens(const QuantPacked& p, const float* x, const std::vector<size_t>& tokens,
                            const GatedRows& gated, const QuantKernels& kernels, DecodeBuffers& buf) {
  const size_t k = p.k, nb = p.num_blocks, ldq = nb * p.block;
  if (buf.x_q.size() < tokens.size() * ldq) buf.x_q.resize(tokens.size() * ldq);
  if (buf.masked.size() < ldq) buf.masked.resize(ldq);
  buf.x_scale.resize(tokens.size() * nb);
  buf.x_sum.resize(tokens.size() * nb);
  for (size_t i = 0; i < tokens.size(); ++i) {
    const size_t t = tokens[i];
    const float* xt = x + t * k;
    if (!gated.dense[t]) {
      float* masked = buf.masked.data();
      std::fill(masked, masked + k, 0.0f);
      for (size_t at = gated.offset[t]; at < gated.offset[t + 1]; ++at) masked[gated.rows[at]] = xt[gated.rows[at]];
      xt = masked;
    }
    kernels.quantize(xt, k, p.block, nb, 1.0f, buf.x_q.data() + i * ldq, nullptr, buf.x_scale.data() + i * nb,
                     buf.x_sum.data() + i * nb);
  }
  if (buf.iacc.size() < buf.tasks.size() * p.panel) buf.iacc.resize(buf.tasks.size() * p.panel);
}

// Weight bytes the tasks stream (the dispatch's measure of a call's size).
size_t decode_stream_bytes(const QuantPacked& p, const std::vector<DecodeTask>& tasks) {
  size_t bytes = 0;
  for (const DecodeTask& task : tasks)
    bytes += (task.rows ? task.nrows : std::min(p.k, task.b1 * p.block) - task.b0 * p.block) *
             (task.panel1 - task.panel0) * p.panel * p.bits / 8;
  return bytes;
}

// y of each token: bias + gate scale x the sum of its tasks' partial sums.
void add_decode_partials(const QuantPacked& p, const std::vector<size_t>& tokens, const GatedRows& gated,
                         const float* bias, float* y, const DecodeBuffers& buf) {
  const size_t n = p.n, width = p.num_panels * p.panel;
  const float* partial = buf.partial.data();
  for (size_t i = 0; i < tokens.size(); ++i) {
    const size_t t = tokens[i], first = buf.token_tasks[i], last = buf.token_tasks[i + 1];
    const float s = gated.scale[t];
    float* yt = y + t * n;
    const size_t slot0 = buf.tasks[first].slot, slot1 = buf.tasks[last - 1].slot + 1;
    const float* p0 = partial + slot0 * width;
    if (slot1 - slot0 == 1) {
      for (size_t j = 0; j < n; ++j) yt[j] = (bias ? bias[j] : 0.0f) + s * p0[j];
      continue;
    }
    for (size_t j = 0; j < n; ++j) yt[j] = p0[j];
    for (size_t c = slot0 + 1; c < slot1; ++c) {
      const float* pc = partial + c * width;
      for (size_t j = 0; j < n; ++j) yt[j] += pc[j];
    }
    for (size_t j = 0; j < n; ++j) yt[j] = (bias ? bias[j] : 0.0f) + s * yt[j];
  }
}

}  // namespace

// Decode: the tokens' tasks planned (plan_decode_tasks), int8 activations quantized when asked,
// the tasks run on the pool or the calling thread (the node's measured dispatch), the partial sums
// added into y.
void QuantBackend::run_decode(const float* x, const std::vector<size_t>& tokens, const GatedRows& gated,
                              const float* bias, float* y, const QuantKernels& kernels,
                              const TaskRunner& runner, BackendStats& stats) const {
  const QuantPacked& p = weights_->packed();
  const size_t k = p.k, nb = p.num_blocks, width = p.num_panels * p.panel, ldq = nb * p.block;
  thread_local DecodeBuffers buf;
  const size_t slots = plan_decode_tasks(p, tokens, gated, tuning_, buf);
  if (tuning_.int8_decode) quantize_decode_tokens(p, x, tokens, gated, kernels, buf);
  if (buf.partial.size() < slots * width) buf.partial.resize(slots * width);
  if (buf.acc.size() < buf.tasks.size() * p.panel) buf.acc.resize(buf.tasks.size() * p.panel);
  float* const partial = buf.partial.data();
  float* const acc = buf.acc.data();
  const DecodeTask* const task_list = buf.tasks.data();
  std::function<void(size_t)> task_fn;
  if (tuning_.int8_decode) {
    int32_t* const iacc = buf.iacc.data();
    const int8_t* const xq = buf.x_q.data();
    const float* const xscale = buf.x_scale.data();
    const int32_t* const xsum = buf.x_sum.data();
    const size_t* const first_task = buf.token_tasks.data();
    task_fn = [&, partial, iacc, task_list, xq, xscale, xsum, first_task](size_t i) {
      const DecodeTask& task = task_list[i];
      // The token's position in `tokens`: the last token whose first task is <= i.
      const size_t slot = static_cast<size_t>(std::upper_bound(first_task, first_task + tokens.size(), i) - first_task) - 1;
      QuantDecodeActivations acts;
      acts.q = xq + slot * ldq;
      acts.scale = xscale + slot * nb;
      acts.sum = xsum + slot * nb;
      for (size_t panel = task.panel0; panel < task.panel1; ++panel)
        kernels.decode_int8(p, panel, task.b0, task.b1, acts, task.rows, task.nrows, task.lookahead,
                            partial + task.slot * width + panel * p.panel, iacc + i * p.panel);
    };
  } else {
    task_fn = [&, partial, acc, task_list](size_t i) {
      const DecodeTask& task = task_list[i];
      for (size_t panel = task.panel0; panel < task.panel1; ++panel)
        kernels.decode(p, panel, task.b0, task.b1, x + task.token * k, task.rows, task.nrows, task.lookahead,
                       partial + task.slot * width + panel * p.panel, acc + i * p.panel);
    };
  }
  const size_t n_tasks = buf.tasks.size();
  stats.count_decode(n_tasks, decode_dispatch_->run(runner, n_tasks, decode_stream_bytes(p, buf.tasks), task_fn));
  add_decode_partials(p, tokens, gated, bias, y, buf);
}

// Prefill: the dense tokens' activations are quantized once; the columns are split into chunks of
// whole groups, and each task runs every token over each of its chunks (a chunk's weights are
// repacked once by the kernel and reused by all tokens).
void QuantBackend::run_prefill(const float* x, const std::vector<size_t>& tokens, const GatedRows& gated,
                               const float* bias, float* y, const QuantKernels& kernels,
                               const TaskRunner& runner) const {
  const QuantPacked& p = weights_->packed();
  const size_t k = p.k, n = p.n, nb = p.num_blocks, ldq = nb * p.block, mt = tokens.size();
  thread_local AlignedBuffer<int8_t> q_buffer;
  thread_local AlignedBuffer<int16_t> q16_buffer;
  thread_local std::vector<float> scale_buffer;
  thread_local std::vector<int32_t> sum_buffer;
  thread_local std::vector<float*> ys_buffer;
  thread_local AlignedBuffer<uint8_t> scratch_buffer;
  if (q_buffer.size() < mt * ldq) q_buffer.resize(mt * ldq);
  if (q16_buffer.size() < mt * ldq) q16_buffer.resize(mt * ldq);
  scale_buffer.resize(mt * nb);
  sum_buffer.resize(mt * nb);
  for (size_t i = 0; i < mt; ++i) {
    const size_t t = tokens[i];
    int8_t* q = q_buffer.data() + i * ldq;
    kernels.quantize(x + t * k, k, p.block, nb, gated.scale[t], q, q16_buffer.data() + i * ldq,
                     scale_buffer.data() + i * nb, sum_buffer.data() + i * nb);
  }
  QuantActivations acts;
  acts.m = mt;
  acts.ldq = ldq;
  acts.q = q_buffer.data();
  acts.q16 = q16_buffer.data();
  acts.scale = scale_buffer.data();
  acts.sum = sum_buffer.data();

  const size_t groups_per_panel = p.panel / kQuantGroup, groups = p.num_panels * groups_per_panel;
  size_t span = (groups + std::max<size_t>(1, tuning_.prefill_max_tasks) - 1) / std::max<size_t>(1, tuning_.prefill_max_tasks);
  if (p.bits == 4) span = round_up(span, 2);  // 4-bit kernels read two groups' rows as one 64-byte line
  const size_t task_count = (groups + span - 1) / span;
  const size_t scratch_bytes = round_up(std::max<size_t>(1, kernels.prefill_scratch_bytes(p, mt)), 64);
  if (scratch_buffer.size() < task_count * scratch_bytes) scratch_buffer.resize(task_count * scratch_bytes);
  ys_buffer.resize(task_count * mt);
  uint8_t* const scratch = scratch_buffer.data();
  float** const ys_all = ys_buffer.data();
  const size_t* const token_list = tokens.data();
  runner.run(task_count, [&, scratch, ys_all, token_list](size_t task) {
    const size_t g0 = task * span, g1 = std::min(groups, g0 + span);
    float** ys = ys_all + task * mt;
    for (size_t g = g0; g < g1;) {
      const size_t panel = g / groups_per_panel;
      const size_t end = std::min(g1, (panel + 1) * groups_per_panel);
      const size_t c0 = (g - panel * groups_per_panel) * kQuantGroup, c1 = (end - panel * groups_per_panel) * kQuantGroup;
      g = end;
      const size_t col = panel * p.panel + c0;
      if (col >= n) continue;
      for (size_t i = 0; i < mt; ++i) ys[i] = y + token_list[i] * n + col;
      kernels.prefill(p, panel, c0, c1, acts, ys, std::min(c1 - c0, n - col), bias ? bias + col : nullptr,
                      scratch + task * scratch_bytes);
    }
  });
}

}  // namespace ortsparse::engine
