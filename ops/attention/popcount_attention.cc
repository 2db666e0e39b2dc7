#include "attention/popcount_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <limits>
#include <vector>

#include "common/error.h"
#include "engine/kwta_gate.h"
#include "engine/order_key.h"

namespace ortsparse::attention {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kPosInf = std::numeric_limits<float>::infinity();
constexpr float kMaskedOut = -1e30f;  // an additive mask below this excludes the key from selection
constexpr size_t kCenterRows = 256;  // keys the center μ is the mean of (the first ones)

// One query row's view of the mask: value(j) is what is added to the scaled score of key j.
struct MaskRow {
  const uint8_t* keep = nullptr;
  const float* add = nullptr;
  size_t stride = 0;
  float value(size_t j) const {
    if (keep) return keep[j * stride] ? 0.0f : kNegInf;
    if (add) return add[j * stride];
    return 0.0f;
  }
};

// Everything a task needs about one call; raw pointers only (tasks run on ORT's threads).
struct Call {
  const float *q, *k, *v;
  float* y;
  AttentionDims dims;
  MaskView mask;
  float scale;
  size_t words, planes, block_words;
  const uint64_t* packed;  // per (b, hkv): n_key_blocks * block_words
  const float* gamma;      // per (b, hkv): skv (padded to blocks)
  const float* energy;     // per (b, hkv): skv
  size_t key_blocks;
  size_t packed_dim;       // D, or proj_bits
  const float* projection; // [D, proj_bits] or null
  bool select;             // the selector runs for this call
};

struct Scratch {
  std::vector<float> sel, scores;
  std::vector<int32_t> counts, kept, final_rows, cand, next;
  std::vector<uint32_t> keys, hist;
  std::vector<uint64_t> comp;
  std::vector<uint32_t> topk;
  std::vector<uint64_t> qbits;
  std::vector<float> qproj;
  uint64_t keys_total = 0, keys_exact = 0;
};

}  // namespace

size_t pack_planes(PackMode mode) { return mode == PackMode::kTernary ? 2 : 1; }

float pack_vector(const float* x, size_t d, PackMode mode, float eps, uint64_t* out, size_t stride, uint64_t* bits_set) {
  return attention_kernels_scalar().pack_row(x, d, static_cast<int>(mode), eps, out, stride, bits_set);
}

std::vector<float> projection_matrix(size_t d, size_t bits) {
  std::vector<float> r(d * bits);
  uint64_t state = 0x243F6A8885A308D3ull;
  auto next = [&state]() {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  };
  for (size_t i = 0; i < r.size(); i += 2) {
    const double u1 = (static_cast<double>(next() >> 11) + 1.0) * 0x1.0p-53;  // (0, 1]
    const double u2 = static_cast<double>(next() >> 11) * 0x1.0p-53;
    const double radius = std::sqrt(-2.0 * std::log(u1)), angle = 6.283185307179586 * u2;
    r[i] = static_cast<float>(radius * std::cos(angle));
    if (i + 1 < r.size()) r[i + 1] = static_cast<float>(radius * std::sin(angle));
  }
  return r;
}

std::shared_ptr<const std::vector<float>> PopcountAttention::projection_for(size_t d) const {
  const size_t bits = static_cast<size_t>(config_.proj_bits);
  std::lock_guard<std::mutex> lock(cache_mutex_);
  if (!projection_ || projection_->size() != d * bits)
    projection_ = std::make_shared<const std::vector<float>>(projection_matrix(d, bits));
  return projection_;
}

PackMode parse_pack_mode(const std::string& name) {
  if (name == "sign") return PackMode::kSign;
  if (name == "binary") return PackMode::kBinary;
  if (name == "ternary") return PackMode::kTernary;
  fail("attribute mode='", name, "' is not one of sign, binary, ternary");
}

Selector parse_selector(const std::string& name) {
  if (name == "none") return Selector::kNone;
  if (name == "popcount") return Selector::kPopcount;
  if (name == "energy") return Selector::kEnergy;
  fail("attribute select='", name, "' is not one of popcount, energy, none");
}

const char* pack_mode_name(PackMode mode) {
  switch (mode) {
    case PackMode::kSign: return "sign";
    case PackMode::kBinary: return "binary";
    default: return "ternary";
  }
}

const char* selector_name(Selector select) {
  switch (select) {
    case Selector::kPopcount: return "popcount";
    case Selector::kEnergy: return "energy";
    default: return "none";
  }
}

PopcountAttention::PopcountAttention(const PopcountAttentionConfig& config, PopcntPath popcnt, Isa isa)
    : config_(config),
      popcnt_(popcnt),
      pop_(&popcount_table(popcnt)),
      attn_(&attention_kernels_for(isa)),
      kernels_(&engine::kernels_for(isa)) {
  if (!std::isfinite(config.scale) || config.scale < 0.0f)
    fail("attribute scale=", config.scale, " must be >= 0 (0: 1/sqrt(D))");
  if (config.topk < 0) fail("attribute topk=", config.topk, " must be >= 0 (0: approximate scores only)");
  if (config.proj_bits < 0 || config.proj_bits > 4096)
    fail("attribute proj_bits=", config.proj_bits, " must be in [0, 4096] (0: no projection)");
  if (config.keep_first < 0) fail("attribute keep_first=", config.keep_first, " must be >= 0");
  if (config.keep_recent < 0) fail("attribute keep_recent=", config.keep_recent, " must be >= 0");
  if (config.min_keys < 0) fail("attribute min_keys=", config.min_keys, " must be >= 0");
  if (!(config.eps >= 0.0f)) fail("attribute eps=", config.eps, " must be >= 0");
  if (!(config.density_max > 0.0f && config.density_max <= 1.0f))
    fail("attribute density_max=", config.density_max, " must be in (0, 1] (1: never auto-disable)");
  if (!(config.candidates >= 1.0f && config.candidates <= 1024.0f))
    fail("attribute candidates=", config.candidates, " must be in [1, 1024]");
  if (config.topk == 0 && config.select == Selector::kEnergy)
    fail("attribute topk=0 (approximate scores, no refine) needs select='popcount'; select='energy' has no "
         "approximate score");
  if (!popcnt_path_supported(popcnt)) fail("popcount path ", popcnt_path_name(popcnt), " is not supported by this CPU");
  if (!isa_supported(isa)) fail("ISA ", isa_name(isa), " is not supported by this CPU");
}

namespace {

// Indices (ascending) of the k largest of v[0:n], ties to the lower index. A threshold from a
// strided sample of 256 values (ranked with some slack) lets one branch-free pass keep ~1.3k
// candidates; the exact top k is then taken among those (total order: value, then lower index).
// If the sample was unlucky (fewer than k candidates), all n are candidates. Measured on 4096
// keys, 9 heads: the selection was the largest cost of a decode step before this (radix select
// histograms serialise on the few bins float keys fall in).
size_t top_k_select(const float* v, size_t n, size_t k, int32_t* kept, Scratch& s) {
  if (k >= n) {
    for (size_t i = 0; i < n; ++i) kept[i] = static_cast<int32_t>(i);
    return n;
  }
  if (k == 0) return 0;
  uint32_t* keys = s.keys.data();
  for (size_t i = 0; i < n; ++i) keys[i] = engine::order_key(v[i]);
  constexpr size_t kSample = 256;
  uint32_t threshold = 0;
  if (n >= 2 * kSample && 2 * k < n) {
    uint32_t* sample = s.hist.data();
    const size_t step = n / kSample;
    for (size_t j = 0; j < kSample; ++j) sample[j] = keys[j * step];
    const size_t rank = std::min(kSample - 1, (k * kSample) / n + (k * kSample) / (4 * n) + 8);
    std::nth_element(sample, sample + rank, sample + kSample, std::greater<uint32_t>());
    threshold = sample[rank];
  }
  int32_t* cand = s.cand.data();
  size_t c = 0;
  for (size_t i = 0; i < n; ++i) {
    cand[c] = static_cast<int32_t>(i);
    c += keys[i] >= threshold;
  }
  if (c < k) {
    for (size_t i = 0; i < n; ++i) cand[i] = static_cast<int32_t>(i);
    c = n;
  }
  if (c > k) {
    // (key, lower index first) as one integer, so nth_element compares plain uint64 values.
    uint64_t* comp = s.comp.data();
    for (size_t t = 0; t < c; ++t) {
      const uint32_t i = static_cast<uint32_t>(cand[t]);
      comp[t] = (static_cast<uint64_t>(keys[i]) << 32) | (0xFFFFFFFFu - i);
    }
    std::nth_element(comp, comp + (k - 1), comp + c, std::greater<uint64_t>());
    for (size_t t = 0; t < k; ++t) cand[t] = static_cast<int32_t>(0xFFFFFFFFu - static_cast<uint32_t>(comp[t]));
  }
  std::copy_n(cand, k, kept);
  if (k <= 64 || k * 8 < n) {
    std::sort(kept, kept + k);
  } else {  // many of n: mark and scan, O(n) instead of k log k
    uint8_t* mark = reinterpret_cast<uint8_t*>(s.comp.data());
    std::fill(mark, mark + n, uint8_t{0});
    for (size_t t = 0; t < k; ++t) mark[kept[t]] = 1;
    size_t out = 0, i = 0;
    for (; i + 8 <= n; i += 8) {  // mostly empty groups of 8: skip them a word at a time
      uint64_t group;
      std::memcpy(&group, mark + i, sizeof(group));
      if (group == 0) continue;
      for (size_t j = i; j < i + 8; ++j) {
        kept[out] = static_cast<int32_t>(j);
        out += mark[j];
      }
    }
    for (; i < n; ++i) {
      kept[out] = static_cast<int32_t>(i);
      out += mark[i];
    }
  }
  return k;
}

// s[j] += mask value of key j, for keys 0..n-1 (branches hoisted so the loops vectorise).
void add_mask(const MaskRow& m, float* s, size_t n) {
  if (m.add) {
    if (m.stride == 1) {
      for (size_t j = 0; j < n; ++j) s[j] += m.add[j];
    } else {
      for (size_t j = 0; j < n; ++j) s[j] += m.add[j * m.stride];
    }
  } else if (m.keep) {
    for (size_t j = 0; j < n; ++j) s[j] = m.keep[j * m.stride] ? s[j] : kNegInf;
  }
}

// Exact scores of the listed keys (rows == nullptr: keys 0..n-1): s = q·k * scale + mask.
void exact_scores(const Call& c, const AttentionKernels& attn, const float* qrow, const float* khead, const MaskRow& m,
                  const int32_t* rows, size_t n, float* s) {
  attn.dot_rows(qrow, khead, c.dims.d, c.dims.d, rows, n, s);
  for (size_t i = 0; i < n; ++i) s[i] *= c.scale;
  if (rows == nullptr) {
    add_mask(m, s, n);
  } else if (m.add || m.keep) {
    for (size_t i = 0; i < n; ++i) s[i] += m.value(static_cast<size_t>(rows[i]));
  }
}

// y = softmax(s) · V[rows]; s is overwritten by the probabilities. All -inf: y = 0.
void softmax_pv(const Call& c, const engine::KernelTable& kernels, float* s, const int32_t* rows, size_t n,
                const float* vhead, float* yrow) {
  float mx = kNegInf;
  for (size_t i = 0; i < n; ++i) mx = std::max(mx, s[i]);
  if (n == 0 || mx == kNegInf) {
    std::fill(yrow, yrow + c.dims.dv, 0.0f);
    return;
  }
  double sum = 0.0;
  for (size_t i = 0; i < n; ++i) {
    s[i] = std::exp(s[i] - mx);
    sum += s[i];
  }
  const float inv = static_cast<float>(1.0 / sum);
  for (size_t i = 0; i < n; ++i) s[i] *= inv;
  kernels.gemv_rows(vhead, c.dims.dv, rows, s, n, yrow, c.dims.dv, false);
}

}  // namespace

std::shared_ptr<PopcountAttention::KeyCache> PopcountAttention::prepare_keys(const float* k, const AttentionDims& dims,
                                                                                 const TaskRunner& runner,
                                                                                 AttentionStats& stats) const {
  const size_t heads_kv = dims.b * dims.hkv, d = dims.d, skv = dims.skv;
  const bool popcount = config_.select == Selector::kPopcount;
  const size_t dp = config_.proj_bits > 0 ? static_cast<size_t>(config_.proj_bits) : d;  // packed length
  const size_t need_blocks = (skv + kLanes - 1) / kLanes;

  // Reuse of the previous call's packed keys (decode with a growing KV cache): the rows it packed
  // are taken as unchanged when its fingerprint rows (first, middle, last) are bit-identical in
  // this call's K. In a causal LM, K[j] depends only on tokens 0..j, so an identical last row
  // means an identical prefix; were it ever wrong, only the selection would suffer (refine and
  // output always use this call's K and V). The cache is taken out of the kernel while a call
  // extends it: a concurrent call sees none and packs its own.
  size_t reuse = 0;
  std::shared_ptr<KeyCache> old;
  if (config_.cache_keys) {
    std::lock_guard<std::mutex> lock(cache_mutex_);
    old = std::move(cache_);
  }
  // With centering, μ is the mean of the first min(Skv, kCenterRows) keys: a property of the
  // sequence prefix, not of the call history, so a cache may be extended only once it covers them.
  const bool center = popcount && config_.center;
  const bool center_ok = !center || (old && old->skv >= std::min(skv, kCenterRows));
  if (old && center_ok && old->heads_kv == heads_kv && old->d == d && old->skv <= skv && old->skv > 0) {
    bool same = true;
    for (size_t hk = 0; hk < heads_kv && same; ++hk)
      for (size_t f = 0; f < KeyCache::kFingerprintRows && same; ++f) {
        const size_t row = old->fingerprint_row(f);
        same = std::memcmp(k + (hk * skv + row) * d, old->fingerprint.data() + (hk * KeyCache::kFingerprintRows + f) * d,
                           d * sizeof(float)) == 0;
      }
    if (same) reuse = old->skv;
  }
  std::shared_ptr<KeyCache> fresh;
  if (reuse > 0 && old.use_count() == 1 && old->cap_blocks >= need_blocks) {
    fresh = old;  // no run holds it: extend in place (new rows go to unused lanes / blocks)
  } else {
    fresh = std::make_shared<KeyCache>();
    KeyCache& n = *fresh;
    n.heads_kv = heads_kv;
    n.d = d;
    n.words = popcount ? (dp + 63) / 64 : 0;
    n.planes = popcount ? pack_planes(config_.mode) : 0;
    n.block_words = n.planes * n.words * kLanes;
    n.packed_dim = dp;
    // Headroom so the following decode steps extend in place.
    n.cap_blocks = config_.cache_keys ? need_blocks + need_blocks / 2 + 8 : need_blocks;
    n.bits_set.assign(heads_kv, 0);
    if (popcount) {
      n.packed.assign(heads_kv * n.cap_blocks * n.block_words, 0);
      n.gamma.assign(heads_kv * n.cap_blocks * kLanes, 0.0f);
    } else {
      n.energy.assign(heads_kv * n.cap_blocks * kLanes, 0.0f);
    }
    if (reuse > 0) {
      const size_t old_blocks = (reuse + kLanes - 1) / kLanes;
      for (size_t hk = 0; hk < heads_kv; ++hk) {
        if (popcount) {
          std::copy_n(old->packed.data() + hk * old->cap_blocks * n.block_words, old_blocks * n.block_words,
                      n.packed.data() + hk * n.cap_blocks * n.block_words);
          std::copy_n(old->gamma.data() + hk * old->cap_blocks * kLanes, reuse, n.gamma.data() + hk * n.cap_blocks * kLanes);
        } else {
          std::copy_n(old->energy.data() + hk * old->cap_blocks * kLanes, reuse, n.energy.data() + hk * n.cap_blocks * kLanes);
        }
        n.bits_set[hk] = old->bits_set[hk];
      }
      n.center = old->center;
    }
  }
  KeyCache& kc = *fresh;
  kc.skv = skv;
  kc.key_blocks = need_blocks;
  if (center && reuse == 0) {
    // q·(k − μ) ranks keys as q·k does, and centered keys carry informative sign bits.
    const size_t rows = std::min(skv, kCenterRows);
    kc.center.assign(heads_kv * d, 0.0f);
    for (size_t hk = 0; hk < heads_kv; ++hk) {
      std::vector<double> sum(d, 0.0);
      for (size_t j = 0; j < rows; ++j)
        for (size_t i = 0; i < d; ++i) sum[i] += k[(hk * skv + j) * d + i];
      for (size_t i = 0; i < d; ++i) kc.center[hk * d + i] = static_cast<float>(sum[i] / static_cast<double>(rows));
    }
  }
  std::shared_ptr<const std::vector<float>> proj;
  if (popcount && config_.proj_bits > 0) proj = projection_for(d);
  kc.projection = proj;
  const float* proj_p = proj ? proj->data() : nullptr;
  const engine::KernelTable* kernels = kernels_;
  KeyCache* kp = &kc;
  const AttentionKernels* attn = attn_;
  const int mode = static_cast<int>(config_.mode);
  const float eps = config_.eps;
  runner.run(heads_kv, [=](size_t hk) {
    const float* kh = k + hk * skv * d;
    if (popcount) {
      uint64_t* out = kp->packed.data() + hk * kp->cap_blocks * kp->block_words;
      float* g = kp->gamma.data() + hk * kp->cap_blocks * kLanes;
      std::vector<float> centered(center ? d : 0), projected(proj_p ? dp : 0);
      for (size_t j = reuse; j < skv; ++j) {
        const float* x = kh + j * d;
        if (center) {
          const float* mu = kp->center.data() + hk * d;
          for (size_t i = 0; i < d; ++i) centered[i] = x[i] - mu[i];
          x = centered.data();
        }
        if (proj_p) {
          kernels->gemv_rows(proj_p, dp, nullptr, x, d, projected.data(), dp, false);
          x = projected.data();
        }
        g[j] = attn->pack_row(x, dp, mode, eps, out + (j / kLanes) * kp->block_words + j % kLanes, kLanes,
                              &kp->bits_set[hk]);
      }
    } else {
      for (size_t j = reuse; j < skv; ++j) {
        double s = 0.0;
        for (size_t i = 0; i < d; ++i) s += static_cast<double>(kh[j * d + i]) * kh[j * d + i];
        kp->energy[hk * kp->cap_blocks * kLanes + j] = static_cast<float>(std::sqrt(s));
      }
    }
  });
  stats.keys_packed = static_cast<uint64_t>(heads_kv) * (skv - reuse);
  if (config_.cache_keys) {
    kc.fingerprint.resize(heads_kv * KeyCache::kFingerprintRows * d);
    for (size_t hk = 0; hk < heads_kv; ++hk)
      for (size_t f = 0; f < KeyCache::kFingerprintRows; ++f)
        std::copy_n(k + (hk * skv + kc.fingerprint_row(f)) * d, d,
                    kc.fingerprint.data() + (hk * KeyCache::kFingerprintRows + f) * d);
    std::lock_guard<std::mutex> lock(cache_mutex_);
    cache_ = fresh;
  }
  return fresh;
}

AttentionStats PopcountAttention::run(const float* q, const float* k, const float* v, const MaskView& mask,
                                      const AttentionDims& dims, float* y, const TaskRunner& runner) const {
  AttentionStats stats;
  const size_t rows_total = dims.b * dims.h * dims.sq;
  if (rows_total == 0 || dims.dv == 0) return stats;
  Call c{};
  c.q = q;
  c.k = k;
  c.v = v;
  c.y = y;
  c.dims = dims;
  c.mask = mask;
  c.scale = config_.scale > 0.0f ? config_.scale : static_cast<float>(1.0 / std::sqrt(static_cast<double>(dims.d)));
  const size_t heads_kv = dims.b * dims.hkv;
  c.select = config_.select != Selector::kNone && dims.skv >= static_cast<size_t>(config_.min_keys) && dims.skv > 0 &&
             (config_.topk == 0 || dims.skv > static_cast<size_t>(config_.topk));

  std::shared_ptr<const KeyCache> keys;
  if (c.select) {
    keys = prepare_keys(k, dims, runner, stats);
    c.key_blocks = keys->cap_blocks;  // per-head stride of the packed arrays
    c.words = keys->words;
    c.planes = keys->planes;
    c.block_words = keys->block_words;
    c.packed = keys->packed.data();
    c.gamma = keys->gamma.data();
    c.energy = keys->energy.data();
    c.packed_dim = keys->packed_dim;
    c.projection = keys->projection ? keys->projection->data() : nullptr;
    if (config_.select == Selector::kPopcount) {
      for (uint64_t b : keys->bits_set) stats.bits_set += b;
      stats.bits_total = static_cast<uint64_t>(heads_kv) * dims.skv * keys->packed_dim;
      const double density = static_cast<double>(stats.bits_set) / static_cast<double>(stats.bits_total ? stats.bits_total : 1);
      // Sign packing is dense by construction (half the bits set); the sparsity check is for the
      // eps-thresholded modes, as in seed 003.
      if (config_.mode != PackMode::kSign && density > config_.density_max) c.select = false;
    }
  }
  stats.packed = c.select;

  const size_t n_tasks = std::min<size_t>(rows_total, 64);
  std::unique_ptr<std::vector<Scratch>> pooled;
  {
    std::lock_guard<std::mutex> lock(scratch_mutex_);
    if (!scratch_pool_.empty()) {
      pooled.reset(static_cast<std::vector<Scratch>*>(scratch_pool_.back().release()));
      scratch_pool_.pop_back();
    }
  }
  if (!pooled) pooled = std::make_unique<std::vector<Scratch>>();
  std::vector<Scratch>& scratch = *pooled;
  if (scratch.size() < n_tasks) scratch.resize(n_tasks);
  const size_t pad = ((dims.skv + kLanes - 1) / kLanes) * kLanes + engine::kIndexSlack;
  for (size_t t = 0; t < n_tasks; ++t) {
    Scratch& s = scratch[t];
    s.keys_total = s.keys_exact = 0;
    const size_t dp = config_.proj_bits > 0 ? static_cast<size_t>(config_.proj_bits) : dims.d;
    if (s.sel.size() >= pad && s.qbits.size() >= 2 * ((dp + 63) / 64) + 1 && s.qproj.size() >= dp) continue;
    s.qproj.resize(dp);
    s.sel.resize(pad);
    s.scores.resize(pad);
    s.counts.resize(pad);
    s.kept.resize(pad);
    s.final_rows.resize(pad);
    s.cand.resize(pad);
    s.next.resize(pad);
    s.keys.resize(pad);
    s.comp.resize(pad);
    s.hist.resize(2048);
    s.topk.resize(2 * pad + engine::kIndexSlack);
    s.qbits.resize(2 * ((dp + 63) / 64) + 1);
  }
  Scratch* scratch_p = scratch.data();
  const Call* cp = &c;
  const PopcountAttentionConfig* cfg = &config_;
  const PopcountTable* pop = pop_;
  const AttentionKernels* attn = attn_;
  const engine::KernelTable* kernels = kernels_;
  runner.run(n_tasks, [=](size_t task) {
    const Call& c = *cp;
    const AttentionDims& dd = c.dims;
    Scratch& s = scratch_p[task];
    const size_t begin = rows_total * task / n_tasks, end = rows_total * (task + 1) / n_tasks;
    const size_t group = dd.h / dd.hkv;
    for (size_t r = begin; r < end; ++r) {
      const size_t i = r % dd.sq, h = (r / dd.sq) % dd.h, b = r / (dd.sq * dd.h);
      const size_t hk = b * dd.hkv + h / group;
      const float* qrow = c.q + r * dd.d;
      const float* khead = c.k + hk * dd.skv * dd.d;
      const float* vhead = c.v + hk * dd.skv * dd.dv;
      float* yrow = c.y + r * dd.dv;
      // Causal with a KV cache: query i is token Skv - Sq + i of the sequence.
      size_t limit = dd.skv;
      if (cfg->causal) {
        const long long last = static_cast<long long>(dd.skv) - static_cast<long long>(dd.sq) + static_cast<long long>(i);
        limit = last < 0 ? 0 : std::min(dd.skv, static_cast<size_t>(last) + 1);
      }
      MaskRow m;
      m.keep = c.mask.keep ? c.mask.keep + b * c.mask.stride[0] + h * c.mask.stride[1] + i * c.mask.stride[2] : nullptr;
      m.add = c.mask.add ? c.mask.add + b * c.mask.stride[0] + h * c.mask.stride[1] + i * c.mask.stride[2] : nullptr;
      m.stride = c.mask.stride[3];
      s.keys_total += limit;
      const size_t topk = static_cast<size_t>(cfg->topk);
      if (!c.select || limit == 0 || (topk > 0 && limit <= topk)) {
        exact_scores(c, *attn, qrow, khead, m, nullptr, limit, s.scores.data());
        softmax_pv(c, *kernels, s.scores.data(), nullptr, limit, vhead, yrow);
        s.keys_exact += limit;
        continue;
      }
      float* sel = s.sel.data();
      if (cfg->select == Selector::kPopcount) {
        uint64_t unused = 0;
        const float* qx = qrow;
        if (c.projection) {
          kernels->gemv_rows(c.projection, c.packed_dim, nullptr, qrow, dd.d, s.qproj.data(), c.packed_dim, false);
          qx = s.qproj.data();
        }
        const float gq = attn->pack_row(qx, c.packed_dim, static_cast<int>(cfg->mode), cfg->eps, s.qbits.data(), 1, &unused);
        const uint64_t* kp = c.packed + hk * c.key_blocks * c.block_words;
        const float* gk = c.gamma + hk * c.key_blocks * kLanes;
        const size_t nb = (limit + kLanes - 1) / kLanes;
        int32_t* cnt = s.counts.data();
        switch (cfg->mode) {
          case PackMode::kSign: pop->xor_counts(s.qbits.data(), kp, c.words, nb, cnt); break;
          case PackMode::kBinary: pop->and_counts(s.qbits.data(), kp, c.words, nb, cnt); break;
          case PackMode::kTernary: pop->ternary_counts(s.qbits.data(), s.qbits.data() + c.words, kp, c.words, nb, cnt); break;
        }
        const int32_t d = static_cast<int32_t>(c.packed_dim);
        // Approximate q·k: sign: (agreements - disagreements)·γq·γk = (D - 2·hamming)·γq·γk;
        // binary: |q∧k|·γq·γk; ternary: (agree - disagree)·γq·γk. Same float op order as the
        // numpy reference, so the selections match exactly.
        if (cfg->mode == PackMode::kSign)
          for (size_t j = 0; j < limit; ++j) cnt[j] = d - 2 * cnt[j];
        for (size_t j = 0; j < limit; ++j) sel[j] = static_cast<float>(cnt[j]) * gq * gk[j] * c.scale;
        add_mask(m, sel, limit);
      } else {
        std::copy_n(c.energy + hk * c.key_blocks * kLanes, limit, sel);
        add_mask(m, sel, limit);
      }
      if (topk == 0) {  // the seed's pure approximate path: softmax of the approximate scores
        softmax_pv(c, *kernels, sel, nullptr, limit, vhead, yrow);
        continue;
      }
      // Exported models mask with a huge finite value (finfo.min): such keys are out of the
      // selection as -inf ones are (never candidates, never protected); refine still adds the
      // mask as given.
      if (m.add)
        for (size_t j = 0; j < limit; ++j) sel[j] = sel[j] < kMaskedOut ? kNegInf : sel[j];
      // Protected keys (the first keep_first, the last keep_recent of the causal prefix) are
      // always kept: +inf outranks every selector score. Masked-out keys stay out.
      const size_t first = std::min(limit, static_cast<size_t>(cfg->keep_first));
      const size_t recent_begin = limit - std::min(limit, static_cast<size_t>(cfg->keep_recent));
      size_t allowed = 0, forced = 0;
      if (m.add || m.keep) {
        for (size_t j = 0; j < limit; ++j) allowed += sel[j] != kNegInf;
      } else {
        allowed = limit;  // no mask: every key of the causal prefix is attendable
      }
      auto protect = [&](size_t j) {
        if (sel[j] != kNegInf) {
          sel[j] = kPosInf;
          ++forced;
        }
      };
      for (size_t j = 0; j < first; ++j) protect(j);
      for (size_t j = std::max(first, recent_begin); j < limit; ++j) protect(j);
      if (allowed <= topk + forced) {
        exact_scores(c, *attn, qrow, khead, m, nullptr, limit, s.scores.data());
        softmax_pv(c, *kernels, s.scores.data(), nullptr, limit, vhead, yrow);
        s.keys_exact += limit;
        continue;
      }
      const size_t want = std::min<size_t>(
          allowed,
          forced + std::max<size_t>(topk, static_cast<size_t>(std::ceil(static_cast<double>(cfg->candidates) * topk))));
      const size_t kept = top_k_select(sel, limit, want, s.kept.data(), s);
      exact_scores(c, *attn, qrow, khead, m, s.kept.data(), kept, s.scores.data());
      s.keys_exact += kept;
      if (kept <= topk + forced) {
        softmax_pv(c, *kernels, s.scores.data(), s.kept.data(), kept, vhead, yrow);
        continue;
      }
      // Oversampled candidates: keep the topk best exact scores among them (plus the protected).
      float* rank = s.sel.data();  // sel is no longer needed
      for (size_t t = 0; t < kept; ++t) {
        const size_t j = static_cast<size_t>(s.kept[t]);
        rank[t] = (j < first || j >= recent_begin) ? kPosInf : s.scores[t];
      }
      int32_t* fin = s.final_rows.data();
      const size_t nf = top_k_select(rank, kept, topk + forced, fin, s);
      float* fs = s.sel.data();
      for (size_t t = 0; t < nf; ++t) {
        fs[t] = s.scores[static_cast<size_t>(fin[t])];
        fin[t] = s.kept[static_cast<size_t>(fin[t])];
      }
      softmax_pv(c, *kernels, fs, fin, nf, vhead, yrow);
    }
  });
  for (size_t t = 0; t < n_tasks; ++t) {
    stats.keys_total += scratch[t].keys_total;
    stats.keys_exact += scratch[t].keys_exact;
  }
  {
    std::lock_guard<std::mutex> lock(scratch_mutex_);
    scratch_pool_.emplace_back(pooled.release(), [](void* p) { delete static_cast<std::vector<Scratch>*>(p); });
  }
  return stats;
}

}  // namespace ortsparse::attention
