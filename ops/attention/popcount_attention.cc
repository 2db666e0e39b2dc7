#include "attention/popcount_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "common/error.h"
#include "engine/kwta_gate.h"

namespace ortsparse::attention {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

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
  bool select;             // the selector runs for this call
};

struct Scratch {
  std::vector<float> sel, scores;
  std::vector<int32_t> counts, kept, final_rows;
  std::vector<uint32_t> topk;
  std::vector<uint64_t> qbits;
  uint64_t keys_total = 0, keys_exact = 0;
};

}  // namespace

size_t pack_planes(PackMode mode) { return mode == PackMode::kTernary ? 2 : 1; }

float pack_vector(const float* x, size_t d, PackMode mode, float eps, uint64_t* out, size_t stride, uint64_t* bits_set) {
  const size_t words = (d + 63) / 64;
  double sum = 0.0;
  size_t active = 0;
  for (size_t w = 0; w < words; ++w) {
    uint64_t pos = 0, neg = 0;
    const size_t end = std::min(d, (w + 1) * 64);
    for (size_t i = w * 64; i < end; ++i) {
      const float v = x[i];
      const uint64_t bit = uint64_t{1} << (i - w * 64);
      switch (mode) {
        case PackMode::kSign:
          if (v > 0.0f) pos |= bit;
          sum += std::fabs(static_cast<double>(v));
          break;
        case PackMode::kBinary:
          if (std::fabs(v) > eps) {
            pos |= bit;
            sum += std::fabs(static_cast<double>(v));
            ++active;
          }
          break;
        case PackMode::kTernary:
          if (v > eps) {
            pos |= bit;
          } else if (v < -eps) {
            neg |= bit;
          } else {
            break;
          }
          sum += std::fabs(static_cast<double>(v));
          ++active;
          break;
      }
    }
    out[w * stride] = pos;
    if (mode == PackMode::kTernary) out[(words + w) * stride] = neg;
    *bits_set += static_cast<uint64_t>(__builtin_popcountll(pos) + __builtin_popcountll(neg));
  }
  // Sign: gamma = mean |x| over all D entries (every entry carries a bit). Binary/ternary: over the
  // active entries, eps when there are none (seed 003).
  if (mode == PackMode::kSign) return d ? static_cast<float>(sum / static_cast<double>(d)) : 0.0f;
  return active ? static_cast<float>(sum / static_cast<double>(active)) : eps;
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

// Exact scores of the listed keys (rows == nullptr: keys 0..n-1): s = q·k * scale + mask.
void exact_scores(const Call& c, const AttentionKernels& attn, const float* qrow, const float* khead, const MaskRow& m,
                  const int32_t* rows, size_t n, float* s) {
  attn.dot_rows(qrow, khead, c.dims.d, c.dims.d, rows, n, s);
  for (size_t i = 0; i < n; ++i) s[i] = s[i] * c.scale + m.value(rows ? static_cast<size_t>(rows[i]) : i);
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

  std::vector<uint64_t> packed;
  std::vector<float> gamma, energy;
  if (c.select) {
    c.key_blocks = (dims.skv + kLanes - 1) / kLanes;
    if (config_.select == Selector::kPopcount) {
      c.words = (dims.d + 63) / 64;
      c.planes = pack_planes(config_.mode);
      c.block_words = c.planes * c.words * kLanes;
      packed.assign(heads_kv * c.key_blocks * c.block_words, 0);
      gamma.assign(heads_kv * c.key_blocks * kLanes, 0.0f);
      std::vector<uint64_t> bits(heads_kv, 0);
      uint64_t* packed_p = packed.data();
      float* gamma_p = gamma.data();
      uint64_t* bits_p = bits.data();
      const PackMode mode = config_.mode;
      const float eps = config_.eps;
      const Call* cp = &c;
      runner.run(heads_kv, [=](size_t hk) {
        const float* kh = cp->k + hk * cp->dims.skv * cp->dims.d;
        uint64_t* out = packed_p + hk * cp->key_blocks * cp->block_words;
        float* g = gamma_p + hk * cp->key_blocks * kLanes;
        for (size_t j = 0; j < cp->dims.skv; ++j)
          g[j] = pack_vector(kh + j * cp->dims.d, cp->dims.d, mode, eps,
                             out + (j / kLanes) * cp->block_words + j % kLanes, kLanes, &bits_p[hk]);
      });
      for (uint64_t b : bits) stats.bits_set += b;
      stats.bits_total = static_cast<uint64_t>(heads_kv) * dims.skv * dims.d;
      const double density = static_cast<double>(stats.bits_set) / static_cast<double>(stats.bits_total ? stats.bits_total : 1);
      // Sign packing is dense by construction (half the bits set); the sparsity check is for the
      // eps-thresholded modes, as in seed 003.
      if (config_.mode != PackMode::kSign && density > config_.density_max) c.select = false;
      c.packed = packed.data();
      c.gamma = gamma.data();
    } else {
      energy.assign(heads_kv * dims.skv, 0.0f);
      float* energy_p = energy.data();
      const Call* cp = &c;
      runner.run(heads_kv, [=](size_t hk) {
        const float* kh = cp->k + hk * cp->dims.skv * cp->dims.d;
        for (size_t j = 0; j < cp->dims.skv; ++j) {
          double s = 0.0;
          for (size_t i = 0; i < cp->dims.d; ++i) s += static_cast<double>(kh[j * cp->dims.d + i]) * kh[j * cp->dims.d + i];
          energy_p[hk * cp->dims.skv + j] = static_cast<float>(std::sqrt(s));
        }
      });
      c.energy = energy.data();
    }
  }
  stats.packed = c.select;

  const size_t n_tasks = std::min<size_t>(rows_total, 64);
  std::vector<Scratch> scratch(n_tasks);
  const size_t pad = ((dims.skv + kLanes - 1) / kLanes) * kLanes + engine::kIndexSlack;
  for (Scratch& s : scratch) {
    s.sel.resize(pad);
    s.scores.resize(pad);
    s.counts.resize(pad);
    s.kept.resize(pad);
    s.final_rows.resize(pad);
    s.topk.resize(2 * pad + engine::kIndexSlack);
    s.qbits.resize(2 * ((dims.d + 63) / 64) + 1);
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
        const float gq = pack_vector(qrow, dd.d, cfg->mode, cfg->eps, s.qbits.data(), 1, &unused);
        const uint64_t* kp = c.packed + hk * c.key_blocks * c.block_words;
        const float* gk = c.gamma + hk * c.key_blocks * kLanes;
        const size_t nb = (limit + kLanes - 1) / kLanes;
        int32_t* cnt = s.counts.data();
        switch (cfg->mode) {
          case PackMode::kSign: pop->xor_counts(s.qbits.data(), kp, c.words, nb, cnt); break;
          case PackMode::kBinary: pop->and_counts(s.qbits.data(), kp, c.words, nb, cnt); break;
          case PackMode::kTernary: pop->ternary_counts(s.qbits.data(), s.qbits.data() + c.words, kp, c.words, nb, cnt); break;
        }
        const int32_t d = static_cast<int32_t>(dd.d);
        // Approximate q·k: sign: (agreements - disagreements)·γq·γk = (D - 2·hamming)·γq·γk;
        // binary: |q∧k|·γq·γk; ternary: (agree - disagree)·γq·γk. Same float op order as the
        // numpy reference, so the selections match exactly.
        for (size_t j = 0; j < limit; ++j) {
          const int32_t a = cfg->mode == PackMode::kSign ? d - 2 * cnt[j] : cnt[j];
          sel[j] = static_cast<float>(a) * gq * gk[j] * c.scale + m.value(j);
        }
      } else {
        const float* e = c.energy + hk * dd.skv;
        for (size_t j = 0; j < limit; ++j) sel[j] = e[j] + m.value(j);
      }
      if (topk == 0) {  // the seed's pure approximate path: softmax of the approximate scores
        softmax_pv(c, *kernels, sel, nullptr, limit, vhead, yrow);
        continue;
      }
      size_t allowed = 0;
      for (size_t j = 0; j < limit; ++j) allowed += sel[j] != kNegInf;
      if (allowed <= topk) {
        exact_scores(c, *attn, qrow, khead, m, nullptr, limit, s.scores.data());
        softmax_pv(c, *kernels, s.scores.data(), nullptr, limit, vhead, yrow);
        s.keys_exact += limit;
        continue;
      }
      const size_t want = std::min<size_t>(
          allowed, std::max<size_t>(topk, static_cast<size_t>(std::ceil(static_cast<double>(cfg->candidates) * topk))));
      const size_t kept = engine::select_top_k(*kernels, sel, limit, want, s.kept.data(), s.topk);
      exact_scores(c, *attn, qrow, khead, m, s.kept.data(), kept, s.scores.data());
      s.keys_exact += kept;
      if (kept <= topk) {
        softmax_pv(c, *kernels, s.scores.data(), s.kept.data(), kept, vhead, yrow);
        continue;
      }
      // Oversampled candidates: keep the topk best exact scores among them.
      int32_t* fin = s.final_rows.data();
      const size_t nf = engine::select_top_k(*kernels, s.scores.data(), kept, topk, fin, s.topk);
      float* fs = s.sel.data();  // sel is no longer needed
      for (size_t t = 0; t < nf; ++t) {
        fs[t] = s.scores[static_cast<size_t>(fin[t])];
        fin[t] = s.kept[static_cast<size_t>(fin[t])];
      }
      softmax_pv(c, *kernels, fs, fin, nf, vhead, yrow);
    }
  });
  for (const Scratch& s : scratch) {
    stats.keys_total += s.keys_total;
    stats.keys_exact += s.keys_exact;
  }
  return stats;
}

}  // namespace ortsparse::attention
