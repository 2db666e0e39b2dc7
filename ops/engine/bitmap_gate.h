// The `bitmap` input gate (seed 003, MLP side): per token, skip the K-blocks whose inputs are all
// |x| <= eps (exact when eps = 0: such a block adds 0). The block activity is packed as a bitmap
// (one bit per block), counted with the popcount path of ops/attention (density monitor) and, in
// front of a kwta gate, the kwta rule runs on the surviving blocks only (one ordering).
// See docs/ops.md#kwtablockmatmul (pack_* attributes).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "engine/gated_rows.h"
#include "engine/kernels.h"
#include "engine/kwta_gate.h"

namespace ortsparse::engine {

enum class PackGateMode { kNone = 0, kBinary = 2, kTernary = 3 };  // codes as PopcountAttention's pack.mode

PackGateMode parse_pack_gate_mode(const std::string& name);  // throws Error naming the valid values

struct BitmapConfig {
  PackGateMode mode = PackGateMode::kNone;
  float eps = 0.0f;
  float density_max = 0.15f;  // active-block density of a call above this: the bitmap is off for it
};

struct BitmapStats {
  bool applied = false;      // the bitmap decided the rows of this call (not auto-off)
  uint64_t blocks_active = 0;
  uint64_t blocks_total = 0;
  uint64_t blocks_kept = 0;  // after the kwta rule, if any
};

class BitmapGate {
 public:
  BitmapGate(BlockPartition partition, BitmapConfig config);

  const BitmapConfig& config() const { return config_; }

  // Per token of x [M, K]: bit b of the token's words = block b has some |x| > eps. Returns the
  // number of active blocks over all tokens. words: M * words_per_token().
  uint64_t activity(const float* x, size_t m, std::vector<uint64_t>& words) const;
  size_t words_per_token() const { return (partition_.num_blocks + 63) / 64; }

  // Fills `out` from the bitmap; with `kwta` (its k_frac/k_abs/score/threshold/renorm), the kwta
  // rule picks among the active blocks only. Auto-off (density > density_max): out is left empty
  // and stats.applied = false, the caller runs its own gate. Thread-safe (no mutable state).
  BitmapStats plan(const float* x, size_t m, const KernelTable& kernels, const KwtaGate* kwta, GatedRows& out) const;

 private:
  BlockPartition partition_;
  BitmapConfig config_;
};

}  // namespace ortsparse::engine
