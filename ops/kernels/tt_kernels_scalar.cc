// Reference GEMM: plain loops in the order the SIMD variants accumulate (k ascending per C entry).
#include "kernels/tt_kernels.h"

namespace ortsparse::kernels {
namespace {

void gemm_scalar(const float* a, size_t lda, const float* b, size_t ldb, float* c, size_t ldc, size_t m, size_t k,
                 size_t n) {
  for (size_t i = 0; i < m; ++i) {
    float* ci = c + i * ldc;
    for (size_t j = 0; j < n; ++j) ci[j] = 0.0f;
    const float* ai = a + i * lda;
    for (size_t p = 0; p < k; ++p) {
      const float av = ai[p];
      const float* bp = b + p * ldb;
      for (size_t j = 0; j < n; ++j) ci[j] += av * bp[j];
    }
  }
}

}  // namespace

const TTKernels& tt_kernels_scalar() {
  static const TTKernels table{gemm_scalar};
  return table;
}

}  // namespace ortsparse::kernels
