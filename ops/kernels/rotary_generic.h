// Rotary position embedding of one row, the way onnxruntime's MLAS kernel computes it on x86 with
// AVX2 (so present_key rows come out bit-identical to com.microsoft.GroupQueryAttention's):
//   out_re = fma(re, cos, -(im * sin)),  out_im = fma(re, sin, im * cos)
// with (re, im) = (x[i], x[i + half]) (half split) or (x[2i], x[2i + 1]) (interleaved). fma is
// exactly rounded, so every ISA gets the same bits: the scalar file calls libm's fma, the SIMD
// files are compiled with -mfma and get the instruction. Included once per ISA file.
#pragma once

#include <cmath>
#include <cstddef>

namespace ortsparse::kernels::generic {
// Internal linkage: each ISA file keeps its own copy (compiled with its own flags).
namespace {

void rotate(const float* x, const float* cos, const float* sin, size_t half, int interleaved, float* out) {
  if (interleaved) {
    for (size_t i = 0; i < half; ++i) {
      const float re = x[2 * i], im = x[2 * i + 1];
      out[2 * i] = std::fma(re, cos[i], -(im * sin[i]));
      out[2 * i + 1] = std::fma(re, sin[i], im * cos[i]);
    }
  } else {
    for (size_t i = 0; i < half; ++i) {
      const float re = x[i], im = x[i + half];
      out[i] = std::fma(re, cos[i], -(im * sin[i]));
      out[i + half] = std::fma(re, sin[i], im * cos[i]);
    }
  }
}

}  // namespace
}  // namespace ortsparse::kernels::generic
