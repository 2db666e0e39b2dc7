#include "kernels/top_k.h"

#include <algorithm>
#include <cmath>
#include <functional>

namespace ortsparse::kernels {

size_t select_top_k(const SelectKernels& kernels, const float* values, size_t n, size_t k, int32_t* kept,
                    std::vector<uint32_t>& scratch) {
  if (k >= n) {
    for (size_t i = 0; i < n; ++i) kept[i] = static_cast<int32_t>(i);
    return n;
  }
  if (k == 0) return 0;
  constexpr size_t kFew = 64;
  if (scratch.size() < 2 * n + kIndexSlack) scratch.resize(2 * n + kIndexSlack);
  uint32_t* keys = scratch.data();
  uint32_t min_key = 0, max_key = 0;
  kernels.order_keys(values, n, keys, &min_key, &max_key);
  // Narrow [lo, hi) around the k-th largest key with vectorised counting passes: count(>= lo) >= k
  // > count(>= hi). A step interpolates the count linearly in key space (keys of floats are close
  // to log-scale, where score distributions are smooth); a step that did not at least halve the
  // candidates is followed by a bisection, so any input converges in a bounded number of passes.
  uint64_t lo = min_key, hi = uint64_t{max_key} + 1;
  size_t count_lo = n, count_hi = 0;
  bool bisect = false;
  while (count_lo - count_hi > kFew && hi - lo > 1) {
    uint64_t mid;
    if (bisect) {
      mid = lo + (hi - lo) / 2;
    } else {
      const double above = static_cast<double>(count_lo - k) + 0.5;
      const double fraction = above / static_cast<double>(count_lo - count_hi);
      mid = lo + static_cast<uint64_t>(fraction * static_cast<double>(hi - lo));
    }
    mid = std::min(std::max(mid, lo + 1), hi - 1);
    const size_t before = count_lo - count_hi;
    const size_t count = kernels.count_at_least(keys, n, static_cast<uint32_t>(mid));
    if (count == k) return kernels.indices_in_range(keys, n, static_cast<uint32_t>(mid), 0xFFFFFFFFu, kept);
    if (count > k) {
      lo = mid;
      count_lo = count;
    } else {
      hi = mid;
      count_hi = count;
    }
    bisect = !bisect && 2 * (count_lo - count_hi) > before;
  }
  // The k-th largest key tau is among the few keys in [lo, hi): every key >= hi is kept, plus the
  // k - count_hi largest of them.
  const size_t take = k - count_hi;
  uint32_t tau = static_cast<uint32_t>(lo);  // when [lo, hi) is one key value, many equal keys
  if (count_lo - count_hi <= kFew) {
    int32_t* few_index = reinterpret_cast<int32_t*>(keys + n);
    const size_t n_few =
        kernels.indices_in_range(keys, n, static_cast<uint32_t>(lo), static_cast<uint32_t>(hi - 1), few_index);
    uint32_t few[kFew];
    for (size_t i = 0; i < n_few; ++i) few[i] = keys[few_index[i]];
    std::nth_element(few, few + (take - 1), few + n_few, std::greater<uint32_t>());
    tau = few[take - 1];
  }
  if (kernels.count_at_least(keys, n, tau) == k) return kernels.indices_in_range(keys, n, tau, 0xFFFFFFFFu, kept);
  // Several keys equal tau and only some fit: all keys above tau, then the lowest-index equal ones.
  const size_t greater = tau == 0xFFFFFFFFu ? 0 : kernels.count_at_least(keys, n, tau + 1);
  size_t equal_left = k - greater;
  size_t out = 0;
  for (size_t i = 0; i < n; ++i) {
    if (keys[i] > tau || (keys[i] == tau && equal_left > 0)) {
      if (keys[i] == tau) --equal_left;
      kept[out++] = static_cast<int32_t>(i);
    }
  }
  return out;
}

size_t select_top_k(const double* values, const double* tie_break, size_t n, size_t k, int32_t* kept) {
  k = std::min(k, n);
  std::vector<int32_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = static_cast<int32_t>(i);
  // -1: a ranks first, 1: b does, 0: tie. Larger first, NaN above everything.
  const auto compare = [](double va, double vb) {
    const bool na = std::isnan(va), nb = std::isnan(vb);
    if (na != nb) return na ? -1 : 1;
    if (na || va == vb) return 0;
    return va > vb ? -1 : 1;
  };
  const auto before = [&](int32_t a, int32_t b) {
    int c = compare(values[a], values[b]);
    if (c == 0 && tie_break != nullptr) c = compare(tie_break[a], tie_break[b]);
    return c != 0 ? c < 0 : a < b;
  };
  if (k < n) std::nth_element(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(k), order.end(), before);
  std::sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(k));
  std::copy_n(order.begin(), k, kept);
  return k;
}

}  // namespace ortsparse::kernels
