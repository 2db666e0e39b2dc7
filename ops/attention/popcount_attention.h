// PopcountAttention: softmax(Q K^T · scale + mask) V where, per query, a cheap selector picks the
// keys that get exact scores — popcount of bit-packed Q/K (sign, binary or ternary packing), key
// energy ||k||, or per-page key bounds visited best-first until no unvisited key can enter the
// top-k (certified) — and the kept keys are refined exactly. select = none is plain exact attention.
// The pieces: key summaries (key_cache), exact scoring and softmax·V (exact_attention), the
// shared top-k selector (kernels/top_k); this file plans a call and runs each query row.
// See docs/ops.md#popcountattention.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "attention/attention_call.h"
#include "attention/head_reuse.h"
#include "attention/key_cache.h"
#include "attention/tiled_prefill.h"
#include "common/task_runner.h"
#include "kernels/kernel_set.h"

namespace ortsparse::attention {

PackMode parse_pack_mode(const std::string& name);  // throws Error naming the valid values
Selector parse_selector(const std::string& name);
const char* pack_mode_name(PackMode mode);
const char* selector_name(Selector select);

struct PopcountAttentionConfig {
  float scale = 0.0f;  // 0: 1/sqrt(D)
  bool causal = false;
  PackMode mode = PackMode::kSign;
  Selector select = Selector::kPopcount;
  int64_t topk = 256;        // keys refined per query; 0 = approximate scores only (popcount)
  int64_t min_keys = 1024;   // Skv below this: exact attention
  float eps = 1e-4f;         // binary / ternary threshold
  float density_max = 0.15f; // binary / ternary: key bitmap density above this -> exact for the call
  float candidates = 1.0f;   // popcount keeps ceil(candidates * topk) keys, exact rescore keeps topk;
                             // pages: budget of ceil(candidates * topk) exactly scored keys (0: none)
  bool cache_keys = true;    // reuse the previous call's key summaries for unchanged K rows
  int64_t keep_first = 0;    // always keep the first keys (attention sinks) ...
  int64_t keep_recent = 0;   // ... and the last ones of each query's causal range (local window)
  bool center = true;        // popcount: pack k - mean of the first 256 keys (ranking-invariant for exact scores)
  int64_t proj_bits = 0;     // popcount: > 0 packs R^T x, R a fixed random Gaussian [D, proj_bits]
  float softcap = 0.0f;      // > 0: scores = softcap * tanh(scores / softcap) (GroupQueryAttention)
  int64_t local_window = -1; // >= 0 with causal: query at position p attends keys (p - window, p]
  int64_t page_size = 16;    // pages: keys per page (bounds of K per page and dim)
  // pages with a budget, decode rows: > 0 scores pages best bound first, topk keys' worth at a time,
  // up to the budget, and stops once a batch carried <= mass_eps of the softmax mass seen (or the
  // bounds certify the rest carries no more); every scored key is kept. 0: the plain budget.
  float mass_eps = 0.0f;
  bool smooth_softmax = false;  // every softmax has one more logit, 0 (or the call's head_sink), with V = 0
  bool verify_keys = true;   // with a KeyProvenance: still decide key-summary reuse by row hashes
  // A call with at least this many query rows (a prompt or prompt chunk) runs the rows it
  // computes exactly (all of them with select=none; with a selector, those with fewer keys than
  // min_keys / topk) through the tiled kernel (attention/tiled_prefill.h); 0: never. From 16 rows
  // the tiled kernel took half the CPU time of the row path (chunks of 16-128 rows over 512-2048
  // keys); below, a call has at most one query block per KV head: too few tasks for the pool,
  // and decode steps keep the row path's split of the keys over threads.
  int64_t prefill_rows = 16;
  // Selective prefill in those tiled calls (tiled_prefill.h, docs/ops.md "Selective prefill"): exact
  // (every tile), certified (skip tiles while the dropped softmax mass stays <= prefill_eps per
  // row) or budget (the ceil(prefill_budget / 64) best-bound tiles per query block); the first
  // max(keep_first, 1) and each row's last max(keep_recent, 64) keys are always computed, and
  // blocks whose rows have fewer than min_keys keys are exact. Decode steps are unchanged.
  PrefillSelect prefill_select = PrefillSelect::kExact;
  float prefill_eps = 1e-3f;
  int64_t prefill_budget = 1024;
  // Event-driven attention by heads (head_reuse.h): decode steps of select=pages with a budget
  // (candidates > 0), no mask, and a KeyProvenance reuse a head's page choice while its query
  // moves little.
  HeadReuseConfig event;
};

struct AttentionStats {
  bool packed = false;       // the selector ran (not select=none, min_keys, or density auto-off)
  uint64_t bits_set = 0;     // key bitmap bits set / possible (binary, ternary: entries |k| > eps)
  uint64_t bits_total = 0;
  uint64_t keys_total = 0;   // keys each query could attend (causal range), summed over queries
  uint64_t keys_exact = 0;   // keys that got an exact score, summed over queries
  uint64_t keys_packed = 0;  // key rows summarised by this call; the rest reused
  uint64_t pages_total = 0;  // pages: pages a query could visit, summed over queries
  uint64_t pages_visited = 0;
  uint64_t rows_paged = 0;      // pages: query rows that ran the page selector
  uint64_t rows_certified = 0;  // ... and stopped because no unvisited key could enter the top-k
  HeadReuseStats event;         // event-driven attention's decisions (query heads of decode steps)
  uint64_t prefill_tiles = 0;          // tiled prompt path: (query block, key tile) pairs in range
  uint64_t prefill_tiles_skipped = 0;  // ... of them skipped by selective prefill
};

class PopcountAttention {
 public:
  // Throws Error on invalid attributes or a kernel set this CPU cannot run.
  PopcountAttention(const PopcountAttentionConfig& config, const kernels::KernelSet& kernels);

  const PopcountAttentionConfig& config() const { return config_; }
  const kernels::KernelSet& kernels() const { return *kernels_; }

  // y rows for every query of the call. Queries with no attendable key (all masked, or a causal
  // range that is empty) get y = 0. provenance: what the caller knows about K's rows (key-summary
  // reuse by provenance, see key_cache.h); null: reuse by row hash. scale: > 0 overrides a config
  // scale of 0 (the caller's rounding of 1/sqrt(D)).
  AttentionStats run(const AttentionCall& call, const TaskRunner& runner,
                     const KeyProvenance* provenance = nullptr, float scale = 0.0f) const;

 private:
  // run's steps that read the engine's state (popcount_attention.cc).
  const KeyCache* selector_keys(const AttentionCall& call, const TaskRunner& runner, const KeyProvenance* provenance,
                                size_t max_keys, std::shared_ptr<const KeyCache>& keys, AttentionStats& stats) const;
  std::vector<HeadAction> plan_head_reuse(const AttentionCall& call, const KeyCache& keys,
                                          const KeyProvenance* provenance, uint64_t call_number, float scale,
                                          HeadReuseStats& stats) const;

  PopcountAttentionConfig config_;
  const kernels::KernelSet* kernels_;
  KeyCacheSlot keys_;
  std::unique_ptr<HeadReuse> reuse_;  // event.enabled: the heads' memories across calls
  // Per-call work buffers, reused across calls (one set per concurrent run; type-erased because
  // the scratch type is private to the .cc).
  mutable std::mutex scratch_mutex_;
  mutable std::vector<std::unique_ptr<void, void (*)(void*)>> scratch_pool_;
};

}  // namespace ortsparse::attention
