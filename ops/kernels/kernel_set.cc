#include "kernels/kernel_set.h"

#include <cstdlib>

#include "common/error.h"

namespace ortsparse::kernels {
namespace {

constexpr PopcntPath kPopcntPaths[] = {PopcntPath::kPortable, PopcntPath::kPopcnt, PopcntPath::kVpopcntdq};

KernelSet make_set(Isa isa, PopcntPath popcnt) {
  KernelSet set{};
  set.isa = isa;
  set.popcnt_path = popcnt;
  switch (isa) {
#if ORTSPARSE_X86_KERNELS
    case Isa::kAvx512:
      set.matmul = &matmul_kernels_avx512();
      set.select = &select_kernels_avx512();
      set.proc = &proc_kernels_avx512();
      set.tt = &tt_kernels_avx512();
      set.attention = &attention_kernels_avx512();
      set.quant = &quant_kernels_avx512();
      break;
    case Isa::kAvx2:
      set.matmul = &matmul_kernels_avx2();
      set.select = &select_kernels_avx2();
      set.proc = &proc_kernels_avx2();
      set.tt = &tt_kernels_avx2();
      set.attention = &attention_kernels_avx2();
      set.quant = &quant_kernels_avx2();
      break;
#endif
    default:  // and every x86 ISA in a build without its kernels (never supported there)
      set.matmul = &matmul_kernels_scalar();
      set.select = &select_kernels_scalar();
      set.proc = &proc_kernels_scalar();
      set.tt = &tt_kernels_scalar();
      set.attention = &attention_kernels_scalar();
      set.quant = &quant_kernels_scalar();
      break;
  }
  switch (popcnt) {
#if ORTSPARSE_X86_KERNELS
    case PopcntPath::kVpopcntdq: set.popcount = &popcount_vpopcntdq(); break;
    case PopcntPath::kPopcnt: set.popcount = &popcount_popcnt(); break;
#endif
    default: set.popcount = &popcount_portable(); break;
  }
  return set;
}

struct ActiveChoice {
  Isa isa = Isa::kScalar;
  PopcntPath popcnt = PopcntPath::kPortable;
  std::string error;
};

ActiveChoice choose() {
  ActiveChoice out;
  out.isa = active_isa();
  out.error = active_isa_error();
  out.popcnt = best_popcnt_path();
  const char* forced = std::getenv("ORTSPARSE_POPCNT");
  if (forced == nullptr || *forced == '\0') return out;
  const std::string name(forced);
  for (PopcntPath p : kPopcntPaths) {
    if (name != popcnt_path_name(p)) continue;
    if (popcnt_path_supported(p)) {
      out.popcnt = p;
    } else if (out.error.empty()) {
      out.error = "ORTSPARSE_POPCNT=" + name + " but this CPU/OS does not support it";
    }
    return out;
  }
  if (out.error.empty()) out.error = "ORTSPARSE_POPCNT=" + name + " is not one of portable, popcnt, vpopcntdq";
  return out;
}

const ActiveChoice& active_choice() {
  static const ActiveChoice chosen = choose();
  return chosen;
}

}  // namespace

const KernelSet& kernel_set(Isa isa, PopcntPath popcnt) {
  static const KernelSet sets[3][3] = {
      {make_set(Isa::kScalar, PopcntPath::kPortable), make_set(Isa::kScalar, PopcntPath::kPopcnt),
       make_set(Isa::kScalar, PopcntPath::kVpopcntdq)},
      {make_set(Isa::kAvx2, PopcntPath::kPortable), make_set(Isa::kAvx2, PopcntPath::kPopcnt),
       make_set(Isa::kAvx2, PopcntPath::kVpopcntdq)},
      {make_set(Isa::kAvx512, PopcntPath::kPortable), make_set(Isa::kAvx512, PopcntPath::kPopcnt),
       make_set(Isa::kAvx512, PopcntPath::kVpopcntdq)},
  };
  return sets[static_cast<int>(isa)][static_cast<int>(popcnt)];
}

const KernelSet& active_kernel_set() {
  static const KernelSet& set = kernel_set(active_choice().isa, active_choice().popcnt);
  return set;
}

const std::string& active_kernel_set_error() { return active_choice().error; }

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
    case PopcntPath::kVpopcntdq: return f.avx512f && f.avx512vpopcntdq && f.os_saves_zmm;
    case PopcntPath::kPopcnt: return f.popcnt;
    default: return true;
  }
}

PopcntPath best_popcnt_path() {
  if (popcnt_path_supported(PopcntPath::kVpopcntdq)) return PopcntPath::kVpopcntdq;
  if (popcnt_path_supported(PopcntPath::kPopcnt)) return PopcntPath::kPopcnt;
  return PopcntPath::kPortable;
}

PopcntPath parse_popcnt_path(const std::string& name) {
  for (PopcntPath p : kPopcntPaths)
    if (name == popcnt_path_name(p)) return p;
  fail("unknown popcount path '", name, "' (portable, popcnt, vpopcntdq)");
}

}  // namespace ortsparse::kernels
