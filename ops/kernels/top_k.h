// The one top-k selector of the project (KWTA blocks, event refresh order, attention keys).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/matmul_kernels.h"

namespace ortsparse::kernels {

// Writes the indices of the k largest values to kept, in ascending index order; ties at the k-th
// value go to the lower index; NaN ranks above +inf (kernels/order_key.h). kept must hold
// n + kIndexSlack entries; scratch is resized as needed and reused across calls. Vectorised
// counting passes that narrow the k-th key (interpolation, then bisection), no sort.
// Returns min(k, n).
size_t select_top_k(const SelectKernels& kernels, const float* values, size_t n, size_t k, int32_t* kept,
                    std::vector<uint32_t>& scratch);

// The same contract on doubles (ranks that float would collapse into ties, e.g. log-probabilities
// far apart), with an optional second key that orders ties of the first (larger first, NaN
// highest) before the lower index does; a scalar nth_element, for paths that are not per-token
// hot (the kwta hold mode).
size_t select_top_k(const double* values, const double* tie_break, size_t n, size_t k, int32_t* kept);

}  // namespace ortsparse::kernels
