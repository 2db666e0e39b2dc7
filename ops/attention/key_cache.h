// The selector's view of the keys: per (batch, kv head), the keys bit-packed for popcount scoring
// (with their gamma), their energies ||k||, or per-page key bounds (per dim max and min of K over
// pages of `page_size` keys, for the certified page selector). A decode step adds one key per head,
// so the kernel keeps the last call's cache and extends it with the new rows only.
//
// Reuse is decided per head, one of two ways:
// - by hash (the 4-D form, and the GroupQueryAttention form with verify_keys = 1): a keyed 128-bit
//   hash of every reused K row is compared with the hash stored when it was summarised: a new
//   prompt, a rewound or edited cache is resummarised from the first row that differs. Exact, but
//   every call reads all of K.
// - by provenance (the GroupQueryAttention form, verify_keys = 0): the caller says which buffer K
//   lives in, which leading rows are unchanged since the previous call and that it wrote the rest
//   (KeyProvenance). The cache remembers, per head, how many leading rows the kernel itself wrote
//   into that buffer (`trusted`: all of them since a call that started at row 0); the summaries of
//   the previous call are reused only when that call's K buffer was this call's previous buffer
//   (same address and row capacity), and only for rows both unchanged and trusted.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "attention/attention_call.h"
#include "common/task_runner.h"
#include "kernels/kernel_set.h"

namespace ortsparse::attention {

enum class PackMode { kSign = 1, kBinary = 2, kTernary = 3 };
enum class Selector { kNone = 0, kPopcount = 1, kEnergy = 2, kPages = 3 };

size_t pack_planes(PackMode mode);

// How keys are summarised for the selector (the PopcountAttention attributes that shape it).
struct KeySummary {
  Selector select = Selector::kPopcount;
  PackMode mode = PackMode::kSign;
  float eps = 1e-4f;
  bool center = true;      // popcount: pack k - mean of the first kCenterRows keys of the head
  int64_t proj_bits = 0;   // popcount: > 0 packs R^T x, R a fixed random Gaussian [D, proj_bits]
  int64_t page_size = 16;  // pages: keys per page
};

// What the caller knows about a call's K rows (the GroupQueryAttention form): K lives in buffer
// `current` (`current_rows` rows per head); rows [0, unchanged[b]) of batch entry b hold exactly what
// the previous call left in buffer `previous` (`previous_rows` rows per head): the same memory when
// past and present share a buffer, a copy of the past tensor otherwise; the caller wrote rows
// [unchanged[b], keys) itself in this call.
struct KeyProvenance {
  const void* previous = nullptr;
  size_t previous_rows = 0;
  const void* current = nullptr;
  size_t current_rows = 0;
  std::vector<size_t> unchanged;  // per batch entry
};

// Keys the center is the mean of (the first ones of each head).
constexpr size_t kCenterRows = 256;

struct KeyCache {
  size_t heads = 0, d = 0;
  size_t words = 0, planes = 0, block_words = 0, packed_dim = 0;  // popcount layout (packed_dim: D or proj_bits)
  size_t cap_blocks = 0;                 // per-head capacity (stride) of packed / gamma / energy, in key blocks
  std::vector<size_t> rows;              // per head: keys summarised
  std::vector<uint64_t> packed;          // per head: cap_blocks * block_words
  std::vector<float> gamma, energy;      // per head: cap_blocks * kLanes
  std::vector<float> center;             // per head: D
  std::vector<uint64_t> bits_set;        // per head
  std::vector<uint64_t> hashes;          // per head: 2 words per key of its capacity (hash reuse only)
  size_t page = 0, cap_pages = 0;        // pages: keys per page, per-head capacity in pages
  std::vector<float> pages;              // per head: cap_pages x [max over the page's keys (D), min (D)]
  std::vector<float> page_absmax;        // per head: cap_pages x max |k| over the page (NaN: a non-finite key)
  const void* source = nullptr;          // provenance: the K buffer these summaries were taken from
  size_t source_rows = 0;
  std::vector<size_t> trusted;           // provenance, per head: leading rows the kernel wrote itself
  std::vector<size_t> reused;            // per head: leading rows this call took over unchanged from the last
  std::shared_ptr<const std::vector<float>> projection;
  std::shared_ptr<const std::vector<uint32_t>> hash_key;

  const uint64_t* head_packed(size_t hk) const { return packed.data() + hk * cap_blocks * block_words; }
  const float* head_gamma(size_t hk) const { return gamma.data() + hk * cap_blocks * kernels::kLanes; }
  const float* head_energy(size_t hk) const { return energy.data() + hk * cap_blocks * kernels::kLanes; }
  const float* head_pages(size_t hk) const { return pages.data() + hk * cap_pages * 2 * d; }
  const float* head_page_absmax(size_t hk) const { return page_absmax.data() + hk * cap_pages; }
};

// The kernel's cache: prepare() takes the last call's cache out of the slot (a concurrent call
// sees none and builds its own), brings it up to this call's keys, and publishes it again.
class KeyCacheSlot {
 public:
  // keep: reuse summaries across calls at all; verify: with a KeyProvenance, still decide reuse
  // by row hashes (without one, reuse is always by hash).
  KeyCacheSlot(KeySummary summary, bool keep, bool verify = true);

  // Summaries of every key of the call. keys_packed: rows summarised by this call (the rest
  // reused). provenance: null (reuse by hash) or what the caller knows about K's rows.
  std::shared_ptr<const KeyCache> prepare(const AttentionCall& call, const kernels::KernelSet& kernels,
                                          const TaskRunner& runner, uint64_t& keys_packed,
                                          const KeyProvenance* provenance = nullptr) const;

  // A call that needs no summaries (fewer keys than min_keys): the provenance facts still move on,
  // so the rows it writes are the kernel's own when summaries are first needed.
  void track(const AttentionCall& call, const KeyProvenance* provenance) const;

 private:
  std::shared_ptr<const std::vector<float>> projection_for(size_t d) const;

  std::shared_ptr<const std::vector<uint32_t>> hash_key_for(size_t d) const;

  KeySummary summary_;
  bool keep_;    // false: every call summarises every key (pack_cache = 0)
  bool verify_;  // with a provenance: reuse by hash all the same
  uint64_t hash_seed_;  // random per kernel: the row hashes are keyed
  mutable std::mutex mutex_;
  mutable std::shared_ptr<KeyCache> cache_;
  mutable std::shared_ptr<const std::vector<float>> projection_;
  mutable std::shared_ptr<const std::vector<uint32_t>> hash_key_;
};

// The projection matrix of proj_bits (row-major [d, bits], N(0, 1) from a fixed splitmix64 /
// Box-Muller stream: part of the op's definition, the same in every build).
std::vector<float> projection_matrix(size_t d, size_t bits);

// Bit packing of one vector (exposed for tests): writes planes x words uint64 at
// out[(p * words + w) * stride], returns gamma and adds the set bits to *bits_set.
float pack_vector(const float* x, size_t d, PackMode mode, float eps, uint64_t* out, size_t stride, uint64_t* bits_set);

}  // namespace ortsparse::attention
