#include "engine/bitmap_gate.h"

#include <cmath>

#include "common/error.h"
#include "common/named_values.h"
#include "kernels/top_k.h"

namespace ortsparse::engine {

PackGateMode parse_pack_gate_mode(const std::string& name) {
  static constexpr Named<PackGateMode> kNames[] = {
      {"none", PackGateMode::kNone}, {"binary", PackGateMode::kBinary}, {"ternary", PackGateMode::kTernary}};
  return parse_named("pack_mode", name, kNames);
}

BitmapGate::BitmapGate(BitmapConfig config, std::unique_ptr<KwtaGate> kwta)
    : RowGate(kwta->partition()), config_(config), kwta_(std::move(kwta)) {
  if (!(config.eps >= 0.0f) || !std::isfinite(config.eps)) fail("attribute pack_eps=", config.eps, " must be >= 0");
  if (!(config.density_max > 0.0f && config.density_max <= 1.0f))
    fail("attribute pack_density_max=", config.density_max, " must be in (0, 1] (1: never auto-off)");
}

uint64_t BitmapGate::activity(const float* x, size_t m, const kernels::KernelSet& kernels,
                              std::vector<uint64_t>& words) const {
  const size_t wpt = words_per_token();
  words.assign(m * wpt, 0);
  const float eps = config_.eps;
  for (size_t t = 0; t < m; ++t) {
    const float* xt = x + t * partition_.k;
    uint64_t* bits = words.data() + t * wpt;
    for (size_t b = 0; b < partition_.num_blocks; ++b) {
      // Binary and ternary packings agree on which entries are zero: |x| > eps is "some bit set".
      // NaN counts as active, so it reaches the output as a dense product would carry it.
      bool any = false;
      for (size_t r = partition_.begin(b); r < partition_.end(b); ++r) any |= !(std::fabs(xt[r]) <= eps);
      if (any) bits[b / 64] |= uint64_t{1} << (b % 64);
    }
  }
  // Count with the popcount kernels (one "key" of wpt words per token against an all-ones query).
  constexpr size_t kLanes = kernels::kLanes;
  uint64_t active = 0;
  std::vector<uint64_t> ones(wpt, ~uint64_t{0});
  std::vector<uint64_t> lane(wpt * kLanes, 0);
  int32_t counts[kLanes];
  for (size_t t0 = 0; t0 < m; t0 += kLanes) {
    std::fill(lane.begin(), lane.end(), 0);
    for (size_t l = 0; l < kLanes && t0 + l < m; ++l)
      for (size_t w = 0; w < wpt; ++w) lane[w * kLanes + l] = words[(t0 + l) * wpt + w];
    kernels.popcount->and_counts(ones.data(), lane.data(), wpt, 1, counts);
    for (size_t l = 0; l < kLanes; ++l) active += static_cast<uint64_t>(counts[l]);
  }
  return active;
}

GateStats BitmapGate::plan(const float* x, size_t m, bool dense, const kernels::KernelSet& kernels, GatedRows& out) {
  if (dense) return kwta_->plan(x, m, true, kernels, out);
  std::vector<uint64_t> words;
  const uint64_t active = activity(x, m, kernels, words);
  const uint64_t blocks = static_cast<uint64_t>(m) * partition_.num_blocks;
  GateStats stats;
  if (static_cast<double>(active) > config_.density_max * static_cast<double>(blocks)) {
    stats = kwta_->plan(x, m, false, kernels, out);
  } else {
    stats = plan_bitmap(x, m, kernels, out, words);
    stats.bitmap_applied = true;
  }
  stats.bitmap_ran = true;
  stats.bitmap_active = active;
  stats.bitmap_blocks = blocks;
  return stats;
}

GateStats BitmapGate::plan_bitmap(const float* x, size_t m, const kernels::KernelSet& kernels, GatedRows& out,
                                  const std::vector<uint64_t>& words) const {
  GateStats stats;
  const size_t nb = partition_.num_blocks, wpt = words_per_token();
  stats.blocks_total = static_cast<uint64_t>(m) * nb;
  stats.gated = true;
  out.clear();
  const KwtaGate* kwta = kwta_.get();
  const bool kwta_selects = kwta->keep_count() < nb || kwta->config().threshold > 0.0f;
  std::vector<int32_t> active(nb + kernels::kIndexSlack), kept(nb + kernels::kIndexSlack);
  std::vector<float> keys, survivor_keys;
  std::vector<uint32_t> scratch;
  if (kwta_selects) {
    keys.resize(nb);
    survivor_keys.resize(nb);
  }
  for (size_t t = 0; t < m; ++t) {
    size_t count = 0;
    const uint64_t* bits = words.data() + t * wpt;
    for (size_t w = 0; w < wpt; ++w)
      for (uint64_t v = bits[w]; v; v &= v - 1) active[count++] = static_cast<int32_t>(w * 64 + __builtin_ctzll(v));
    const int32_t* chosen = active.data();
    const size_t active_count = count;
    if (kwta_selects && count > 0) {
      // The kwta rule (threshold, then top keep_count by score, ties to the lower block) among
      // the active blocks only.
      const bool squared = kwta->block_keys(x + t * partition_.k, kernels, keys.data());
      size_t n = 0;
      const float threshold = kwta->config().threshold;
      for (size_t i = 0; i < count; ++i) {
        const float key = keys[static_cast<size_t>(active[i])];
        if (threshold > 0.0f && kwta->score_from_key(key, squared) < threshold) continue;  // NaN passes, as in kwta
        kept[n] = active[i];
        survivor_keys[n++] = key;
      }
      const size_t limit = kwta->keep_count();
      if (n > limit) {
        std::vector<int32_t> pick(n + kernels::kIndexSlack);
        const size_t got = kernels::select_top_k(*kernels.select, survivor_keys.data(), n, limit, pick.data(), scratch);
        for (size_t i = 0; i < got; ++i) pick[i] = kept[static_cast<size_t>(pick[i])];
        std::copy(pick.begin(), pick.begin() + got, kept.begin());
        n = got;
      }
      chosen = kept.data();
      count = n;
    }
    // renorm compensates what the kwta rule dropped among the active blocks; the blocks the
    // bitmap dropped are (near) zero and need no compensation.
    const float scale = kwta_selects && kwta->config().renorm && count > 0
                            ? static_cast<float>(active_count) / static_cast<float>(count) : 1.0f;
    out.add_token_blocks(partition_, chosen, count, scale);
    stats.blocks_kept += count;
  }
  return stats;
}

}  // namespace ortsparse::engine
