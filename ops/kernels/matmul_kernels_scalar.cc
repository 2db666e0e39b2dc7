// Reference kernels: plain loops, the definition the SIMD variants must match.
#include <cmath>

#include "kernels/exp_generic.h"
#include "kernels/matmul_kernels.h"
#include "kernels/order_key.h"

namespace ortsparse::kernels {
namespace {

inline size_t row_of(const int32_t* rows, size_t i) { return rows ? static_cast<size_t>(rows[i]) : i; }

void gemv_rows_scalar(const float* w, size_t ldw, const int32_t* rows, const float* xv, size_t nrows,
                      float* y, size_t n, bool accumulate) {
  if (!accumulate) {
    for (size_t j = 0; j < n; ++j) y[j] = 0.0f;
  }
  for (size_t i = 0; i < nrows; ++i) {
    const float a = xv[i];
    const float* wr = w + row_of(rows, i) * ldw;
    for (size_t j = 0; j < n; ++j) y[j] += a * wr[j];
  }
}

void gemm_rows_scalar(const float* w, size_t ldw, const int32_t* rows, const float* xv, size_t nrows,
                      float* y, size_t ldy, size_t n, bool accumulate) {
  for (size_t t = 0; t < kTokenTile; ++t) {
    float* yt = y + t * ldy;
    if (!accumulate) {
      for (size_t j = 0; j < n; ++j) yt[j] = 0.0f;
    }
    for (size_t i = 0; i < nrows; ++i) {
      const float a = xv[i * kTokenTile + t];
      const float* wr = w + row_of(rows, i) * ldw;
      for (size_t j = 0; j < n; ++j) yt[j] += a * wr[j];
    }
  }
}

void block_sumsq_scalar(const float* x, size_t k, size_t block, float* out) {
  for (size_t b = 0, start = 0; start < k; ++b, start += block) {
    const size_t end = start + block < k ? start + block : k;
    float s = 0.0f;
    for (size_t i = start; i < end; ++i) s += x[i] * x[i];
    out[b] = s;
  }
}

void block_sumabs_scalar(const float* x, size_t k, size_t block, float* out) {
  for (size_t b = 0, start = 0; start < k; ++b, start += block) {
    const size_t end = start + block < k ? start + block : k;
    float s = 0.0f;
    for (size_t i = start; i < end; ++i) s += std::fabs(x[i]);
    out[b] = s;
  }
}

void order_keys_scalar(const float* values, size_t n, uint32_t* keys, uint32_t* min_key, uint32_t* max_key) {
  uint32_t lo = 0xFFFFFFFFu, hi = 0;
  for (size_t i = 0; i < n; ++i) {
    keys[i] = order_key(values[i]);
    lo = keys[i] < lo ? keys[i] : lo;
    hi = keys[i] > hi ? keys[i] : hi;
  }
  *min_key = lo;
  *max_key = hi;
}

size_t count_at_least_scalar(const uint32_t* keys, size_t n, uint32_t t) {
  size_t count = 0;
  for (size_t i = 0; i < n; ++i) count += keys[i] >= t;
  return count;
}

size_t indices_in_range_scalar(const uint32_t* keys, size_t n, uint32_t lo, uint32_t hi, int32_t* out) {
  size_t count = 0;
  for (size_t i = 0; i < n; ++i)
    if (keys[i] >= lo && keys[i] <= hi) out[count++] = static_cast<int32_t>(i);
  return count;
}

void silu_glu_scalar(const float* gate, const float* up, size_t n, float* out) {
  for (size_t i = 0; i < n; ++i) out[i] = generic::silu_times(gate[i], up[i]);
}

}  // namespace

const MatMulKernels& matmul_kernels_scalar() {
  static const MatMulKernels table{gemv_rows_scalar, gemm_rows_scalar, block_sumsq_scalar, block_sumabs_scalar,
                                   silu_glu_scalar};
  return table;
}

const SelectKernels& select_kernels_scalar() {
  static const SelectKernels table{order_keys_scalar, count_at_least_scalar, indices_in_range_scalar};
  return table;
}

}  // namespace ortsparse::kernels
