#include <cstdlib>

#include "attention/popcount_kernels.h"
#include "common/cpu_features.h"
#include "common/error.h"

namespace ortsparse::attention {
namespace {

struct ActivePath {
  PopcntPath path = PopcntPath::kPortable;
  std::string error;
};

PopcntPath best_path() {
  if (popcnt_path_supported(PopcntPath::kVpopcntdq)) return PopcntPath::kVpopcntdq;
  if (popcnt_path_supported(PopcntPath::kPopcnt)) return PopcntPath::kPopcnt;
  return PopcntPath::kPortable;
}

ActivePath choose() {
  ActivePath out;
  out.path = best_path();
  const char* forced = std::getenv("ORTSPARSE_POPCNT");
  if (forced == nullptr || *forced == '\0') return out;
  for (PopcntPath p : {PopcntPath::kPortable, PopcntPath::kPopcnt, PopcntPath::kVpopcntdq}) {
    if (std::string(forced) == popcnt_path_name(p)) {
      if (popcnt_path_supported(p))
        out.path = p;
      else
        out.error = std::string("ORTSPARSE_POPCNT=") + forced + " but this CPU/OS does not support it";
      return out;
    }
  }
  out.error = std::string("ORTSPARSE_POPCNT=") + forced + " is not one of portable, popcnt, vpopcntdq";
  return out;
}

const ActivePath& active() {
  static const ActivePath chosen = choose();
  return chosen;
}

}  // namespace

const char* popcnt_path_name(PopcntPath path) {
  switch (path) {
    case PopcntPath::kVpopcntdq: return "vpopcntdq";
    case PopcntPath::kPopcnt: return "popcnt";
    default: return "portable";
  }
}

bool popcnt_path_supported(PopcntPath path) {
  const CpuFeatures& f = cpu_features();
  switch (path) {
    case PopcntPath::kVpopcntdq: return f.avx512f && f.avx512vpopcntdq;
    case PopcntPath::kPopcnt: return f.popcnt;
    default: return true;
  }
}

PopcntPath parse_popcnt_path(const std::string& name) {
  for (PopcntPath p : {PopcntPath::kPortable, PopcntPath::kPopcnt, PopcntPath::kVpopcntdq})
    if (name == popcnt_path_name(p)) return p;
  fail("unknown popcount path '", name, "' (portable, popcnt, vpopcntdq)");
}

const PopcountTable& popcount_table(PopcntPath path) {
  switch (path) {
    case PopcntPath::kVpopcntdq: return popcount_vpopcntdq();
    case PopcntPath::kPopcnt: return popcount_popcnt();
    default: return popcount_portable();
  }
}

PopcntPath active_popcnt_path() { return active().path; }
const std::string& active_popcnt_error() { return active().error; }

}  // namespace ortsparse::attention
