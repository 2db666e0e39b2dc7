// memcpy of floats that tolerates empty ranges: a tensor with a zero dimension has a null data
// pointer, which memcpy must never see (UB even with size 0; UBSan flags it).
#pragma once

#include <cstddef>
#include <cstring>

namespace ortsparse {

inline void copy_floats(float* dst, const float* src, size_t count) {
  if (count > 0) std::memcpy(dst, src, count * sizeof(float));
}

}  // namespace ortsparse
