// PopcountAttention: softmax(Q K^T · scale + mask) V where, per query, a cheap selector picks the
// keys that get exact scores — popcount of bit-packed Q/K (sign, binary or ternary packing; seed
// 003) or key energy ||k|| (seed 000's KWTA key filter) — and the kept keys are refined exactly.
// select = none is plain exact attention. See docs/ops.md#popcountattention.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "attention/attention_kernels.h"
#include "attention/popcount_kernels.h"
#include "common/task_runner.h"
#include "engine/kernels.h"

namespace ortsparse::attention {

enum class PackMode { kSign = 1, kBinary = 2, kTernary = 3 };
enum class Selector { kNone = 0, kPopcount = 1, kEnergy = 2 };

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
  float candidates = 1.0f;   // popcount keeps ceil(candidates * topk) keys, exact rescore keeps topk
  bool cache_keys = true;    // reuse the previous call's packed keys for an unchanged K prefix
  int64_t keep_first = 0;    // always keep the first keys (attention sinks) ...
  int64_t keep_recent = 0;   // ... and the last ones of each query's causal prefix (local window)
  bool center = true;        // popcount: pack k - mean of the first 256 keys (ranking-invariant for exact scores)
  int64_t proj_bits = 0;     // popcount: > 0 packs R^T x, R a fixed random Gaussian [D, proj_bits]
};

struct AttentionDims {
  size_t b = 0, h = 0, hkv = 0, sq = 0, skv = 0, d = 0, dv = 0;
};

// The mask broadcast to [B, H, Sq, Skv] by strides (0 on broadcast dims): element (b, h, i, j) is
// at stride[0]*b + stride[1]*h + stride[2]*i + stride[3]*j. `keep` (bool: true = attend) or `add`
// (added to the scaled scores) or neither.
struct MaskView {
  const uint8_t* keep = nullptr;
  const float* add = nullptr;
  size_t stride[4] = {0, 0, 0, 0};
};

struct AttentionStats {
  bool packed = false;       // the selector ran (not select=none, min_keys, or density auto-off)
  uint64_t bits_set = 0;     // key bitmap bits set / possible (binary, ternary: entries |k| > eps)
  uint64_t bits_total = 0;
  uint64_t keys_total = 0;   // keys each query could attend (causal prefix), summed over queries
  uint64_t keys_exact = 0;   // keys that got an exact score, summed over queries
  uint64_t keys_packed = 0;  // key rows packed (or norms computed) by this call; the rest reused
};

class PopcountAttention {
 public:
  // Throws Error on invalid attributes.
  PopcountAttention(const PopcountAttentionConfig& config, PopcntPath popcnt, Isa isa);

  const PopcountAttentionConfig& config() const { return config_; }
  PopcntPath popcnt_path() const { return popcnt_; }

  // q [B,H,Sq,D], k [B,Hkv,Skv,D], v [B,Hkv,Skv,Dv] -> y [B,H,Sq,Dv] (all contiguous). Queries with
  // no attendable key (all masked, or causal with Sq > Skv) get y = 0.
  AttentionStats run(const float* q, const float* k, const float* v, const MaskView& mask, const AttentionDims& dims,
                     float* y, const TaskRunner& runner) const;

 private:
  // Packed keys (popcount) or key norms (energy) of one call, per (b, hkv) head.
  struct KeyCache {
    static constexpr size_t kFingerprintRows = 3;
    size_t heads_kv = 0, skv = 0, d = 0, key_blocks = 0, words = 0, planes = 0, block_words = 0;
    size_t cap_blocks = 0;  // per-head capacity (stride) of packed / gamma / energy, in key blocks
    std::vector<uint64_t> packed;
    std::vector<float> gamma, energy, fingerprint, center;  // center: per head, D
    std::vector<uint64_t> bits_set;  // per head
    size_t packed_dim = 0;           // D, or proj_bits
    std::shared_ptr<const std::vector<float>> projection;
    size_t fingerprint_row(size_t f) const { return f == 0 ? 0 : f == 1 ? skv / 2 : skv - 1; }
  };
  std::shared_ptr<KeyCache> prepare_keys(const float* k, const AttentionDims& dims, const TaskRunner& runner,
                                               AttentionStats& stats) const;

  PopcountAttentionConfig config_;
  PopcntPath popcnt_;
  const PopcountTable* pop_;
  const AttentionKernels* attn_;
  const engine::KernelTable* kernels_;
  // The last call's keys: concurrent runs each take a snapshot and publish their own (a cache
  // that belongs to another sequence is simply not reused).
  mutable std::mutex cache_mutex_;
  mutable std::shared_ptr<KeyCache> cache_;
  // proj_bits > 0: R for the D of the last call (built on first use of a D).
  mutable std::shared_ptr<const std::vector<float>> projection_;
  std::shared_ptr<const std::vector<float>> projection_for(size_t d) const;
  // Per-call work buffers, reused across calls (one set per concurrent run; type-erased because
  // the scratch type is private to the .cc).
  mutable std::mutex scratch_mutex_;
  mutable std::vector<std::unique_ptr<void, void (*)(void*)>> scratch_pool_;
};

// Bit packing of one vector (exposed for tests): writes planes x words uint64 at
// out[(p * words + w) * stride], returns gamma and adds the set bits to *bits_set.
float pack_vector(const float* x, size_t d, PackMode mode, float eps, uint64_t* out, size_t stride, uint64_t* bits_set);

// The projection matrix of proj_bits (row-major [d, bits], N(0, 1) from a fixed splitmix64 /
// Box-Muller stream: part of the op's definition, the same in every build).
std::vector<float> projection_matrix(size_t d, size_t bits);
size_t pack_planes(PackMode mode);

}  // namespace ortsparse::attention
