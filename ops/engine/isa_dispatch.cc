#include "common/cpu_features.h"
#include "engine/kernels.h"

namespace ortsparse::engine {

const KernelTable& kernels_for(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return kernels_avx512();
    case Isa::kAvx2: return kernels_avx2();
    default: return kernels_scalar();
  }
}

const KernelTable& active_kernels() {
  static const KernelTable& table = kernels_for(active_isa());
  return table;
}

}  // namespace ortsparse::engine
