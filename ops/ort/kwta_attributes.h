// The KWTA gate's attributes, read the same way by every op that has the gate: KwtaBlockMatMul
// (no prefix) and the composed modes of other ops (prefix "kwta_").
#pragma once

#include <string>

#include "engine/kwta_gate.h"
#include "ort/op_adapter.h"

namespace ortsparse::ort {

// Reads <prefix>k_frac (default `default_k_frac`), k_abs, score, threshold, temp, duty, duty_mode,
// renorm and max_gated_rows; throws naming the attribute (with its prefix) when a value is out of range.
engine::KwtaConfig read_kwta_attributes(const Attributes& attrs, const std::string& prefix, float default_k_frac);

}  // namespace ortsparse::ort
