"""A MatMul with a transposed constant weight (a tied lm_head) becomes a KwtaBlockMatMul.

Before -> After::

    Y = MatMul(X, Transpose(E, perm=[1, 0]))      E: constant float32 [N, K] (e.g. the embedding)
    ->
    Y = ai.ortsparse.KwtaBlockMatMul(X, E^T, <settings>)

E^T is one new [K, N] initializer per E; E itself stays when something else (the embedding
Gather) still uses it.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import onnx_ir as ir
from onnxscript.rewriter import MatchResult

from ._base import LinearRule, Operands, check_activation, weight_dims


class MatMulTransposedWeightToKwta(LinearRule):
    rule_name = "matmul_transposed_weight"
    before_after = "MatMul(X, Transpose(E)) -> KwtaBlockMatMul(X, E^T)"

    def pattern(self, op, x, w):
        return op.MatMul(x, op.Transpose(w, _outputs=["transposed"]), _outputs=["linear_out"])

    def check_structure(self, linear: ir.Node, x: ir.Value, w: ir.Value, transposed: ir.Value,
                        **_: Any) -> MatchResult:
        perm = transposed.producer().attributes.get_ints("perm", None)
        if perm is not None and list(perm) != [1, 0]:
            return MatchResult().fail(f"Transpose perm={list(perm)} is not a 2-D transpose", transposed)
        result, _, _ = weight_dims(w, transposed=True)
        return result if not result else check_activation(x)

    def operands(self, linear: ir.Node, bindings: Mapping[str, Any]) -> Operands:
        return Operands(x=bindings["x"], weight=bindings["w"], weight_is_transposed=True, bias=None)
