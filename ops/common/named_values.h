// An enum attribute's values by name: one table per enum gives its parser (with the one-line
// error that lists the valid names, in the table's order) and each value's name.
#pragma once

#include <cstddef>
#include <string>

#include "common/error.h"

namespace ortsparse {

template <class E>
struct Named {
  const char* name;
  E value;
};

template <class E, size_t N>
E parse_named(const char* attribute, const std::string& name, const Named<E> (&table)[N]) {
  for (const Named<E>& entry : table)
    if (name == entry.name) return entry.value;
  std::string valid;
  for (size_t i = 0; i < N; ++i) valid += (i ? ", " : "") + std::string(table[i].name);
  fail("attribute ", attribute, "='", name, "' is not one of ", valid);
}

template <class E, size_t N>
const char* name_of(E value, const Named<E> (&table)[N]) {
  for (const Named<E>& entry : table)
    if (entry.value == value) return entry.name;
  return "?";  // unreachable while every value has its row
}

}  // namespace ortsparse
