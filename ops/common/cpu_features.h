// CPU features, detected once, and the ISA the kernels run on.
#pragma once

#include <string>

namespace ortsparse {

struct CpuFeatures {
  bool avx2 = false;
  bool fma = false;
  bool f16c = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512vl = false;
  bool avx512dq = false;
  bool avx512vnni = false;
  bool avx512vpopcntdq = false;
  bool popcnt = false;
  bool os_saves_ymm = false;
  bool os_saves_zmm = false;
};

const CpuFeatures& cpu_features();

enum class Isa { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

const char* isa_name(Isa isa);
bool isa_supported(Isa isa);
Isa best_supported_isa();

// The ISA chosen for this process: ORTSPARSE_ISA=scalar|avx2|avx512 if set (an ISA the CPU lacks
// is an error, reported by active_isa_error()), else the best the CPU and OS support.
Isa active_isa();
// Empty when ORTSPARSE_ISA is unset or valid; otherwise the reason it was refused.
const std::string& active_isa_error();

}  // namespace ortsparse
