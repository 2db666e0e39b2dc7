"""A MatMul with a constant weight followed by a bias Add becomes one KwtaBlockMatMul with B.

Before -> After::

    Y = Add(MatMul(X, W), b)     (or Add(b, MatMul(X, W)))
        W: constant float32 [K, N]; b: constant float32 [N], [1, N], [1, 1, N], [1] or a scalar
    ->
    Y = ai.ortsparse.KwtaBlockMatMul(X, W, b', <settings>)      b' = b as [N]

b is used as is when it already has shape [N]; otherwise one [N] copy is made per original bias.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import onnx_ir as ir
from onnxscript.rewriter import MatchResult

from ._base import LinearRule, Operands, check_activation, check_bias, output_rank, weight_dims


class MatMulAddToKwta(LinearRule):
    rule_name = "matmul_add"
    before_after = "Add(MatMul(X, W), b) -> KwtaBlockMatMul(X, W, b)"

    def pattern(self, op, x, w, bias):
        return op.Add(op.MatMul(x, w, _outputs=["linear_out"]), bias)

    def check_structure(self, linear: ir.Node, x: ir.Value, w: ir.Value, bias: ir.Value, **_: Any) -> MatchResult:
        result, _, n = weight_dims(w, transposed=False)
        if not result:
            return result
        result = check_activation(x)
        if not result:
            return result
        return check_bias(bias, n, output_rank(x))

    def operands(self, linear: ir.Node, bindings: Mapping[str, Any]) -> Operands:
        return Operands(x=bindings["x"], weight=bindings["w"], weight_is_transposed=False, bias=bindings["bias"])
