// Run-time I/O shared by the matmul ops: X [..., K] -> Y [..., N], optional bias B [N].
#pragma once

#include <cstdint>
#include <vector>

#include "ort/op_adapter.h"

namespace ortsparse::ort {

struct MatMulIo {
  const float* x = nullptr;
  const float* bias = nullptr;
  float* y = nullptr;
  size_t m = 0;  // product of X's leading dims
};

// Validates X (float, rank >= 1, last dim == k) and B (float [n], input index bias_index, if
// present) and allocates Y; throws naming the input and shapes.
MatMulIo bind_matmul_io(Ort::KernelContext& context, size_t k, size_t n, size_t bias_index);

}  // namespace ortsparse::ort
