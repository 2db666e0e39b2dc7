// Exact attention of a call with many query rows (a prompt), tiled as flash attention on a CPU:
// blocks of query rows — the query heads sharing one KV head together — against tiles of
// kernels::kFlashKeys keys with an online softmax, so the scores of a tile stay in L1/L2 and each
// K/V tile is read once per query block instead of once per query row. Tiles outside every row's
// causal / local-window range are skipped whole. Same semantics as the row path's exact attention
// (scale, soft-cap, mask / attention_bias, head sink or smooth softmax; a row with no attendable
// key gets y = 0). Tasks over (batch, kv head, query block) on the caller's TaskRunner.
#pragma once

#include <cstddef>
#include <cstdint>

#include "attention/attention_call.h"
#include "common/task_runner.h"
#include "kernels/kernel_set.h"

namespace ortsparse::attention {

struct TiledParams {
  float scale = 1.0f;
  float softcap = 0.0f;
  bool causal = false;
  int64_t local_window = -1;  // >= 0 with causal: keys (p - window, p]
  bool smooth_softmax = false;
};

// Computes y for the query rows with fewer than `keys_below` attendable keys (SIZE_MAX: every
// row; the other rows are not touched) if every input it reads is finite and every output comes
// out finite; returns false otherwise (y may then hold partial results: the caller runs its row
// path, which owns the semantics of NaN / Inf inputs). *keys_total: keys attended, summed over the
// rows computed.
bool tiled_exact_attention(const AttentionCall& call, const kernels::KernelSet& kernels, const TiledParams& params,
                           size_t keys_below, const TaskRunner& runner, uint64_t* keys_total);

}  // namespace ortsparse::attention
