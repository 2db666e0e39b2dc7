// One kernel set per ISA: every table of leaf kernels the engine and attention use, chosen once
// per process from the CPU's features (ORTSPARSE_ISA=scalar|avx2|avx512 forces the ISA,
// ORTSPARSE_POPCNT=portable|popcnt|vpopcntdq the popcount path, so one machine tests every path).
// Code above this layer never picks a table itself: it is handed a KernelSet and uses its members.
#pragma once

#include <string>

#include "common/cpu_features.h"
#include "kernels/attention_kernels.h"
#include "kernels/matmul_kernels.h"
#include "kernels/popcount_kernels.h"
#include "kernels/proc_kernels.h"
#include "kernels/quant_kernels.h"
#include "kernels/tt_kernels.h"

namespace ortsparse::kernels {

enum class PopcntPath { kPortable = 0, kPopcnt = 1, kVpopcntdq = 2 };

struct KernelSet {
  Isa isa;
  PopcntPath popcnt_path;
  const MatMulKernels* matmul;
  const SelectKernels* select;
  const ProcKernels* proc;
  const TTKernels* tt;
  const AttentionKernels* attention;
  const PopcountKernels* popcount;
  const QuantKernels* quant;

  const char* isa_name() const { return ortsparse::isa_name(isa); }
};

// The set of an ISA and popcount path the CPU supports (callers check isa_supported /
// popcnt_path_supported first).
const KernelSet& kernel_set(Isa isa, PopcntPath popcnt);
// The process's set: ORTSPARSE_ISA / ORTSPARSE_POPCNT if set and supported, else the best the CPU has.
const KernelSet& active_kernel_set();
// Empty when the environment's choices were valid; otherwise why one was refused (the ops report
// it at session creation instead of silently running another path).
const std::string& active_kernel_set_error();

const char* popcnt_path_name(PopcntPath path);
bool popcnt_path_supported(PopcntPath path);
PopcntPath best_popcnt_path();
PopcntPath parse_popcnt_path(const std::string& name);  // throws Error naming the valid values

}  // namespace ortsparse::kernels
