"""MatMul with a constant weight: one linear layer.

Before -> After::

    Y = MatMul(X, W)                      W: constant float32 initializer [K, N]
    ->
    Y = ai.ortsparse.<op>(X, W, <settings>)       <op>: the chosen technique's (KwtaBlockMatMul...)

W is used as is, so a weight shared by several layers stays one initializer.
"""
from __future__ import annotations

from typing import Any

import onnx_ir as ir
from onnxscript.rewriter import MatchResult

from ._base import FloatWeight, LinearOperands, LinearRule, check_activation, matched_output, weight_dims


class MatMulRule(LinearRule):
    rule_name = "matmul"
    before_after = "MatMul(X, W) -> <op>(X, W)"

    def pattern(self, op, x, w):
        return op.MatMul(x, w, _outputs=["linear_out"])

    def check(self, context, linear_out: ir.Value, x: ir.Value, w: ir.Value, **_: Any) -> MatchResult:
        result, _, _ = weight_dims(w, transposed=False)
        return result if not result else check_activation(x)

    def operands(self, match: MatchResult) -> LinearOperands:
        w = match.bindings["w"]
        _, k, n = weight_dims(w, transposed=False)
        return LinearOperands(x=match.bindings["x"], weight=FloatWeight(w), bias=None, y=matched_output(match),
                              nodes=tuple(match.nodes), k=k, n=n)
