// Thread-local scratch keeps its capacity between calls, so a decode step allocates nothing; a
// buffer that one large call (a long prefill) grew past kKeepScratchBytes is released after the
// call, so a session's threads do not hold on to it.
#pragma once

#include <cstddef>
#include <vector>

namespace ortsparse {

constexpr size_t kKeepScratchBytes = size_t{4} << 20;

template <typename T>
void release_if_large(std::vector<T>& buffer) {
  if (buffer.capacity() * sizeof(T) > kKeepScratchBytes) std::vector<T>().swap(buffer);
}

template <typename T, typename... More>
void release_if_large(std::vector<T>& first, More&... more) {
  release_if_large(first);
  release_if_large(more...);
}

}  // namespace ortsparse
