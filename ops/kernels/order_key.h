// The order key of a float: an unsigned integer that sorts like the float.
#pragma once

#include <cstdint>

namespace ortsparse::kernels {

// Orderable unsigned key of a float (NaN sorts above +inf, so NaN blocks are kept and propagate).
// Written with selects only, so a loop over it vectorises.
inline uint32_t order_key(float value) {
  uint32_t bits;
  __builtin_memcpy(&bits, &value, sizeof(bits));
  bits = bits == 0x80000000u ? 0u : bits;  // -0 ties with +0
  const uint32_t key = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  return (bits & 0x7FFFFFFFu) > 0x7F800000u ? 0xFFFFFFFFu : key;
}

}  // namespace ortsparse::kernels
