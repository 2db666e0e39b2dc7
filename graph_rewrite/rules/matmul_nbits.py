"""com.microsoft.MatMulNBits (a block-quantized int4/int8 weight, as onnxruntime-genai and
onnxruntime's ``matmul_nbits_quantizer`` write it): one linear layer, its bias input included.

Before -> After::

    Y = com.microsoft.MatMulNBits(A, B, scales[, zero_points][, g_idx][, bias],
                                  K, N, bits, block_size[, accuracy_level])
        B: constant uint8 [N, ceil(K/block_size), block_size·bits/8]; scales: constant float32
        [N, blocks] or [N·blocks]; zero_points: constant uint8 (packed as MatMulNBits packs them);
        bias: constant float32 broadcastable to [N]
    ->
    Y = ai.ortsparse.<op>(A, B, scales, zero_points?, bias?, K, N, bits, block_size[, accuracy_level],
                          <settings>)

B, scales and zero points are passed through untouched (an initializer shared with another node,
e.g. int4 genai's lm_head weight that the embedding's GatherBlockQuantized also reads, stays
shared). Only an op that gates the quantized form as stored takes such a layer (KWTA and the
bitmap gate: ``KwtaBlockMatMul``); techniques whose ops need float weights leave it as it is.

``accuracy_level`` is carried over (when not 0): the op computes as MatMulNBits at that level
does. At 4 every row rounds its activations to int8 per K-block (over the row's kept inputs) and
sums exactly in int32; at 0-3 a row decoded alone (fewer than 4 dense rows, or any gated row) is an
fp32 product of the dequantized weights, and a call with >= 4 dense rows takes the int8 path.

Near-misses (the layer stays as it is, the report says why): ``g_idx`` present (act-order: the K
rows are permuted into blocks, which the op's layout cannot express), bits other than 4 or 8,
block_size not a power of two in [16, 128], float zero points, B / scales / zero points that are
not constant initializers or whose shapes disagree with K, N, bits and block_size, float16 scales
or activations.
"""
from __future__ import annotations

from typing import Any

import onnx_ir as ir
from onnxscript.rewriter import MatchResult

from ..graph_utils import MS_DOMAIN, constant_tensor, why_not_constant
from ._base import (
    LinearOperands,
    LinearRule,
    NBitsWeight,
    check_activation,
    check_bias,
    matched_output,
    output_rank,
)

OP_TYPE = "MatMulNBits"
BITS = (4, 8)
BLOCK_SIZES = (16, 32, 64, 128)
ACCURACY_LEVELS = (0, 1, 2, 3, 4)
_ZERO_POINTS, _G_IDX, _BIAS = 3, 4, 5  # MatMulNBits' optional inputs


def optional_input(node: ir.Node, index: int) -> ir.Value | None:
    return node.inputs[index] if len(node.inputs) > index else None


def _shape(tensor: ir.TensorProtocol) -> list[int]:
    return [int(d) for d in tensor.shape]


def _matrix_or_flat(shape: list[int], rows: int, cols: int) -> bool:
    return shape == [rows, cols] or shape == [rows * cols]


def _constant(value: ir.Value, what: str, dtype: ir.DataType, node: ir.Node) -> tuple[MatchResult, Any]:
    result = MatchResult()
    tensor = constant_tensor(value)
    if tensor is None:
        return result.fail(why_not_constant(value, what), value), None
    if tensor.dtype != dtype:
        return result.fail(f"MatMulNBits '{node.name}': {what} '{value.name}' has dtype {tensor.dtype.name}, "
                           f"not {dtype.name}", value), None
    return result, tensor


def nbits_weight(node: ir.Node) -> tuple[MatchResult, NBitsWeight | None]:
    """The quantized weight of a MatMulNBits node, or why the ortsparse ops cannot take it."""
    result = MatchResult()
    attributes = node.attributes
    k, n = attributes.get_int("K", 0), attributes.get_int("N", 0)
    bits, block = attributes.get_int("bits", 4), attributes.get_int("block_size", 0)
    label = f"MatMulNBits '{node.name}'"
    if k < 1 or n < 1:
        return result.fail(f"{label} has K={k}, N={n}; both must be positive", node), None
    if bits not in BITS:
        return result.fail(f"{label} has bits={bits}; the ortsparse ops take 4 or 8 bits", node), None
    if block not in BLOCK_SIZES:
        return result.fail(f"{label} has block_size={block}; the ortsparse ops take "
                           f"{', '.join(map(str, BLOCK_SIZES))}", node), None
    if optional_input(node, _G_IDX) is not None:
        return result.fail(f"{label} has a g_idx input (act-order: K rows permuted into blocks); the ortsparse ops "
                           "take block-ordered weights only", node), None
    if len(node.inputs) < 3 or node.inputs[1] is None or node.inputs[2] is None:
        return result.fail(f"{label} lacks its B or scales input", node), None
    blocks = -(-k // block)
    found, b = _constant(node.inputs[1], "weight B", ir.DataType.UINT8, node)
    if not found:
        return found, None
    if _shape(b) != [n, blocks, block * bits // 8]:
        return result.fail(f"{label}: B '{node.inputs[1].name}' has shape {_shape(b)}; K={k}, N={n}, bits={bits}, "
                           f"block_size={block} need {[n, blocks, block * bits // 8]}", node), None
    found, scales = _constant(node.inputs[2], "scales", ir.DataType.FLOAT, node)
    if not found:
        return found, None
    if not _matrix_or_flat(_shape(scales), n, blocks):
        return result.fail(f"{label}: scales '{node.inputs[2].name}' has shape {_shape(scales)}; need {[n, blocks]} "
                           f"or {[n * blocks]}", node), None
    zero_points = optional_input(node, _ZERO_POINTS)
    if zero_points is not None:
        tensor = constant_tensor(zero_points)
        if tensor is not None and tensor.dtype != ir.DataType.UINT8:
            return result.fail(f"{label}: zero_points '{zero_points.name}' has dtype {tensor.dtype.name} (float zero "
                               "points); the ortsparse ops take uint8 zero points packed as MatMulNBits packs them",
                               node), None
        found, tensor = _constant(zero_points, "zero_points", ir.DataType.UINT8, node)
        if not found:
            return found, None
        packed = -(-blocks * bits // 8)
        if not _matrix_or_flat(_shape(tensor), n, packed):
            return result.fail(f"{label}: zero_points '{zero_points.name}' has shape {_shape(tensor)}; need "
                               f"{[n, packed]} or {[n * packed]}", node), None
    level = attributes.get_int("accuracy_level", 0)
    if level not in ACCURACY_LEVELS:
        return result.fail(f"{label} has accuracy_level={level}; MatMulNBits' levels are 0-4", node), None
    return result, NBitsWeight(node.inputs[1], node.inputs[2], zero_points, k, n, bits, block, level)


def check_nbits_layer(linear: ir.Node, x: ir.Value) -> MatchResult:
    """Everything but a folded Add's bias: the weight, the activation, MatMulNBits' own bias."""
    result, weight = nbits_weight(linear)
    if not result:
        return result
    result = check_activation(x)
    bias = optional_input(linear, _BIAS)
    if not result or bias is None:
        return result
    return check_bias(bias, weight.n, output_rank(x), what=f"MatMulNBits '{linear.name}' bias")


def nbits_operands(match: MatchResult, bias: ir.Value | None) -> LinearOperands:
    linear = match.bindings["linear_out"].producer()
    _, weight = nbits_weight(linear)
    return LinearOperands(x=match.bindings["x"], weight=weight, bias=bias, y=matched_output(match),
                          nodes=tuple(match.nodes), k=weight.k, n=weight.n)


class MatMulNBitsRule(LinearRule):
    rule_name = "matmul_nbits"
    before_after = "MatMulNBits(A, B, scales, zp?, bias?) -> <op>(A, B, scales, zp?, bias?, K, N, bits, block_size)"

    def pattern(self, op, x):
        return op.MatMulNBits(x, _allow_other_inputs=True, _domain=MS_DOMAIN, _outputs=["linear_out"])

    def check(self, context, linear_out: ir.Value, x: ir.Value, **_: Any) -> MatchResult:
        return check_nbits_layer(linear_out.producer(), x)

    def operands(self, match: MatchResult) -> LinearOperands:
        return nbits_operands(match, optional_input(match.bindings["linear_out"].producer(), _BIAS))
