// The `bitmap` input gate: per token, skip the K-blocks whose inputs are all |x| <= eps (exact
// when eps = 0: such a block adds 0). The block activity is packed as a bitmap (one bit per block)
// and counted with the kernel set's popcount (density monitor). It composes with a kwta gate: the
// kwta rule picks among the surviving blocks only (one ordering), and when the bitmap is off for a
// call (density above density_max) the kwta gate decides the call alone.
// See docs/ops.md#kwtablockmatmul (pack_* attributes).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <memory>

#include "engine/gated_rows.h"
#include "engine/input_gate.h"
#include "engine/kwta_gate.h"
#include "kernels/kernel_set.h"

namespace ortsparse::engine {

enum class PackGateMode { kNone = 0, kBinary = 2, kTernary = 3 };  // codes as PopcountAttention's pack.mode

PackGateMode parse_pack_gate_mode(const std::string& name);  // throws Error naming the valid values

struct BitmapConfig {
  PackGateMode mode = PackGateMode::kNone;
  float eps = 0.0f;
  float density_max = 0.15f;  // active-block density of a call above this: the bitmap is off for it
};

class BitmapGate final : public RowGate {
 public:
  // kwta: the gate that picks among the active blocks and decides the calls the bitmap is off for.
  BitmapGate(BitmapConfig config, std::unique_ptr<KwtaGate> kwta);

  const BitmapConfig& config() const { return config_; }

  // Per token of x [M, K]: bit b of the token's words = block b has some |x| > eps. Returns the
  // number of active blocks over all tokens. words: M * words_per_token().
  uint64_t activity(const float* x, size_t m, const kernels::KernelSet& kernels, std::vector<uint64_t>& words) const;
  size_t words_per_token() const { return (partition_.num_blocks + 63) / 64; }

  // Rows from the bitmap, the kwta rule (k_frac/k_abs/score/threshold/renorm) picking among the
  // active blocks; auto-off (density > density_max) or a dense call: the kwta gate plans alone.
  // Thread-safe (the bitmap has no state; the kwta gate is thread-safe).
  GateStats plan(const float* x, size_t m, bool dense, const kernels::KernelSet& kernels, GatedRows& out) override;

 private:
  GateStats plan_bitmap(const float* x, size_t m, const kernels::KernelSet& kernels, GatedRows& out,
                        const std::vector<uint64_t>& words) const;

  BitmapConfig config_;
  std::unique_ptr<KwtaGate> kwta_;
};

}  // namespace ortsparse::engine
