// Kernels of the `proc` weight backend (ProcSparseMatMul): W is a procedural base plus, per output
// unit, the deltas of its `fanout` kept K-blocks. The hash below is part of the file format: the
// golden values in tests/ops/test_proc_op.py pin it; never change it.
#pragma once

#include <cstddef>
#include <cstdint>


namespace ortsparse::kernels {

// base(n, k) = base_scale * u(h(seed, n, k)), where
//   h(seed, n, k) = splitmix64 output number i = n * 2^32 + k of a generator seeded with `seed`,
//                   i.e. mix(seed + 0x9E3779B97F4A7C15 * (i + 1)) (all arithmetic mod 2^64),
//   u(h)          = (h >> 40) * 2^-23 - 1, exactly representable in fp32, uniform on [-1, 1),
// and the product base_scale * u is one fp32 rounding. A reconstructed weight is
// fl(base(n, k) + delta) (an fp16 delta is widened exactly first).
constexpr uint64_t kProcGolden = 0x9E3779B97F4A7C15ull;
constexpr uint64_t kProcMix1 = 0xBF58476D1CE4E5B9ull;
constexpr uint64_t kProcMix2 = 0x94D049BB133111EBull;

inline uint64_t proc_mix(uint64_t z) {
  z = (z ^ (z >> 30)) * kProcMix1;
  z = (z ^ (z >> 27)) * kProcMix2;
  return z ^ (z >> 31);
}
inline uint64_t proc_hash(uint64_t seed, uint64_t n, uint64_t k) {
  return proc_mix(seed + kProcGolden * (((n << 32) | k) + 1));
}
inline float proc_unit(uint64_t h) { return static_cast<float>(h >> 40) * (1.0f / 8388608.0f) - 1.0f; }
inline float proc_base(uint64_t seed, float scale, uint64_t n, uint64_t k) {
  return scale * proc_unit(proc_hash(seed, n, k));
}

// IEEE binary16 -> binary32, exact (the SIMD kernels use F16C / AVX-512 conversions, also exact).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu, bits;
  if (exp == 0x1Fu) {
    bits = sign | 0x7F800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exp = 113;
    while (!(mant & 0x400u)) {
      mant <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((mant & 0x3FFu) << 13);
  }
  float out;
  __builtin_memcpy(&out, &bits, sizeof(out));
  return out;
}

enum class DeltaType { kF32, kF16 };

// Bytes after the last delta a kernel may read (and ignore): whole-vector loads of short tails.
constexpr size_t kProcDeltaPad = 64;

// The packed layout (see docs/ops.md#procsparsematmul): per output unit n, `fanout` kept block
// indices (ascending) and, contiguous, the `block` deltas of each kept block (a short last block is
// zero-padded). Units follow each other, so a decode step streams the whole layout once.
struct ProcPacked {
  size_t k = 0, n = 0, block = 1, fanout = 0, num_blocks = 0;
  uint64_t seed = 0;
  float base_scale = 0.0f;
  const uint16_t* index = nullptr;  // [n, fanout]
  const void* deltas = nullptr;     // [n, fanout, block], float or binary16, + kProcDeltaPad readable bytes
  DeltaType delta_type = DeltaType::kF32;
};

// Tokens computed together over one pass of the layout (prefill reuses each loaded block 4 times).
constexpr size_t kProcTokenTile = 4;

struct ProcKernels {
  // For units j in [n0, n1) and tokens t < count (1..kProcTokenTile):
  //   y[t][j] = (bias ? bias[j] : 0) + sum over unit j's kept blocks b with (mask == nullptr || mask[b])
  //             of sum_{r in b} fl(base(j, r) + delta(j, b, r)) * x[t][r].
  // x must be 0 on the rows of blocks the mask excludes (the backend zeroes them), so a kernel may
  // compute such a block anyway: the AVX-512 block-1 path (gathers) does not test the mask.
  // Returns the number of (unit, block) pairs computed. base_scale == 0 never hashes.
  size_t (*units)(const ProcPacked& p, const float* const* x, size_t count, const uint8_t* mask, size_t n0,
                  size_t n1, const float* bias, float* const* y);

  // out[i] = base(n, k0 + i) for i < count (golden-value tests, the builder).
  void (*base_values)(uint64_t seed, float scale, uint64_t n, uint64_t k0, size_t count, float* out);
};

const ProcKernels& proc_kernels_scalar();
const ProcKernels& proc_kernels_avx2();
const ProcKernels& proc_kernels_avx512();

}  // namespace ortsparse::kernels
