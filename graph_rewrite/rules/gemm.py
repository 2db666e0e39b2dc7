"""Gemm with a constant weight (and optional bias C): one linear layer.

Before -> After::

    Y = Gemm(X, W[, C], transB=0|1)       alpha = 1, beta = 1 (when C is given), transA = 0
        W: constant float32 [K, N] (transB=0) or [N, K] (transB=1); C: constant, broadcastable to [N]
    ->
    Y = ai.ortsparse.<op>(X, W', C', <settings>)       <op>: the chosen technique's (KwtaBlockMatMul...)

W' = W for transB=0, else one transposed [K, N] copy per original initializer (shared by every
layer that used it; the original is dropped when nothing else uses it). GPT-2's Conv1D,
``Reshape -> Gemm -> Reshape``, matches too: X is 2-D there.
"""
from __future__ import annotations

from typing import Any

import onnx_ir as ir
from onnxscript.rewriter import MatchResult

from ._base import FloatWeight, LinearOperands, LinearRule, check_activation, check_bias, matched_output, weight_dims


def _gemm_bias(linear: ir.Node) -> ir.Value | None:
    return linear.inputs[2] if len(linear.inputs) > 2 else None


class GemmRule(LinearRule):
    rule_name = "gemm"
    before_after = "Gemm(X, W, C, transB=0|1) -> <op>(X, W or W^T, C)"

    def pattern(self, op, x, w):
        return op.Gemm(x, w, _allow_other_inputs=True, _outputs=["linear_out"])

    def check(self, context, linear_out: ir.Value, x: ir.Value, w: ir.Value, **_: Any) -> MatchResult:
        linear = linear_out.producer()
        attributes = linear.attributes
        trans_a = attributes.get_int("transA", 0)
        trans_b = attributes.get_int("transB", 0)
        alpha = attributes.get_float("alpha", 1.0)
        beta = attributes.get_float("beta", 1.0)
        bias = _gemm_bias(linear)
        if trans_a:
            return MatchResult().fail("Gemm transA=1: X is transposed, not a linear layer over rows", linear)
        if alpha != 1.0:
            return MatchResult().fail(f"Gemm alpha={alpha:g}; only alpha=1 maps to the op", linear)
        if bias is not None and beta != 1.0:
            return MatchResult().fail(f"Gemm beta={beta:g} with a bias C; only beta=1 maps to the op", linear)
        result, _, n = weight_dims(w, transposed=bool(trans_b))
        if not result:
            return result
        result = check_activation(x)
        if not result or bias is None:
            return result
        return check_bias(bias, n, output_rank=2, what="Gemm bias C")

    def operands(self, match: MatchResult) -> LinearOperands:
        linear = match.bindings["linear_out"].producer()
        transposed = bool(linear.attributes.get_int("transB", 0))
        w = match.bindings["w"]
        _, k, n = weight_dims(w, transposed)
        return LinearOperands(x=match.bindings["x"], weight=FloatWeight(w, transposed), bias=_gemm_bias(linear),
                              y=matched_output(match), nodes=tuple(match.nodes), k=k, n=n)
