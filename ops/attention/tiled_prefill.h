// Attention of a call with many query rows (a prompt), tiled as flash attention on a CPU: blocks
// of query rows — the query heads sharing one KV head together — against tiles of
// kernels::kFlashKeys keys with an online softmax, so the scores of a tile stay in L1/L2 and each
// K/V tile is read once per query block instead of once per query row. Tiles outside every row's
// causal / local-window range are skipped whole. Same semantics as the row path's exact attention
// (scale, soft-cap, mask / attention_bias, head sink or smooth softmax; a row with no attendable
// key gets y = 0). Tasks over (batch, kv head, query block) on the caller's TaskRunner.
//
// Non-finite inputs: a query row is computed here only if every value it reads is finite — its q
// row, the K and V rows of its key range, its mask values there — and its output comes out finite;
// the other rows are left to the caller's row path, which owns the NaN / Inf semantics. A
// non-finite K or V row is seen as zeros by the rows that do not attend it (a tile's unattended
// keys get weight 0, and 0·NaN would leak), so a NaN moves exactly the rows that read it and every
// other row gives the bits it gives without the NaN.
//
// Selective prefill (select != kExact): a block also skips key tiles that cannot matter much. The
// tiles holding the first keys (attention sinks), each row's last keys (local context) and the
// diagonal (tiles some row attends only in part) are always computed; every other tile gets an
// upper bound of the block's scores on it from the tile's per-dim min / max of K (key_bounds.h),
// and
// - kCertified visits them best bound first and stops when, for every row, keys_left ·
//   exp(max bound left − running max) <= eps · running sum: the softmax mass dropped is then at
//   most eps of the row's total, provably (up to float rounding of the sums);
// - kBudget visits the budget_tiles best-bound ones.
// A block selects only when every row has >= min_keys keys and at least two tiles are selectable
// (budget: more than budget_tiles); otherwise it is computed exactly, as with kExact.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "attention/attention_call.h"
#include "common/task_runner.h"
#include "kernels/kernel_set.h"

namespace ortsparse::attention {

enum class PrefillSelect { kExact = 0, kCertified = 1, kBudget = 2 };

PrefillSelect parse_prefill_select(const std::string& name);  // throws Error naming the valid values
const char* prefill_select_name(PrefillSelect select);

struct TiledParams {
  float scale = 1.0f;
  float softcap = 0.0f;
  bool causal = false;
  int64_t local_window = -1;  // >= 0 with causal: keys (p - window, p]
  bool smooth_softmax = false;
  // Selective prefill (see above).
  PrefillSelect select = PrefillSelect::kExact;
  float eps = 1e-3f;            // kCertified: dropped softmax mass per row <= eps of the total
  size_t budget_tiles = 16;     // kBudget: tiles kept per block besides the always-computed ones
  size_t sink_keys = 1;         // tiles holding keys [0, sink_keys) are always computed
  size_t recent_keys = 64;      // tiles holding any row's last recent_keys keys are always computed
  size_t min_keys = 0;          // a block selects only when each of its rows has this many keys
};

struct TiledStats {
  uint64_t keys_total = 0;         // keys attended by the rows computed, summed over the rows
  uint64_t keys_skipped = 0;       // of them, in tiles selective prefill skipped
  uint64_t tiles = 0;              // (query block, key tile) pairs in the blocks' key ranges
  uint64_t tiles_skipped = 0;      // of them, skipped by selective prefill
  size_t rows_left = 0;            // query rows not computed (a non-finite input read, or output)
  bool values_nonfinite = false;   // some V row in [0, keys) holds a NaN / Inf
};

// Computes y for the query rows described above and sets done[(b·H + h)·Sq + i] = 1 for each (done:
// B·H·Sq entries, all 0 on entry); the other rows' y may hold partial results. Returns false, having
// computed nothing, for a call the kernel cannot tile (H not a multiple of Hkv, D = 0). *stats: what
// was computed.
bool tiled_attention(const AttentionCall& call, const kernels::KernelSet& kernels, const TiledParams& params,
                     const TaskRunner& runner, std::vector<char>& done, TiledStats* stats);

}  // namespace ortsparse::attention
