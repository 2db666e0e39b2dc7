// Portable popcount (no POPCNT instruction): SWAR bit counting, the reference twin of the others.
#include "kernels/popcount_generic.h"

namespace ortsparse::kernels {
namespace {

int pop_swar(uint64_t x) {
  x = x - ((x >> 1) & 0x5555555555555555ull);
  x = (x & 0x3333333333333333ull) + ((x >> 2) & 0x3333333333333333ull);
  x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0Full;
  return static_cast<int>((x * 0x0101010101010101ull) >> 56);
}

}  // namespace

const PopcountKernels& popcount_portable() {
  static const PopcountKernels table{generic::and_counts<pop_swar>, generic::xor_counts<pop_swar>,
                                   generic::ternary_counts<pop_swar>};
  return table;
}

}  // namespace ortsparse::kernels
