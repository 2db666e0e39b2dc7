// Run-time I/O shared by the matmul ops: X [..., K] -> Y [..., N or N/2 with a GLU epilogue], optional bias B [N], and the
// call of the engine's composer.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/gated_matmul.h"
#include "ort/op_adapter.h"

namespace ortsparse::ort {

struct MatMulIo {
  const float* x = nullptr;
  const float* bias = nullptr;
  float* y = nullptr;
  size_t m = 0;    // product of X's leading dims
  size_t seq = 1;  // X's second-to-last dim (1 for a 1-D or 2-D... X of rank 1); batch = m / seq
};

// Validates X (float, rank >= 1, last dim == k) and the bias (float [n], input index bias_index, if
// present; bias_name: its name in the op's schema, "B" or, in the quantized form, "bias") and allocates
// Y [..., out_n] (out_n < n with an epilogue); throws naming the input and shapes.
MatMulIo bind_matmul_io(Ort::KernelContext& context, size_t k, size_t n, size_t bias_index, size_t out_n,
                        const char* bias_name = "B");

// Binds the I/O and runs the composer on the call's kernels and ORT's intra-op pool. Rows of X
// along its second-to-last dim are one sequence (what a gate with state follows).
engine::MatMulStats run_matmul(OrtKernelContext* context, const engine::GatedMatMul& matmul, size_t bias_index,
                               bool reset = false, const char* bias_name = "B");

// The process's kernel set, or an error naming the refused ORTSPARSE_ISA / ORTSPARSE_POPCNT.
const kernels::KernelSet& kernel_set_or_fail();

}  // namespace ortsparse::ort
