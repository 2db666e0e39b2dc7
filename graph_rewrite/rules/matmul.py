"""A MatMul with a constant weight becomes a KwtaBlockMatMul.

Before -> After::

    Y = MatMul(X, W)                      W: constant float32 initializer [K, N]
    ->
    Y = ai.ortsparse.KwtaBlockMatMul(X, W, <settings>)

W is used as is, so a weight shared by several layers stays one initializer.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import onnx_ir as ir
from onnxscript.rewriter import MatchResult

from ._base import LinearRule, Operands, check_activation, weight_dims


class MatMulToKwta(LinearRule):
    rule_name = "matmul"
    before_after = "MatMul(X, W) -> KwtaBlockMatMul(X, W)"

    def pattern(self, op, x, w):
        return op.MatMul(x, w, _outputs=["linear_out"])

    def check_structure(self, linear: ir.Node, x: ir.Value, w: ir.Value, **_: Any) -> MatchResult:
        result, _, _ = weight_dims(w, transposed=False)
        return result if not result else check_activation(x)

    def operands(self, linear: ir.Node, bindings: Mapping[str, Any]) -> Operands:
        return Operands(x=bindings["x"], weight=bindings["w"], weight_is_transposed=False, bias=None)
