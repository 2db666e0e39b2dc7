// Errors the ops report to ORT: a message naming what was wrong (op, node, input, values).
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace ortsparse {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

template <typename... Parts>
std::string concat(Parts&&... parts) {
  std::ostringstream out;
  (out << ... << std::forward<Parts>(parts));
  return out.str();
}

template <typename... Parts>
[[noreturn]] void fail(Parts&&... parts) {
  throw Error(concat(std::forward<Parts>(parts)...));
}

}  // namespace ortsparse
