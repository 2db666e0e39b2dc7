// Float kernels of exact attention that the engine's KernelTable lacks: q·k over a list of keys.
// (P·V is the engine's gemv_rows: a weighted sum of V rows.) One variant per ISA, the scalar one
// is the reference twin (tests/ops/test_popcount_attention.py forces each with ORTSPARSE_ISA).
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/cpu_features.h"

namespace ortsparse::attention {

struct AttentionKernels {
  const char* isa;
  // out[i] = sum_d q[d] * k[row(i) * ldk + d],  row(i) = rows ? rows[i] : i.
  void (*dot_rows)(const float* q, const float* k, size_t ldk, size_t d, const int32_t* rows, size_t n, float* out);
};

const AttentionKernels& attention_kernels_scalar();
const AttentionKernels& attention_kernels_avx2();
const AttentionKernels& attention_kernels_avx512();
const AttentionKernels& attention_kernels_for(Isa isa);

}  // namespace ortsparse::attention
