"""MatMul with a transposed constant weight (a tied lm_head): one linear layer.

Before -> After::

    Y = MatMul(X, Transpose(E, perm=[1, 0]))      E: constant float32 [N, K] (e.g. the embedding)
    ->
    Y = ai.ortsparse.<op>(X, E^T, <settings>)       <op>: the chosen technique's (KwtaBlockMatMul...)

E^T is one new [K, N] initializer per E; E itself stays when something else (the embedding
Gather) still uses it.
"""
from __future__ import annotations

from typing import Any

import onnx_ir as ir
from onnxscript.rewriter import MatchResult

from ._base import FloatWeight, LinearOperands, LinearRule, check_activation, matched_output, weight_dims


class MatMulTransposedWeightRule(LinearRule):
    rule_name = "matmul_transposed_weight"
    before_after = "MatMul(X, Transpose(E)) -> <op>(X, E^T)"

    def pattern(self, op, x, w):
        return op.MatMul(x, op.Transpose(w, _outputs=["transposed"]), _outputs=["linear_out"])

    def check(self, context, linear_out: ir.Value, x: ir.Value, w: ir.Value, transposed: ir.Value,
              **_: Any) -> MatchResult:
        perm = transposed.producer().attributes.get_ints("perm", None)
        if perm is not None and list(perm) != [1, 0]:
            return MatchResult().fail(f"Transpose perm={list(perm)} is not a 2-D transpose", transposed)
        result, _, _ = weight_dims(w, transposed=True)
        return result if not result else check_activation(x)

    def operands(self, match: MatchResult) -> LinearOperands:
        w = match.bindings["w"]
        _, k, n = weight_dims(w, transposed=True)
        return LinearOperands(x=match.bindings["x"], weight=FloatWeight(w, transposed=True), bias=None,
                              y=matched_output(match), nodes=tuple(match.nodes), k=k, n=n)
