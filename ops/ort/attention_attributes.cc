#include "ort/attention_attributes.h"

#include "common/metrics.h"

namespace ortsparse::ort {

bool read_flag(const Attributes& attrs, const char* name, bool fallback) {
  const int64_t v = attrs.get_int(name, fallback ? 1 : 0);
  if (v != 0 && v != 1) fail("attribute ", name, "=", v, " must be 0 or 1");
  return v == 1;
}

attention::PopcountAttentionConfig read_selection_attributes(const Attributes& attrs,
                                                             const attention::PopcountAttentionConfig& defaults) {
  attention::PopcountAttentionConfig c = defaults;
  c.mode = attention::parse_pack_mode(attrs.get_string("mode", attention::pack_mode_name(defaults.mode)));
  c.select = attention::parse_selector(attrs.get_string("select", attention::selector_name(defaults.select)));
  c.topk = attrs.get_int("topk", defaults.topk);
  c.min_keys = attrs.get_int("min_keys", defaults.min_keys);
  c.eps = attrs.get_float("eps", defaults.eps);
  c.density_max = attrs.get_float("density_max", defaults.density_max);
  c.candidates = attrs.get_float("candidates", defaults.candidates);
  c.cache_keys = read_flag(attrs, "pack_cache", defaults.cache_keys);
  c.keep_first = attrs.get_int("keep_first", defaults.keep_first);
  c.keep_recent = attrs.get_int("keep_recent", defaults.keep_recent);
  c.center = read_flag(attrs, "center", defaults.center);
  c.proj_bits = attrs.get_int("proj_bits", defaults.proj_bits);
  c.page_size = attrs.get_int("page_size", defaults.page_size);
  c.mass_eps = attrs.get_float("mass_eps", defaults.mass_eps);
  c.prefill_rows = attrs.get_int("prefill_rows", defaults.prefill_rows);
  c.prefill_select = attention::parse_prefill_select(
      attrs.get_string("prefill_select", attention::prefill_select_name(defaults.prefill_select)));
  c.prefill_eps = attrs.get_float("prefill_eps", defaults.prefill_eps);
  c.prefill_budget = attrs.get_int("prefill_budget", defaults.prefill_budget);
  c.event.enabled = read_flag(attrs, "event", defaults.event.enabled);
  c.event.topk = attrs.get_float("event_topk", defaults.event.topk);
  c.event.age_max = attrs.get_int("event_age_max", defaults.event.age_max);
  c.event.gap_every = attrs.get_int("event_gap_every", defaults.event.gap_every);
  c.event.gap_tol = attrs.get_float("event_gap_tol", defaults.event.gap_tol);
  attention::validate(c.event);
  return c;
}

std::vector<std::pair<std::string, double>> describe_attention(const uint64_t* c, const double* constants) {
  return {
      {"pack.enabled", constants[kEnabled]},
      {"pack.mode", constants[kMode]},
      {"pack.density", c[kBitsTotal] ? static_cast<double>(c[kBitsSet]) / c[kBitsTotal] : 0.0},
      {"pack.active", c[kCalls] ? static_cast<double>(c[kPackedCalls]) / c[kCalls] : 0.0},
      {"pack.popcnt", constants[kPopcnt]},
      {"pack.keys_exact_ratio", c[kKeysTotal] ? static_cast<double>(c[kKeysExact]) / c[kKeysTotal] : 1.0},
      {"select", constants[kSelect]},
      {"pages.visited_ratio", c[kPagesTotal] ? static_cast<double>(c[kPagesVisited]) / c[kPagesTotal] : 0.0},
      {"pages.certified_ratio", c[kRowsPaged] ? static_cast<double>(c[kRowsCertified]) / c[kRowsPaged] : 0.0},
      {"prefill.tiles", static_cast<double>(c[kPrefillTiles])},
      {"prefill.skipped_ratio", c[kPrefillTiles] ? static_cast<double>(c[kPrefillTilesSkipped]) / c[kPrefillTiles] : 0.0},
      {"event.heads_ranked", static_cast<double>(c[kEventRanked])},
      {"event.reused_certified", static_cast<double>(c[kEventCertified])},
      {"event.reused_budget", static_cast<double>(c[kEventBudget])},
      {"event.gap_checks", static_cast<double>(c[kEventGapChecks])},
      {"event.disabled", static_cast<double>(c[kEventDisables])},
      {"calls", static_cast<double>(c[kCalls])},
      {"keys_total", static_cast<double>(c[kKeysTotal])},
      {"keys_exact", static_cast<double>(c[kKeysExact])},
      {"keys_packed", static_cast<double>(c[kKeysPacked])},
  };
}

void count_attention(MetricsSlot& slot, const attention::AttentionStats& stats) {
  slot.add(kCalls, 1);
  if (stats.packed) slot.add(kPackedCalls, 1);
  slot.add(kBitsSet, stats.bits_set);
  slot.add(kBitsTotal, stats.bits_total);
  slot.add(kKeysTotal, stats.keys_total);
  slot.add(kKeysExact, stats.keys_exact);
  slot.add(kKeysPacked, stats.keys_packed);
  slot.add(kPagesTotal, stats.pages_total);
  slot.add(kPagesVisited, stats.pages_visited);
  slot.add(kRowsPaged, stats.rows_paged);
  slot.add(kRowsCertified, stats.rows_certified);
  slot.add(kEventRanked, stats.event.ranked);
  slot.add(kEventCertified, stats.event.reused_certified);
  slot.add(kEventBudget, stats.event.reused_budget);
  slot.add(kEventGapChecks, stats.event.gap_checks);
  slot.add(kEventDisables, stats.event.disables);
  slot.add(kPrefillTiles, stats.prefill_tiles);
  slot.add(kPrefillTilesSkipped, stats.prefill_tiles_skipped);
}

}  // namespace ortsparse::ort
