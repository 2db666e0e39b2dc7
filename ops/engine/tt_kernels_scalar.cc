// Reference GEMM: plain loops in the order the SIMD variants accumulate (k ascending per C entry).
#include "engine/tt_kernels.h"

namespace ortsparse::engine {
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

const TTKernelTable& tt_kernels_scalar() {
  static const TTKernelTable table{"scalar", gemm_scalar};
  return table;
}

const TTKernelTable& tt_kernels_for(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return tt_kernels_avx512();
    case Isa::kAvx2: return tt_kernels_avx2();
    default: return tt_kernels_scalar();
  }
}

const TTKernelTable& tt_active_kernels() {
  static const TTKernelTable& table = tt_kernels_for(active_isa());
  return table;
}

}  // namespace ortsparse::engine
