// One accessor per op; register.cc adds them all to the ai.ortsparse domain.
#pragma once

#include "ort/op_adapter.h"

namespace ortsparse::ort {

const OrtCustomOp* kwta_block_matmul_op();
const OrtCustomOp* event_driven_matmul_op();
const OrtCustomOp* proc_sparse_matmul_op();
const OrtCustomOp* popcount_attention_op();
const OrtCustomOp* popcount_group_query_attention_op();
const OrtCustomOp* tt_matmul_op();

}  // namespace ortsparse::ort
