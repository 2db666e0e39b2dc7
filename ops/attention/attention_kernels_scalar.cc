#include "attention/attention_kernels.h"

namespace ortsparse::attention {
namespace {

void dot_rows_scalar(const float* q, const float* k, size_t ldk, size_t d, const int32_t* rows, size_t n, float* out) {
  for (size_t i = 0; i < n; ++i) {
    const float* kr = k + (rows ? static_cast<size_t>(rows[i]) : i) * ldk;
    float s = 0.0f;
    for (size_t j = 0; j < d; ++j) s += q[j] * kr[j];
    out[i] = s;
  }
}

}  // namespace

const AttentionKernels& attention_kernels_scalar() {
  static const AttentionKernels table{"scalar", dot_rows_scalar};
  return table;
}

const AttentionKernels& attention_kernels_for(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return attention_kernels_avx512();
    case Isa::kAvx2: return attention_kernels_avx2();
    default: return attention_kernels_scalar();
  }
}

}  // namespace ortsparse::attention
