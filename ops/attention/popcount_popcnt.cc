// POPCNT path: compiled with -mpopcnt, so __builtin_popcountll is one instruction. Only called
// when CpuFeatures reports POPCNT.
#include "attention/popcount_generic.h"

namespace ortsparse::attention {
namespace {

int pop_hw(uint64_t x) { return __builtin_popcountll(x); }

}  // namespace

const PopcountTable& popcount_popcnt() {
  static const PopcountTable table{"popcnt", generic::and_counts<pop_hw>, generic::xor_counts<pop_hw>,
                                   generic::ternary_counts<pop_hw>};
  return table;
}

}  // namespace ortsparse::attention
