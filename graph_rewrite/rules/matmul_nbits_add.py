"""com.microsoft.MatMulNBits followed by a bias Add: one quantized linear layer with its bias.

Before -> After::

    Y = Add(MatMulNBits(A, B, scales[, zero_points], K, N, bits, block_size), b)    (or Add(b, ...))
        b: constant float32 [N], [1, N], [1, 1, N], [1] or a scalar; MatMulNBits has no bias input
    ->
    Y = ai.ortsparse.<op>(A, B, scales, zero_points?, b', K, N, bits, block_size, <settings>)

What the weight may be, and the numerics, are those of ``matmul_nbits``. A MatMulNBits with its
own bias input keeps the Add (near-miss; ``matmul_nbits`` then takes the node with its own bias).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import onnx_ir as ir
from onnxscript.rewriter import MatchResult

from ..graph_utils import MS_DOMAIN
from ._base import LinearOperands, LinearRule, check_bias, output_rank
from .matmul_nbits import _BIAS, check_nbits_layer, nbits_operands, optional_input


class MatMulNBitsAddRule(LinearRule):
    rule_name = "matmul_nbits_add"
    before_after = "Add(MatMulNBits(A, B, scales, zp?), b) -> <op>(A, B, scales, zp?, b, K, N, bits, block_size)"

    def pattern(self, op, x, bias):
        return op.Add(op.MatMulNBits(x, _allow_other_inputs=True, _domain=MS_DOMAIN, _outputs=["linear_out"]), bias)

    def pattern_bias_first(self, op, x, bias):
        return op.Add(bias, op.MatMulNBits(x, _allow_other_inputs=True, _domain=MS_DOMAIN, _outputs=["linear_out"]))

    def commuted(self) -> Sequence[Callable[..., Any]]:
        return (self.pattern_bias_first,)

    def check(self, context, linear_out: ir.Value, x: ir.Value, bias: ir.Value, **_: Any) -> MatchResult:
        linear = linear_out.producer()
        result = check_nbits_layer(linear, x)
        if not result:
            return result
        if optional_input(linear, _BIAS) is not None:
            return MatchResult().fail(f"MatMulNBits '{linear.name}' has its own bias input; the Add after it stays",
                                      linear)
        return check_bias(bias, linear.attributes.get_int("N", 0), output_rank(x))

    def operands(self, match: MatchResult) -> LinearOperands:
        return nbits_operands(match, match.bindings["bias"])
