"""What every linear-layer rule shares: the operands a match yields, weight/bias checks, matching.

A rule is a pattern (onnxscript pattern syntax) and a ``check`` that returns
``MatchResult().fail(reason, value)`` so near-misses explain themselves. A rule only *matches*:
the survey (graph_rewrite/layers.py) runs it once per layer and keeps the :class:`LinearOperands`
it yields; the replacement (graph_rewrite/replace.py) emits the chosen technique's node from those
operands. Nothing flows from ``check`` to anywhere else through ``self``.
"""
from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import MatchingTracer, MatchResult, MatchStatus
from onnxscript.rewriter.pattern import Pattern

from ..._library import DOMAIN  # noqa: F401 (re-exported: the one home of the domain is _library)
from ..graph_utils import constant_tensor, dims_of, why_not_constant

DOMAIN_VERSION = 1


FLOAT32 = "float32"  # the form of a float weight initializer
NBITS_FORMS = ("int4", "int8")  # MatMulNBits' block-quantized forms, by bits


@dataclasses.dataclass(frozen=True)
class FloatWeight:
    """A float32 weight initializer: [K, N], or [N, K] when ``transposed`` (Gemm transB=1, a
    ``Transpose(E)``; the op then takes one [K, N] copy).

    The weight *forms* a rule can yield: this one and :class:`NBitsWeight`, with the same
    ``form``, ``name``, ``sources``, ``attributes()`` and ``matrix()``."""

    value: ir.Value
    transposed: bool = False
    form: ClassVar[str] = FLOAT32

    @property
    def name(self) -> str:
        return self.value.name or ""

    @property
    def sources(self) -> tuple[ir.Value, ...]:
        """The initializers this weight is read from (dropped when nothing uses them afterwards)."""
        return (self.value,)

    def attributes(self) -> dict[str, int]:
        """Attributes an op needs to read this form (none: the tensor's shape says it all)."""
        return {}

    def matrix(self) -> np.ndarray:
        """W as a contiguous [K, N] float32 array."""
        array = self.value.const_value.numpy()
        return np.ascontiguousarray(array.T if self.transposed else array, dtype=np.float32)


@dataclasses.dataclass(frozen=True)
class NBitsWeight:
    """``com.microsoft.MatMulNBits``' block-quantized weight: ``b`` uint8 [N, ceil(K/block_size),
    block_size·bits/8] (4 bits: low nibble first), ``scales`` float32 [N, blocks] or flat,
    ``zero_points`` uint8 packed like MatMulNBits packs them, or None (8 at 4 bits, 128 at 8 bits).

    An op that gates this form takes ``sources`` (B, scales, zero points) through untouched, with
    ``attributes()`` (K, N, bits, block_size, and the source's accuracy_level when it is not 0, so the
    rewritten layer keeps MatMulNBits' numerics: 4 = int8 activations); ``matrix()`` dequantizes, for
    techniques that need numbers (never to replace the stored form)."""

    b: ir.Value
    scales: ir.Value
    zero_points: ir.Value | None
    k: int
    n: int
    bits: int
    block_size: int
    accuracy_level: int = 0

    @property
    def form(self) -> str:
        return f"int{self.bits}"

    @property
    def name(self) -> str:
        return self.b.name or ""

    @property
    def sources(self) -> tuple[ir.Value, ...]:
        return (self.b, self.scales) + ((self.zero_points,) if self.zero_points is not None else ())

    def attributes(self) -> dict[str, int]:
        level = {"accuracy_level": self.accuracy_level} if self.accuracy_level else {}
        return {"K": self.k, "N": self.n, "bits": self.bits, "block_size": self.block_size, **level}

    def matrix(self) -> np.ndarray:
        """W [K, N] float32 as MatMulNBits defines it: (q - zero_point) · scale per (column, K-block)."""
        zero_points = None if self.zero_points is None else self.zero_points.const_value.numpy()
        return dequantize_nbits(self.b.const_value.numpy(), self.scales.const_value.numpy(), zero_points,
                                self.k, self.n, self.bits, self.block_size)


def dequantize_nbits(b: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, k: int, n: int, bits: int,
                     block_size: int) -> np.ndarray:
    """W [K, N] float32 from MatMulNBits' tensors (the padding of a last partial block dropped)."""
    blocks = -(-k // block_size)
    packed = b.reshape(n, blocks, block_size * bits // 8)
    if bits == 4:
        q = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(n, blocks, block_size)
    else:
        q = packed
    if zero_points is None:
        z = np.full((n, blocks), 1 << (bits - 1), dtype=np.float32)
    elif bits == 4:
        z = np.stack([zero_points & 0x0F, zero_points >> 4], axis=-1).reshape(n, -1)[:, :blocks].astype(np.float32)
    else:
        z = zero_points.reshape(n, blocks).astype(np.float32)
    w = (q.astype(np.float32) - z[:, :, None]) * scales.reshape(n, blocks).astype(np.float32)[:, :, None]
    return np.ascontiguousarray(w.reshape(n, blocks * block_size)[:, :k].T)


LayerWeight = FloatWeight | NBitsWeight  # the union of weight forms


@dataclasses.dataclass(frozen=True)
class LinearOperands:
    """One matched linear layer: ``y = x @ W + bias`` over the last axis.

    ``x`` and ``y`` are values of the input graph (``y`` is what the op's output replaces: the
    layer's result after its folded bias), ``nodes`` the matched nodes the op replaces, ``bias``
    the original constant (any shape broadcastable to [N]) or None."""

    x: ir.Value
    weight: LayerWeight
    bias: ir.Value | None
    y: ir.Value
    nodes: tuple[ir.Node, ...]
    k: int
    n: int

    def bias_vector(self) -> np.ndarray | None:
        """The bias as a contiguous [N] float32 array (None without a bias)."""
        if self.bias is None:
            return None
        flat = self.bias.const_value.numpy().reshape(-1).astype(np.float32)
        return np.ascontiguousarray(np.broadcast_to(flat, (self.n,)))


def weight_dims(weight: ir.Value, transposed: bool) -> tuple[MatchResult, int, int]:
    """Check that ``weight`` is a constant 2-D float32 initializer; return (result, K, N)."""
    result = MatchResult()
    tensor = constant_tensor(weight)
    if tensor is None:
        return result.fail(why_not_constant(weight, "weight"), weight), 0, 0
    if tensor.dtype != ir.DataType.FLOAT:
        return result.fail(f"weight '{weight.name}' has dtype {tensor.dtype.name}; the ortsparse ops "
                           "take float32 weights", weight), 0, 0
    shape = tuple(int(d) for d in tensor.shape)
    if len(shape) != 2:
        return result.fail(f"weight '{weight.name}' has shape {list(shape)}; a linear layer needs a 2-D weight",
                           weight), 0, 0
    k, n = (shape[1], shape[0]) if transposed else shape
    if k == 0 or n == 0:
        return result.fail(f"weight '{weight.name}' is empty (shape {list(shape)})", weight), 0, 0
    return result, k, n


def check_activation(x: ir.Value) -> MatchResult:
    result = MatchResult()
    if x.dtype is not None and x.dtype != ir.DataType.FLOAT:
        return result.fail(f"input '{x.name}' has dtype {x.dtype.name}; the ortsparse ops take float32 activations", x)
    return result


def check_bias(bias: ir.Value, n: int, output_rank: int | None, what: str = "bias") -> MatchResult:
    """A bias is folded into the op only if it is a constant float32 initializer that broadcasts
    to ``[N]`` without changing the output's shape."""
    result = MatchResult()
    tensor = constant_tensor(bias)
    if tensor is None:
        return result.fail(why_not_constant(bias, what), bias)
    if tensor.dtype != ir.DataType.FLOAT:
        return result.fail(f"{what} '{bias.name}' has dtype {tensor.dtype.name}, not float32", bias)
    shape = tuple(int(d) for d in tensor.shape)
    if shape and (shape[-1] not in (n, 1) or any(d != 1 for d in shape[:-1])):
        return result.fail(f"{what} '{bias.name}' has shape {list(shape)}, not broadcastable to [{n}] "
                           "(a per-row bias is not a layer bias)", bias)
    if len(shape) > 1 and (output_rank is None or len(shape) > output_rank):
        # Add(y, b) with b of higher rank than y would raise y's rank; the op's output would not.
        return result.fail(f"{what} '{bias.name}' of shape {list(shape)} could broadcast the output to a "
                           "higher rank (input rank unknown or lower)", bias)
    return result


def output_rank(x: ir.Value) -> int | None:
    dims = dims_of(x)
    return None if dims is None else max(len(dims), 1)


@dataclasses.dataclass(frozen=True)
class RuleMatch:
    """The outcome of trying one rule on one layer: ``operands`` when it matched, else the
    check's reason when the pattern's shape fitted (a near-miss) or None (a different shape)."""

    operands: LinearOperands | None
    near_misses: tuple[str, ...] = ()


class _LastResult(MatchingTracer):
    """Keeps the outcome of the single match attempt it is handed (reason included)."""

    def __init__(self) -> None:
        super().__init__()
        self.status: MatchStatus | None = None
        self.result: MatchResult | None = None

    def log(self, rule, container, node, match_result, status) -> None:
        self.status, self.result = status, match_result


class LinearRule(abc.ABC):
    """Base of the linear-layer rules. Subclasses give ``pattern`` (naming the layer's MatMul or
    Gemm output ``linear_out``), ``check`` and ``operands``; ``commuted`` patterns are tried as
    well (an Add's inputs either way round)."""

    rule_name: ClassVar[str]
    before_after: ClassVar[str]

    def __init__(self) -> None:
        self._patterns = [Pattern(p, self.check, name=self.rule_name) for p in (self.pattern, *self.commuted())]

    @abc.abstractmethod
    def pattern(self, op, *args: Any) -> Any:
        """The onnxscript pattern this rule matches."""

    def commuted(self) -> Sequence[Callable[..., Any]]:
        """Further patterns for the same structure (inputs of commutative ops swapped)."""
        return ()

    @abc.abstractmethod
    def check(self, context, linear_out: ir.Value, **bindings: Any) -> MatchResult:
        """Whether the matched layer can become an op at all (constants, dtypes, attributes)."""

    @abc.abstractmethod
    def operands(self, match: MatchResult) -> LinearOperands:
        """The operands of a match that passed :meth:`check`."""

    def try_layer(self, model: ir.Model, layer: ir.Node, anchors: Sequence[ir.Node]) -> RuleMatch:
        """Match this rule on ``layer`` (the MatMul/Gemm node), rooted at each of ``anchors`` (the
        layer itself and its bias Add). Structural mismatches (a MatMul is not a Gemm) are no
        near-misses, except a match blocked by outside uses of its inner values."""
        near_misses: list[str] = []
        for pattern in self._patterns:
            for anchor in anchors:
                tracer = _LastResult()
                match = pattern.match(model, model.graph, anchor, tracer=tracer)
                if match and layer in match.nodes:
                    return RuleMatch(self.operands(match))
                reason = _near_miss(tracer)
                if reason and layer in tracer.result.nodes and reason not in near_misses:
                    near_misses.append(reason)
        return RuleMatch(None, tuple(near_misses))


def _near_miss(tracer: _LastResult) -> str | None:
    """The check's reason when the pattern's shape matched; structural mismatches (a MatMul is
    not a Gemm) are not near-misses, except a match blocked by outside uses of its inner values."""
    if tracer.result is None or not tracer.result.reason:
        return None
    if tracer.status in (MatchStatus.CONDITION_FAILED, MatchStatus.REPLACEMENT_FAILED):
        return tracer.result.reason
    if tracer.status == MatchStatus.NO_MATCH and "other uses" in tracer.result.reason:
        return "an inner value of the pattern is also used elsewhere, so its nodes cannot be replaced"
    return None


def matched_output(match: MatchResult) -> ir.Value:
    """The value a match computes (the pattern's single output)."""
    (output,) = match.outputs
    return output
