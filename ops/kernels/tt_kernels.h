// Small dense GEMMs the tensor-train contraction is made of. Kept apart from the shared KernelTable:
// one table per ISA, picked like kernels_for() (tt_kernels_scalar.cc is the reference twin every
// SIMD variant is tested against, tails included: tests/ops/test_tt_op.py).
#pragma once

#include <cstddef>


namespace ortsparse::kernels {

struct TTKernels {
  // C[m x n] = A[m x k] . B[k x n], all row-major with leading dims lda, ldb, ldc (C overwritten,
  // never read: k = 0 gives zeros). Blocked over k and n so a B strip stays in L1 across rows.
  void (*gemm)(const float* a, size_t lda, const float* b, size_t ldb, float* c, size_t ldc, size_t m, size_t k,
               size_t n);
};

const TTKernels& tt_kernels_scalar();
const TTKernels& tt_kernels_avx2();
const TTKernels& tt_kernels_avx512();


// Column/depth blocking shared by the SIMD variants: a [kTTDepthBlock x kTTPanel] strip of B is
// 16 KiB (fits L1 beside the A rows) and is reused by every row group of C.
constexpr size_t kTTDepthBlock = 256;
constexpr size_t kTTPanel = 16;

}  // namespace ortsparse::kernels
