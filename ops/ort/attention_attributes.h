// The selection attributes of the PopcountAttention family (select, topk, mode, ...), read the same
// way by the 4-D form and the GroupQueryAttention form, and their metrics.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "attention/popcount_attention.h"
#include "common/metrics.h"
#include "ort/op_adapter.h"

namespace ortsparse::ort {

// Reads select, topk, min_keys, mode, eps, density_max, candidates, pack_cache, keep_first,
// keep_recent, center, proj_bits, page_size, prefill_rows and event-driven attention's event,
// event_topk, event_age_max, event_gap_every, event_gap_tol, with `defaults` for absent ones; throws naming the
// attribute when a value is out of range (the engine checks the rest).
attention::PopcountAttentionConfig read_selection_attributes(const Attributes& attrs,
                                                             const attention::PopcountAttentionConfig& defaults);

// Metric counters and constants of the family (one slot layout for both forms).
enum AttentionCounter { kCalls, kPackedCalls, kBitsSet, kBitsTotal, kKeysTotal, kKeysExact, kKeysPacked, kPagesTotal,
                        kPagesVisited, kRowsPaged, kRowsCertified, kEventRanked, kEventCertified, kEventBudget,
                        kEventGapChecks, kEventDisables };
enum AttentionConstant { kEnabled, kMode, kPopcnt, kSelect };

std::vector<std::pair<std::string, double>> describe_attention(const uint64_t* counts, const double* constants);

// Adds one call's statistics to the slot.
void count_attention(MetricsSlot& slot, const attention::AttentionStats& stats);

}  // namespace ortsparse::ort
