#include "attention/key_cache.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "common/error.h"

namespace ortsparse::attention {

using kernels::kLanes;

size_t pack_planes(PackMode mode) { return mode == PackMode::kTernary ? 2 : 1; }

float pack_vector(const float* x, size_t d, PackMode mode, float eps, uint64_t* out, size_t stride, uint64_t* bits_set) {
  return kernels::attention_kernels_scalar().pack_row(x, d, static_cast<int>(mode), eps, out, stride, bits_set);
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

KeyCacheSlot::KeyCacheSlot(KeySummary summary, bool keep, bool verify) : summary_(summary), keep_(keep), verify_(verify) {
  std::random_device device;
  hash_seed_ = (static_cast<uint64_t>(device()) << 32) ^ device();
}

std::shared_ptr<const std::vector<float>> KeyCacheSlot::projection_for(size_t d) const {
  const size_t bits = static_cast<size_t>(summary_.proj_bits);
  std::lock_guard<std::mutex> lock(mutex_);
  if (!projection_ || projection_->size() != d * bits)
    projection_ = std::make_shared<const std::vector<float>>(projection_matrix(d, bits));
  return projection_;
}

std::shared_ptr<const std::vector<uint32_t>> KeyCacheSlot::hash_key_for(size_t d) const {
  const size_t words = kernels::row_hash_key_words(d);
  std::lock_guard<std::mutex> lock(mutex_);
  if (!hash_key_ || hash_key_->size() != words) {
    std::mt19937_64 gen(hash_seed_ ^ words);
    std::vector<uint32_t> key(words);
    for (uint32_t& w : key) w = static_cast<uint32_t>(gen() >> 32);
    hash_key_ = std::make_shared<const std::vector<uint32_t>>(std::move(key));
  }
  return hash_key_;
}

namespace {

// One head's work: which rows to (re)summarise.
struct HeadPlan {
  size_t keys = 0;   // rows of the head in this call
  size_t reuse = 0;  // leading rows taken from the old cache
};

// Provenance: rows [0, trusted) of a head are rows this kernel wrote itself into the buffer (since
// a call that wrote them all from row 0); a call's rows [unchanged, keys) are written by it now.
// The old cache's buffer is this call's previous buffer (same_buffer) or not.
std::vector<size_t> trusted_rows(const KeyCache* old, bool same_buffer, const KeyProvenance& provenance, size_t hkv,
                                 const std::vector<size_t>& keys) {
  std::vector<size_t> trusted(keys.size(), 0);
  for (size_t hk = 0; hk < keys.size(); ++hk) {
    const size_t u = provenance.unchanged[hk / hkv];
    if (u == 0 || (same_buffer && u <= old->trusted[hk])) {
      trusted[hk] = keys[hk];  // every row up to keys written by this kernel
    } else if (same_buffer) {
      trusted[hk] = std::min(old->trusted[hk], keys[hk]);  // rows [trusted, u) came from elsewhere
    }
  }
  return trusted;
}

bool same_source(const KeyCache* old, const KeyProvenance& provenance, size_t heads, size_t d) {
  return old != nullptr && old->heads == heads && old->d == d && old->trusted.size() == heads &&
         provenance.previous != nullptr && old->source == provenance.previous &&
         old->source_rows == provenance.previous_rows;
}

// Page bounds: row x joins page `s` ([max (d), min (d)]); absmax is NaN once a non-finite entry was seen.
void page_add(float* s, float& absmax, const float* x, size_t d, bool first) {
  float m = 0.0f;
  bool finite = true;
  if (first) {
    std::copy_n(x, d, s);
    std::copy_n(x, d, s + d);
  } else {
    for (size_t i = 0; i < d; ++i) {
      s[i] = std::max(s[i], x[i]);
      s[d + i] = std::min(s[d + i], x[i]);
    }
  }
  for (size_t i = 0; i < d; ++i) {
    finite = finite && std::isfinite(x[i]);
    m = std::max(m, std::fabs(x[i]));
  }
  if (!finite) {
    absmax = std::numeric_limits<float>::quiet_NaN();
  } else if (first) {
    absmax = m;
  } else if (!std::isnan(absmax)) {
    absmax = std::max(absmax, m);
  }
}

// A new cache with room for need_blocks key blocks per head (headroom when kept, so the following
// decode steps extend it in place), holding each head's reused prefix copied from `old`.
std::shared_ptr<KeyCache> new_cache(const KeySummary& summary, bool keep, bool by_hash,
                                    const std::shared_ptr<const std::vector<uint32_t>>& hash_key, size_t heads,
                                    size_t d, size_t need_blocks, const std::vector<HeadPlan>& plan,
                                    const KeyCache* old) {
  const bool popcount = summary.select == Selector::kPopcount;
  const bool pages = summary.select == Selector::kPages;
  const size_t page = pages ? static_cast<size_t>(summary.page_size) : 0;
  const bool center = popcount && summary.center;
  const size_t dp = popcount && summary.proj_bits > 0 ? static_cast<size_t>(summary.proj_bits) : d;
  auto fresh = std::make_shared<KeyCache>();
  KeyCache& n = *fresh;
  n.heads = heads;
  n.d = d;
  n.words = popcount ? (dp + 63) / 64 : 0;
  n.planes = popcount ? pack_planes(summary.mode) : 0;
  n.block_words = n.planes * n.words * kLanes;
  n.packed_dim = popcount ? dp : d;
  // Headroom so the following decode steps extend in place.
  n.cap_blocks = keep ? need_blocks + need_blocks / 2 + 8 : need_blocks;
  n.rows.assign(heads, 0);
  n.bits_set.assign(heads, 0);
  n.center.assign(center ? heads * d : 0, 0.0f);
  n.hash_key = hash_key;
  if (by_hash) n.hashes.assign(heads * n.cap_blocks * kLanes * 2, 0);
  n.page = page;
  if (popcount) {
    n.packed.assign(heads * n.cap_blocks * n.block_words, 0);
    n.gamma.assign(heads * n.cap_blocks * kLanes, 0.0f);
  } else if (pages) {
    n.cap_pages = (n.cap_blocks * kLanes + page - 1) / page;
    n.pages.assign(heads * n.cap_pages * 2 * d, 0.0f);
    n.page_absmax.assign(heads * n.cap_pages, 0.0f);
  } else {
    n.energy.assign(heads * n.cap_blocks * kLanes, 0.0f);
  }
  {  // copy each head's reused prefix
    for (size_t hk = 0; hk < heads; ++hk) {
      const size_t reuse = plan[hk].reuse;
      if (reuse == 0) continue;
      const size_t blocks = (reuse + kLanes - 1) / kLanes;
      if (popcount) {
        std::copy_n(old->head_packed(hk), blocks * n.block_words, n.packed.data() + hk * n.cap_blocks * n.block_words);
        std::copy_n(old->head_gamma(hk), reuse, n.gamma.data() + hk * n.cap_blocks * kLanes);
      } else if (pages) {
        const size_t used = (reuse + page - 1) / page;
        std::copy_n(old->head_pages(hk), used * 2 * d, n.pages.data() + hk * n.cap_pages * 2 * d);
        std::copy_n(old->head_page_absmax(hk), used, n.page_absmax.data() + hk * n.cap_pages);
      } else {
        std::copy_n(old->head_energy(hk), reuse, n.energy.data() + hk * n.cap_blocks * kLanes);
      }
      if (by_hash)
        std::copy_n(old->hashes.data() + hk * old->cap_blocks * kLanes * 2, 2 * reuse,
                    n.hashes.data() + hk * n.cap_blocks * kLanes * 2);
      if (center) std::copy_n(old->center.data() + hk * d, d, n.center.data() + hk * d);
      n.rows[hk] = old->rows[hk];  // the task below recounts bits_set when only a prefix is reused
      n.bits_set[hk] = old->bits_set[hk];
    }
  }
  return fresh;
}

// Summarises head hk's rows [reuse, keys) of the call into `kc` (hashes, page bounds, packed bits or
// energies), after fixing what a rewound head's reused prefix left stale (bits_set, its last page).
void summarise_head(const AttentionCall& call, const kernels::KernelSet& kernels, const KeySummary& summary,
                    bool hash_rows, const uint32_t* key, const float* proj_p, const HeadPlan& plan, size_t hk,
                    KeyCache& kc) {
  const AttentionDims& dims = call.dims;
  const size_t d = dims.d;
  const bool popcount = summary.select == Selector::kPopcount;
  const bool pages = summary.select == Selector::kPages;
  const size_t page = pages ? static_cast<size_t>(summary.page_size) : 0;
  const bool center = popcount && summary.center;
  const size_t dp = popcount && summary.proj_bits > 0 ? static_cast<size_t>(summary.proj_bits) : d;
  const int mode = static_cast<int>(summary.mode);
  const float eps = summary.eps;
  KeyCache* kp = &kc;
  const size_t b = hk / dims.hkv, h = hk % dims.hkv;
  const size_t keys = plan.keys, reuse = plan.reuse;
  const kernels::AttentionKernels& attn = *kernels.attention;
  auto row = [&](size_t j) { return call.k + call.k_rows.at(b, h, j); };
  // Packing assigns every word of a row's lanes, so rows left over from a longer earlier
  // sequence need no clearing: no query reads lanes past its head's keys.
  if (reuse == 0) {
    kp->bits_set[hk] = 0;
    if (center) {
      // q·(k − μ) ranks keys as q·k does, and centered keys carry informative sign bits.
      const size_t rows = std::min(keys, kCenterRows);
      std::vector<double> sum(d, 0.0);
      for (size_t j = 0; j < rows; ++j)
        for (size_t i = 0; i < d; ++i) sum[i] += row(j)[i];
      for (size_t i = 0; i < d; ++i)
        kp->center[hk * d + i] = rows ? static_cast<float>(sum[i] / static_cast<double>(rows)) : 0.0f;
    }
  }
  if (reuse > 0 && reuse < kp->rows[hk]) {
    // bits_set counts the summarised rows: recount the reused prefix (a rewound head).
    uint64_t bits = 0;
    if (popcount) {
      const uint64_t* base = kp->packed.data() + hk * kp->cap_blocks * kp->block_words;
      for (size_t j = 0; j < reuse; ++j)
        for (size_t w = 0; w < kp->planes * kp->words; ++w)
          bits += static_cast<uint64_t>(__builtin_popcountll(base[(j / kLanes) * kp->block_words + w * kLanes + j % kLanes]));
    }
    kp->bits_set[hk] = bits;
  }
  float* page_base = pages ? kp->pages.data() + hk * kp->cap_pages * 2 * d : nullptr;
  float* absmax = pages ? kp->page_absmax.data() + hk * kp->cap_pages : nullptr;
  if (pages && reuse % page != 0 && reuse < kp->rows[hk]) {
    // A rewound head: its last reused page also bounds rows past `reuse`; rebuild it from its
    // reused rows (the rows the caller vouches for, or whose hashes matched).
    const size_t p = reuse / page;
    for (size_t j = p * page; j < reuse; ++j) page_add(page_base + p * 2 * d, absmax[p], row(j), d, j == p * page);
  }
  std::vector<float> centered(center ? d : 0), projected(proj_p ? dp : 0);
  for (size_t j = reuse; j < keys; ++j) {
    const float* x = row(j);
    if (hash_rows) attn.row_hash(x, d, key, kp->hashes.data() + (hk * kp->cap_blocks * kLanes + j) * 2);
    if (pages) {
      const size_t p = j / page;
      page_add(page_base + p * 2 * d, absmax[p], x, d, j % page == 0);
    } else if (popcount) {
      if (center) {
        const float* mu = kp->center.data() + hk * d;
        for (size_t i = 0; i < d; ++i) centered[i] = x[i] - mu[i];
        x = centered.data();
      }
      if (proj_p) {
        kernels.matmul->gemv_rows(proj_p, dp, nullptr, x, d, projected.data(), dp, false);
        x = projected.data();
      }
      uint64_t* out = kp->packed.data() + hk * kp->cap_blocks * kp->block_words;
      float* g = kp->gamma.data() + hk * kp->cap_blocks * kLanes;
      g[j] = attn.pack_row(x, dp, mode, eps, out + (j / kLanes) * kp->block_words + j % kLanes, kLanes,
                           &kp->bits_set[hk]);
    } else {
      double s = 0.0;
      for (size_t i = 0; i < d; ++i) s += static_cast<double>(x[i]) * x[i];
      kp->energy[hk * kp->cap_blocks * kLanes + j] = static_cast<float>(std::sqrt(s));
    }
  }
  kp->rows[hk] = keys;
}

}  // namespace

void KeyCacheSlot::track(const AttentionCall& call, const KeyProvenance* provenance) const {
  const AttentionDims& dims = call.dims;
  if (!keep_ || verify_ || provenance == nullptr || provenance->unchanged.size() != dims.b) return;
  const size_t heads = dims.b * dims.hkv, d = dims.d;
  const bool popcount = summary_.select == Selector::kPopcount;
  std::vector<size_t> keys(heads);
  for (size_t hk = 0; hk < heads; ++hk) keys[hk] = call.keys(hk / dims.hkv);
  std::lock_guard<std::mutex> lock(mutex_);
  // A cache with the facts only (no summaries: the first call that needs them summarises every row
  // and finds them trusted).
  auto next = std::make_shared<KeyCache>();
  next->trusted = trusted_rows(cache_.get(), same_source(cache_.get(), *provenance, heads, d), *provenance, dims.hkv, keys);
  next->heads = heads;
  next->d = d;
  next->packed_dim = popcount && summary_.proj_bits > 0 ? static_cast<size_t>(summary_.proj_bits) : d;
  next->page = summary_.select == Selector::kPages ? static_cast<size_t>(summary_.page_size) : 0;
  next->rows.assign(heads, 0);
  next->bits_set.assign(heads, 0);
  next->source = provenance->current;
  next->source_rows = provenance->current_rows;
  cache_ = std::move(next);
}

std::shared_ptr<const KeyCache> KeyCacheSlot::prepare(const AttentionCall& call, const kernels::KernelSet& kernels,
                                                      const TaskRunner& runner, uint64_t& keys_packed,
                                                      const KeyProvenance* provenance) const {
  const AttentionDims& dims = call.dims;
  const size_t heads = dims.b * dims.hkv, d = dims.d;
  const bool popcount = summary_.select == Selector::kPopcount;
  const bool pages = summary_.select == Selector::kPages;
  const size_t page = pages ? static_cast<size_t>(summary_.page_size) : 0;
  const bool by_hash = keep_ && (provenance == nullptr || verify_);
  const bool center = popcount && summary_.center;
  const size_t dp = popcount && summary_.proj_bits > 0 ? static_cast<size_t>(summary_.proj_bits) : d;
  size_t max_keys = 0;
  std::vector<HeadPlan> plan(heads);
  for (size_t hk = 0; hk < heads; ++hk) {
    plan[hk].keys = call.keys(hk / dims.hkv);
    max_keys = std::max(max_keys, plan[hk].keys);
  }
  const size_t need_blocks = (max_keys + kLanes - 1) / kLanes;
  const std::shared_ptr<const std::vector<uint32_t>> hash_key = by_hash ? hash_key_for(d) : nullptr;
  const uint32_t* key = hash_key ? hash_key->data() : nullptr;

  std::shared_ptr<KeyCache> old;
  if (keep_) {
    std::lock_guard<std::mutex> lock(mutex_);
    old = std::move(cache_);
  }
  const bool compatible = old && old->heads == heads && old->d == d && old->packed_dim == (popcount ? dp : d) &&
                          old->hash_key == hash_key && old->page == page;
  // Reuse per head: by provenance, the rows the caller vouches for when the old cache was taken
  // from the buffer this call's unchanged rows come from; by hash, the leading rows whose stored
  // hash equals this call's row hash. With centering, the center is the mean of the head's first
  // min(keys, kCenterRows) rows, so a head is extended only when those rows are all reused and the
  // old cache had at least as many.
  const bool facts = !by_hash && provenance != nullptr && provenance->unchanged.size() == dims.b;
  const bool same_buffer = compatible && facts && same_source(old.get(), *provenance, heads, d);
  std::vector<size_t> keys_per_head(heads);
  for (size_t hk = 0; hk < heads; ++hk) keys_per_head[hk] = plan[hk].keys;
  std::vector<size_t> trusted =
      facts ? trusted_rows(old.get(), same_source(old.get(), *provenance, heads, d), *provenance, dims.hkv, keys_per_head)
            : std::vector<size_t>(heads, 0);
  if (same_buffer) {
    for (size_t hk = 0; hk < heads; ++hk) {
      size_t same = std::min({provenance->unchanged[hk / dims.hkv], old->trusted[hk], old->rows[hk], plan[hk].keys});
      const size_t center_rows = std::min(plan[hk].keys, kCenterRows);
      if (center && (same < center_rows || old->rows[hk] < center_rows)) same = 0;
      plan[hk].reuse = same;
    }
  } else if (compatible && by_hash) {
    const kernels::AttentionKernels& attn = *kernels.attention;
    const KeyCache* o = old.get();
    HeadPlan* pl = plan.data();
    runner.run(heads, [&, o, pl, key](size_t hk) {
      const size_t b = hk / dims.hkv, h = hk % dims.hkv;
      const size_t limit = std::min(o->rows[hk], pl[hk].keys);
      const uint64_t* stored = o->hashes.data() + hk * o->cap_blocks * kLanes * 2;
      size_t same = 0;
      uint64_t hash[2];
      for (; same < limit; ++same) {
        attn.row_hash(call.k + call.k_rows.at(b, h, same), d, key, hash);
        if (hash[0] != stored[2 * same] || hash[1] != stored[2 * same + 1]) break;
      }
      const size_t center_rows = std::min(pl[hk].keys, kCenterRows);
      if (center && (same < center_rows || o->rows[hk] < center_rows)) same = 0;
      pl[hk].reuse = same;
    });
  }
  size_t reused_total = 0;
  for (const HeadPlan& p : plan) reused_total += p.reuse;

  std::shared_ptr<KeyCache> fresh;
  if (compatible && reused_total > 0 && old.use_count() == 1 && old->cap_blocks >= need_blocks) {
    fresh = old;  // no run holds it: extend in place (new rows go to unused lanes / blocks)
  } else {
    fresh = new_cache(summary_, keep_, by_hash, hash_key, heads, d, need_blocks, plan, old.get());
  }
  KeyCache& kc = *fresh;
  kc.reused.resize(heads);
  for (size_t hk = 0; hk < heads; ++hk) kc.reused[hk] = plan[hk].reuse;
  std::shared_ptr<const std::vector<float>> proj;
  if (popcount && summary_.proj_bits > 0) proj = projection_for(d);
  kc.projection = proj;
  const float* proj_p = proj ? proj->data() : nullptr;
  KeyCache* kp = &kc;
  const HeadPlan* pl = plan.data();
  runner.run(heads, [&, kp, pl, proj_p, key](size_t hk) {
    summarise_head(call, kernels, summary_, by_hash, key, proj_p, pl[hk], hk, *kp);
  });
  kc.source = provenance ? provenance->current : nullptr;
  kc.source_rows = provenance ? provenance->current_rows : 0;
  kc.trusted = std::move(trusted);
  keys_packed = 0;
  for (const HeadPlan& p : plan) keys_packed += p.keys - p.reuse;
  if (keep_) {
    std::lock_guard<std::mutex> lock(mutex_);
    cache_ = fresh;
  }
  return fresh;
}

}  // namespace ortsparse::attention
