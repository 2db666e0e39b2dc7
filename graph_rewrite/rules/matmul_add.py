"""MatMul with a constant weight followed by a bias Add: one linear layer with its bias.

Before -> After::

    Y = Add(MatMul(X, W), b)     (or Add(b, MatMul(X, W)))
        W: constant float32 [K, N]; b: constant float32 [N], [1, N], [1, 1, N], [1] or a scalar
    ->
    Y = ai.ortsparse.<op>(X, W, b', <settings>)      b' = b as [N]; <op>: the chosen technique's

b is used as is when it already has shape [N]; otherwise one [N] copy is made per original bias.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import onnx_ir as ir
from onnxscript.rewriter import MatchResult

from ._base import (
    FloatWeight,
    LinearOperands,
    LinearRule,
    check_activation,
    check_bias,
    matched_output,
    output_rank,
    weight_dims,
)


class MatMulAddRule(LinearRule):
    rule_name = "matmul_add"
    before_after = "Add(MatMul(X, W), b) -> <op>(X, W, b)"

    def pattern(self, op, x, w, bias):
        return op.Add(op.MatMul(x, w, _outputs=["linear_out"]), bias)

    def pattern_bias_first(self, op, x, w, bias):
        return op.Add(bias, op.MatMul(x, w, _outputs=["linear_out"]))

    def commuted(self) -> Sequence[Callable[..., Any]]:
        return (self.pattern_bias_first,)

    def check(self, context, linear_out: ir.Value, x: ir.Value, w: ir.Value, bias: ir.Value,
              **_: Any) -> MatchResult:
        result, _, n = weight_dims(w, transposed=False)
        if not result:
            return result
        result = check_activation(x)
        if not result:
            return result
        return check_bias(bias, n, output_rank(x))

    def operands(self, match: MatchResult) -> LinearOperands:
        w = match.bindings["w"]
        _, k, n = weight_dims(w, transposed=False)
        return LinearOperands(x=match.bindings["x"], weight=FloatWeight(w), bias=match.bindings["bias"],
                              y=matched_output(match), nodes=tuple(match.nodes), k=k, n=n)
