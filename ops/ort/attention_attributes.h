// The selection attributes of the PopcountAttention family (select, topk, mode, ...), read the same
// way by the 4-D form and the GroupQueryAttention form, and their metrics.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "attention/popcount_attention.h"
#include "common/metrics.h"
#include "ort/op_adapter.h"
#include "ort/op_schema.h"

namespace ortsparse::ort {

// The selection defaults an attention op declares in its schema (graph_rewrite/op_schema.json ->
// ort/op_schema.h): what read_selection_attributes falls back to for an absent attribute.
template <class Schema>
attention::PopcountAttentionConfig schema_selection_defaults() {
  attention::PopcountAttentionConfig c;
  c.mode = attention::parse_pack_mode(Schema::mode);
  c.select = attention::parse_selector(Schema::select);
  c.topk = Schema::topk;
  c.min_keys = Schema::min_keys;
  c.eps = Schema::eps;
  c.density_max = Schema::density_max;
  c.candidates = Schema::candidates;
  c.cache_keys = Schema::pack_cache != 0;
  c.keep_first = Schema::keep_first;
  c.keep_recent = Schema::keep_recent;
  c.center = Schema::center != 0;
  c.proj_bits = Schema::proj_bits;
  c.page_size = Schema::page_size;
  c.mass_eps = Schema::mass_eps;
  c.prefill_rows = Schema::prefill_rows;
  c.prefill_select = attention::parse_prefill_select(Schema::prefill_select);
  c.prefill_eps = Schema::prefill_eps;
  c.prefill_budget = Schema::prefill_budget;
  c.event.enabled = Schema::event != 0;
  c.event.topk = Schema::event_topk;
  c.event.age_max = Schema::event_age_max;
  c.event.gap_every = Schema::event_gap_every;
  c.event.gap_tol = Schema::event_gap_tol;
  return c;
}

// A 0/1 attribute as a bool (`fallback` when absent); throws naming it for any other value.
bool read_flag(const Attributes& attrs, const char* name, bool fallback);

// Reads select, topk, min_keys, mode, eps, density_max, candidates, pack_cache, keep_first,
// keep_recent, center, proj_bits, page_size, mass_eps, prefill_rows, prefill_select, prefill_eps, prefill_budget and event-driven attention's event,
// event_topk, event_age_max, event_gap_every, event_gap_tol, with `defaults` for absent ones; throws naming the
// attribute when a value is out of range (the engine checks the rest).
attention::PopcountAttentionConfig read_selection_attributes(const Attributes& attrs,
                                                             const attention::PopcountAttentionConfig& defaults);

// Metric counters and constants of the family (one slot layout for both forms).
enum AttentionCounter { kCalls, kPackedCalls, kBitsSet, kBitsTotal, kKeysTotal, kKeysExact, kKeysPacked, kPagesTotal,
                        kPagesVisited, kRowsPaged, kRowsCertified, kEventRanked, kEventCertified, kEventBudget,
                        kEventGapChecks, kEventDisables, kPrefillTiles, kPrefillTilesSkipped };
enum AttentionConstant { kEnabled, kMode, kPopcnt, kSelect };

std::vector<std::pair<std::string, double>> describe_attention(const uint64_t* counts, const double* constants);

// Adds one call's statistics to the slot.
void count_attention(MetricsSlot& slot, const attention::AttentionStats& stats);

}  // namespace ortsparse::ort
