// Finiteness of a float row, tested on the exponent bits (all set: Inf or NaN) with integer ops, so
// the loop vectorises without fast-math (a float reduction would not).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace ortsparse {

inline bool all_finite(const float* x, size_t n) {
  uint32_t bad = 0;
  for (size_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, x + i, sizeof(bits));
    bad |= static_cast<uint32_t>((bits & 0x7f800000u) == 0x7f800000u);
  }
  return bad == 0;
}

}  // namespace ortsparse
