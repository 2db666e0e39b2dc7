// Errors the ops report to ORT: a message naming what was wrong (op, node, input, values).
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

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

// "[2, 3, 4]": a shape (or any list of integers) as error messages print it; the one formatter.
template <typename T>
std::string shape_string(const std::vector<T>& values) {
  std::string text = "[";
  for (size_t i = 0; i < values.size(); ++i) text += (i ? ", " : "") + std::to_string(values[i]);
  return text + "]";
}

template <typename... Parts>
[[noreturn]] void fail(Parts&&... parts) {
  throw Error(concat(std::forward<Parts>(parts)...));
}

}  // namespace ortsparse
