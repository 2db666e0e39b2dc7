// POPCNT path: compiled with -mpopcnt, so __builtin_popcountll is one instruction. Only called
// when CpuFeatures reports POPCNT.
#include "kernels/popcount_generic.h"

namespace ortsparse::kernels {
namespace {

int pop_hw(uint64_t x) { return __builtin_popcountll(x); }

}  // namespace

const PopcountKernels& popcount_popcnt() {
  static const PopcountKernels table{generic::and_counts<pop_hw>, generic::xor_counts<pop_hw>,
                                   generic::ternary_counts<pop_hw>};
  return table;
}

}  // namespace ortsparse::kernels
