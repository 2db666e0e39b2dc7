"""What every attention rule shares: reading a core of its form into normalised operands
(Q/K/V as [B, H, S, D] plus pending transposes, scale, masks, GQA) and emitting PopcountAttention.

A rule is stateless: ``takes`` says whether a core's anchor node has the rule's form,
``analyze`` reads the core once (during the survey, graph_rewrite/attention.py) into a
:class:`Core` or a ``MatchResult().fail(reason, value)`` near-miss, and ``emit`` builds the
replacement from that Core (graph_rewrite/replace.py).
"""
from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import ClassVar

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import MatchResult

from ..graph_utils import dims_of, is_onnx_op
from ..rules import DOMAIN, DOMAIN_VERSION
from ..techniques.popcount import OP_TYPE, AttentionSettings

IDENTITY4 = (0, 1, 2, 3)
SWAP_LAST2 = (0, 1, 3, 2)


@dataclasses.dataclass
class Operand:
    """A Q/K/V operand: ``value`` becomes [B, H, S, D] after ``perm`` (None: as is)."""

    value: ir.Value
    perm: tuple[int, ...] | None = None


@dataclasses.dataclass
class Mask:
    """``add``: float tensor added to the scaled scores; ``bool``: True = key takes part;
    ``where``: scores replaced by ``fill`` where ``value`` (bool) is False."""

    kind: str
    value: ir.Value
    fill: float = 0.0


@dataclasses.dataclass
class Core:
    """A matched attention core, normalised to the op's operands."""

    q: Operand
    k: Operand
    v: Operand
    scale: float  # 0.0 = 1/sqrt(D), as the op's attribute
    is_causal: int = 0
    masks: list[Mask] = dataclasses.field(default_factory=list)
    gqa_rep: int | None = None  # heads per KV head when an Expand repeat was undone (None: unknown or 1)
    gqa_undone: bool = False
    nodes: list[ir.Node] = dataclasses.field(default_factory=list)  # nodes the op replaces (dead afterwards)
    name_hint: str = ""
    notes: list[str] = dataclasses.field(default_factory=list)

    def resolved(self, current: Callable[[ir.Value], ir.Value]) -> Core:
        """This core with every operand value mapped through ``current`` (values the graph edits
        made before this core's turn replaced; see replace.GraphEditor)."""
        def operand(o: Operand) -> Operand:
            return dataclasses.replace(o, value=current(o.value))

        return dataclasses.replace(self, q=operand(self.q), k=operand(self.k), v=operand(self.v),
                                   masks=[dataclasses.replace(m, value=current(m.value)) for m in self.masks])

    def describe(self) -> str:
        parts = [f"scale={'1/sqrt(D)' if self.scale == 0.0 else f'{self.scale:g}'}"]
        if self.masks:
            parts.append("mask=" + "+".join(m.kind for m in self.masks))
        if self.is_causal:
            parts.append("is_causal=1")
        if self.gqa_undone:
            parts.append("GQA un-expanded" + (f" (x{self.gqa_rep})" if self.gqa_rep else ""))
        for name, operand in (("Q", self.q), ("K", self.k), ("V", self.v)):
            if operand.perm is not None:
                parts.append(f"{name} transposed {list(operand.perm)}")
        return ", ".join(parts)


# -- reading constants --------------------------------------------------------------------------

def constant_array(value: ir.Value | None) -> np.ndarray | None:
    """The value of an initializer or Constant node output (None when computed at run time)."""
    if value is None:
        return None
    if value.const_value is not None:
        try:
            return value.const_value.numpy()
        except Exception:  # noqa: BLE001 - external data not loaded: not usable as a constant here
            return None
    producer = value.producer()
    if is_onnx_op(producer, "Constant"):
        for name in ("value", "value_float", "value_floats", "value_int", "value_ints"):
            attribute = producer.attributes.get(name)
            if attribute is None:
                continue
            data = attribute.value
            if hasattr(data, "numpy"):
                return data.numpy()
            return np.asarray(data)
    return None


def scalar_constant(value: ir.Value | None) -> float | None:
    array = constant_array(value)
    if array is None or array.size != 1 or array.dtype.kind not in "fiu":
        return None
    return float(array.reshape(()))


_ELEMENTWISE = frozenset({"Add", "Sub", "Mul", "Div", "Where", "Neg", "Cast", "Identity", "Softmax", "Sqrt",
                          "Tanh", "Sigmoid", "Relu", "Erf", "Pow", "Dropout", "Split", "Slice", "IsNaN", "Not",
                          "And", "Or", "Equal", "Less", "Greater", "Expand", "Max", "Min", "Clip"})


def rank_of(value: ir.Value | None, depth: int = 12) -> int | None:
    """Rank from the value's shape, else inferred through common ops (TorchScript exports carry no
    shapes; a 3-D ``bmm`` attention must not be taken for the 4-D form)."""
    dims = dims_of(value)
    if dims is not None:
        return len(dims)
    producer = value.producer() if value is not None else None
    if producer is None or depth == 0 or producer.domain not in ("", "ai.onnx"):
        return None
    op = producer.op_type
    if op == "Transpose":
        perm = producer.attributes.get_ints("perm", ())
        return len(perm) if perm else rank_of(producer.inputs[0], depth - 1)
    if op == "Reshape":
        shape = dims_of(producer.inputs[1])
        return shape[0] if shape is not None and len(shape) == 1 and isinstance(shape[0], int) else None
    if op in ("Unsqueeze", "Squeeze"):
        base = rank_of(producer.inputs[0], depth - 1)
        axes = constant_array(producer.inputs[1]) if len(producer.inputs) > 1 and producer.inputs[1] is not None \
            else np.asarray(producer.attributes.get_ints("axes", ()))
        if base is None or axes is None:
            return None
        return base + axes.size if op == "Unsqueeze" else base - axes.size
    if op in ("MatMul", "Concat") or op in _ELEMENTWISE:
        inputs = producer.inputs[:2] if op in ("MatMul",) else producer.inputs
        if op in ("Expand", "Slice", "Split", "Cast", "Softmax", "Dropout", "Clip"):
            inputs = producer.inputs[:1]
        ranks = [rank_of(v, depth - 1) for v in inputs if v is not None]
        if op == "Expand":
            shape = dims_of(producer.inputs[1])
            if shape is not None and len(shape) == 1 and isinstance(shape[0], int):
                ranks.append(shape[0])
        known = [r for r in ranks if r is not None]
        return max(known) if known and (len(known) == len(ranks) or op == "Concat") else None
    return None


def check_float(value: ir.Value, what: str) -> MatchResult:
    result = MatchResult()
    if value.dtype is not None and value.dtype != ir.DataType.FLOAT:
        return result.fail(f"{what} '{value.name}' has dtype {value.dtype.name}; PopcountAttention takes float32", value)
    return result


def check_rank4(value: ir.Value, what: str) -> MatchResult:
    result = MatchResult()
    rank = rank_of(value)
    if rank is not None and rank != 4:
        return result.fail(f"{what} '{value.name}' has rank {rank}; expected [B, H, S, D]", value)
    return result


def same_length(a: ir.Value, b: ir.Value, axis: int) -> bool:
    """Whether dim ``axis`` of a and b is provably equal (same value, same int or same named dim)."""
    if a is b:
        return True
    da, db = dims_of(a), dims_of(b)
    if da is None or db is None or len(da) <= axis or len(db) <= axis:
        return False
    x, y = da[axis], db[axis]
    return x == y and x not in ("?", None)


def compose(inner: Sequence[int], outer: Sequence[int]) -> tuple[int, ...]:
    """Transpose(Transpose(x, inner), outer) == Transpose(x, compose(inner, outer))."""
    return tuple(inner[i] for i in outer)


# -- K^T, GQA repeat, masks -------------------------------------------------------------------

def strip_scalar_scale(value: ir.Value, nodes: list[ir.Node]) -> tuple[ir.Value, float]:
    """Walk back through ``Mul(x, c)``, ``Mul(c, x)`` and ``Div(x, c)`` with scalar constants c."""
    factor = 1.0
    while True:
        producer = value.producer()
        if is_onnx_op(producer, "Mul"):
            a, b = producer.inputs[0], producer.inputs[1]
            ca, cb = scalar_constant(a), scalar_constant(b)
            if cb is not None and ca is None:
                factor, value = factor * cb, a
            elif ca is not None and cb is None:
                factor, value = factor * ca, b
            else:
                return value, factor
        elif is_onnx_op(producer, "Div") and scalar_constant(producer.inputs[1]) is not None \
                and scalar_constant(producer.inputs[0]) is None:
            factor, value = factor / scalar_constant(producer.inputs[1]), producer.inputs[0]
        else:
            return value, factor
        nodes.append(producer)


def _reshape_transpose_reshape(value: ir.Value) -> ir.Value | None:
    """``Reshape(Transpose(Reshape(x, [B*H, S, D]), [0, 2, 1]), [B, H, D, S])`` (the dynamo
    decomposition of SDPA's K^T): returns x when x has rank 4 and the chain has that structure."""
    outer = value.producer()
    if not is_onnx_op(outer, "Reshape"):
        return None
    transpose = outer.inputs[0].producer()
    if not is_onnx_op(transpose, "Transpose") or tuple(transpose.attributes.get_ints("perm", ())) != (0, 2, 1):
        return None
    inner = transpose.inputs[0].producer()
    if not is_onnx_op(inner, "Reshape"):
        return None
    x = inner.inputs[0]
    if rank_of(x) != 4 or rank_of(transpose.inputs[0]) not in (None, 3):
        return None
    shape = dims_of(outer.inputs[1])
    if shape is None or shape != (4,):
        return None
    return x


def resolve_key(k_t: ir.Value, nodes: list[ir.Node]) -> tuple[MatchResult, Operand, float]:
    """From the score MatMul's second operand K^T [B, H, D, Skv] to K [B, H, Skv, D]: follows
    scalar scales and transposes (perm composition), and the Reshape-Transpose-Reshape form."""
    factor = 1.0
    perm = IDENTITY4  # k_t == Transpose(base, perm)
    base = k_t
    for _ in range(8):
        base, f = strip_scalar_scale(base, nodes)
        factor *= f
        producer = base.producer()
        if is_onnx_op(producer, "Transpose"):
            inner = tuple(producer.attributes.get_ints("perm", ()))
            if len(inner) != 4:
                break
            perm = compose(inner, perm)
            nodes.append(producer)
            base = producer.inputs[0]
            continue
        x = _reshape_transpose_reshape(base)
        if x is not None:
            outer = base.producer()
            transpose = outer.inputs[0].producer()
            nodes.extend([outer, transpose, transpose.inputs[0].producer()])
            perm = compose(SWAP_LAST2, perm)
            base = x
            continue
        break
    if perm == IDENTITY4 and base is k_t and rank_of(k_t) is None:
        return MatchResult().fail(f"K^T '{k_t.name}' is no Transpose of K and its rank is unknown", k_t), \
            Operand(k_t), factor
    key_perm = compose(perm, SWAP_LAST2)
    rank = rank_of(base)
    if rank is not None and rank != 4:
        what = "K^T" if base is k_t else "K"
        return MatchResult().fail(f"{what} '{base.name}' has rank {rank}; only 4-D [B, H, S, D] attention is "
                                  "rewritten", base), Operand(base), factor
    return MatchResult(), Operand(base, None if key_perm == IDENTITY4 else key_perm), factor


def undo_repeat_kv(value: ir.Value) -> tuple[ir.Value, int | None, list[ir.Node]] | None:
    """``Reshape(Expand(Unsqueeze(kv, axes=[2]), [B, Hkv, rep, S, D]), [B, Hkv*rep, S, D])``
    (transformers' repeat_kv as exported): returns (kv, rep or None when not static, nodes)."""
    reshape = value.producer()
    if not is_onnx_op(reshape, "Reshape"):
        return None
    expand = reshape.inputs[0].producer()
    if not is_onnx_op(expand, "Expand"):
        return None
    unsqueeze = expand.inputs[0].producer()
    if not is_onnx_op(unsqueeze, "Unsqueeze"):
        return None
    if len(unsqueeze.inputs) > 1 and unsqueeze.inputs[1] is not None:
        axes = constant_array(unsqueeze.inputs[1])
        axes = None if axes is None else tuple(int(a) for a in axes.reshape(-1))
    else:
        axes = tuple(unsqueeze.attributes.get_ints("axes", ()))
    kv = unsqueeze.inputs[0]
    if axes not in ((2,), (-3,)) or rank_of(kv) not in (None, 4):
        return None
    if rank_of(value) not in (None, 4):
        return None
    rep = None
    expanded, source = dims_of(expand.outputs[0]), dims_of(kv)
    if expanded is not None and len(expanded) == 5:
        if expanded[2] == 1 or not isinstance(expanded[2], int):
            rep = None if not isinstance(expanded[2], int) else 1
        else:
            rep = expanded[2]
        if source is not None and isinstance(source[1], int) and isinstance(expanded[1], int) and source[1] != expanded[1]:
            return None
    shape = constant_array(expand.inputs[1])
    if shape is not None and shape.size == 5 and int(shape[2]) > 1:
        rep = int(shape[2])
    target = constant_array(reshape.inputs[1])
    if target is not None and target.size != 4:
        return None
    return kv, rep, [reshape, expand, unsqueeze]


def mask_dtype_ok(mask: ir.Value, kind: str) -> MatchResult:
    result = MatchResult()
    dtype = mask.dtype
    if kind == "bool" or kind == "where":
        if dtype is not None and dtype != ir.DataType.BOOL:
            return result.fail(f"mask '{mask.name}' has dtype {dtype.name}; expected bool", mask)
    elif dtype is not None and dtype != ir.DataType.FLOAT:
        return result.fail(f"additive mask '{mask.name}' has dtype {dtype.name}; expected float32", mask)
    rank = rank_of(mask)
    if rank is not None and rank > 4:
        return result.fail(f"mask '{mask.name}' has rank {rank}; it must broadcast to [B, H, Sq, Skv]", mask)
    return result


# -- emission -----------------------------------------------------------------------------------

def emit_operand(op, operand: Operand) -> ir.Value:
    if operand.perm is None:
        return operand.value
    return op.Transpose(operand.value, perm=list(operand.perm))


def emit_mask(op, masks: Sequence[Mask]) -> ir.Value | None:
    """One attn_mask input: a lone bool mask is passed as is; otherwise every mask becomes an
    additive float tensor (where-masks as Where(cond, 0, fill)) and they are summed."""
    if not masks:
        return None
    if len(masks) == 1 and masks[0].kind == "bool":
        return masks[0].value
    total = None
    for mask in masks:
        if mask.kind == "add":
            term = mask.value
        else:
            fill = mask.fill if mask.kind == "where" else -math.inf
            term = op.Where(mask.value, op.Constant(value_float=0.0), op.Constant(value_float=float(fill)))
        total = term if total is None else op.Add(total, term)
    return total


def emit_attention(op, core: Core, settings: AttentionSettings, name: str | None) -> ir.Value:
    q, k, v = emit_operand(op, core.q), emit_operand(op, core.k), emit_operand(op, core.v)
    mask = emit_mask(op, core.masks)
    inputs = [q, k, v] + ([mask] if mask is not None else [])
    return op.op(OP_TYPE, *inputs, _domain=DOMAIN, _version=DOMAIN_VERSION, _name=name,
                 scale=float(core.scale), is_causal=int(core.is_causal), **settings.attributes())


class AttentionRule(abc.ABC):
    """Base of the rules that turn one attention core (of one form) into PopcountAttention."""

    rule_name: ClassVar[str]
    before_after: ClassVar[str]
    new_op: ClassVar[str] = OP_TYPE  # the ai.ortsparse op the rule emits

    @abc.abstractmethod
    def takes(self, anchor: ir.Node) -> bool:
        """Whether ``anchor`` (a fused attention op, or an eager core's context MatMul) has this
        rule's form; only then is :meth:`analyze` asked."""

    @abc.abstractmethod
    def analyze(self, anchor: ir.Node, opset: int) -> tuple[MatchResult, Core | None]:
        """Whether the core at ``anchor`` can become PopcountAttention (the reason when not), and
        its operands. ``opset``: the model's default-domain opset."""

    def emit(self, op, core: Core, anchor: ir.Node, settings: AttentionSettings, name: str | None,
             opset: int) -> ir.Value:
        """The replacement of ``anchor``'s output (or of its first outputs, when a list), built with
        ``op`` (a node builder)."""
        return emit_attention(op, core, settings, name)
