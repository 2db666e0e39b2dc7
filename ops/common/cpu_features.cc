#include "common/cpu_features.h"

#ifndef ORTSPARSE_X86_KERNELS
#error "ORTSPARSE_X86_KERNELS (0 or 1) comes from CMakeLists.txt"
#endif
#if ORTSPARSE_X86_KERNELS
#include <cpuid.h>
#endif

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace ortsparse {
namespace {

#if ORTSPARSE_X86_KERNELS
uint64_t read_xcr0() {
  uint32_t eax = 0, edx = 0;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}

CpuFeatures detect() {
  CpuFeatures f;
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return f;
  const bool osxsave = (ecx >> 27) & 1;
  f.fma = (ecx >> 12) & 1;
  f.popcnt = (ecx >> 23) & 1;
  f.f16c = (ecx >> 29) & 1;
  if (osxsave) {
    const uint64_t xcr0 = read_xcr0();
    f.os_saves_ymm = (xcr0 & 0x6) == 0x6;
    f.os_saves_zmm = (xcr0 & 0xE6) == 0xE6;
  }
  if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) {
    f.avx2 = ((ebx >> 5) & 1) && f.os_saves_ymm;
    f.avx512f = ((ebx >> 16) & 1) && f.os_saves_zmm;
    f.avx512dq = ((ebx >> 17) & 1) && f.os_saves_zmm;
    f.avx512bw = ((ebx >> 30) & 1) && f.os_saves_zmm;
    f.avx512vl = ((ebx >> 31) & 1) && f.os_saves_zmm;
    f.avx512vnni = ((ecx >> 11) & 1) && f.os_saves_zmm;
    f.avx512vpopcntdq = ((ecx >> 14) & 1) && f.os_saves_zmm;
  }
  f.fma = f.fma && f.os_saves_ymm;
  return f;
}
#else
// Built without the x86 kernels (another processor, or a compiler without the flags): report no
// feature, so only the scalar kernels are ever chosen and ORTSPARSE_ISA=avx2|avx512 is refused.
CpuFeatures detect() { return CpuFeatures{}; }
#endif

struct ActiveIsa {
  Isa isa = Isa::kScalar;
  std::string error;
};

ActiveIsa choose_isa() {
  ActiveIsa out;
  out.isa = best_supported_isa();
  const char* forced = std::getenv("ORTSPARSE_ISA");
  if (forced == nullptr || *forced == '\0') return out;
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    if (std::strcmp(forced, isa_name(isa)) == 0) {
      if (isa_supported(isa)) {
        out.isa = isa;
      } else {
        out.error = std::string("ORTSPARSE_ISA=") + forced + " but this CPU/OS does not support it";
      }
      return out;
    }
  }
  out.error = std::string("ORTSPARSE_ISA=") + forced + " is not one of scalar, avx2, avx512";
  return out;
}

const ActiveIsa& active() {
  static const ActiveIsa chosen = choose_isa();
  return chosen;
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = detect();
  return features;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "scalar";
  }
}

bool isa_supported(Isa isa) {
  const CpuFeatures& f = cpu_features();
  switch (isa) {
    case Isa::kAvx512: return f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq && f.avx2 && f.fma;
    case Isa::kAvx2: return f.avx2 && f.fma && f.f16c;
    default: return true;
  }
}

Isa best_supported_isa() {
  if (isa_supported(Isa::kAvx512)) return Isa::kAvx512;
  if (isa_supported(Isa::kAvx2)) return Isa::kAvx2;
  return Isa::kScalar;
}

Isa active_isa() { return active().isa; }
const std::string& active_isa_error() { return active().error; }

}  // namespace ortsparse
