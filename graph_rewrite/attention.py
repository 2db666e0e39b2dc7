"""The attention recogniser: every attention core of a graph, found once and used twice — by the
layer classification (which linear layers feed a core's q/k/v, which read its output) and by the
rewrite (each core analysed by the rule of its form, graph_rewrite/attention_rules/).

A core is ``MatMul(q, k) -> [scale / mask] -> Softmax -> MatMul(p, v)`` ("eager") or one of the
fused attention ops of ONNX and onnxruntime (``FUSED_ATTENTION``).
"""
from __future__ import annotations

import dataclasses
import math

import onnx_ir as ir

from .attention_rules import RULES, AttentionRule, Core
from .graph_utils import MS_DOMAIN, data_inputs, data_uses, is_constant_like, is_onnx_op, op_name, walk
from .rules import DOMAIN
from .techniques.popcount import GQA_OP_TYPE, OP_TYPE

# Between the score MatMul and the Softmax: scaling, masks, soft-capping, layout.
_SCORE_OPS = frozenset({"Add", "Sub", "Mul", "Div", "Where", "Cast", "Reshape", "Slice", "Identity",
                        "Tanh", "Clip", "Max", "Min", "Squeeze", "Unsqueeze", "Transpose"})
# Between the Softmax and the context MatMul.
_PROB_OPS = frozenset({"Cast", "Dropout", "Identity", "Reshape", "Where", "Slice", "Mul", "Transpose"})

# Fused attention ops: op name -> which input index is q, k and v (empty: the op projects its own
# input, so no linear layer of the graph feeds it as q/k/v).
FUSED_ATTENTION: dict[str, dict[int, str]] = {
    "Attention": {0: "q", 1: "k", 2: "v"},  # ONNX opset 23
    f"{MS_DOMAIN}.MultiHeadAttention": {0: "q", 1: "k", 2: "v"},
    f"{MS_DOMAIN}.GroupQueryAttention": {0: "q", 1: "k", 2: "v"},
    f"{MS_DOMAIN}.PackedMultiHeadAttention": {0: "q", 1: "k", 2: "v"},
    f"{MS_DOMAIN}.DecoderMaskedMultiHeadAttention": {0: "q", 1: "k", 2: "v"},
    f"{MS_DOMAIN}.SparseAttention": {0: "q", 1: "k", 2: "v"},
    f"{DOMAIN}.{OP_TYPE}": {0: "q", 1: "k", 2: "v"},  # a model rewritten before: a core, not a candidate
    f"{DOMAIN}.{GQA_OP_TYPE}": {0: "q", 1: "k", 2: "v"},
    f"{MS_DOMAIN}.Attention": {},
    f"{MS_DOMAIN}.PackedAttention": {},
    f"{MS_DOMAIN}.DecoderMaskedSelfAttention": {},
}
# Fused forms no rule takes yet: reported with this reason.
_NOT_YET = frozenset({
    f"{MS_DOMAIN}.PackedMultiHeadAttention", f"{MS_DOMAIN}.PackedAttention",
    f"{MS_DOMAIN}.DecoderMaskedMultiHeadAttention", f"{MS_DOMAIN}.DecoderMaskedSelfAttention",
    f"{MS_DOMAIN}.SparseAttention",
})
EAGER = "eager"


@dataclasses.dataclass
class AttentionCore:
    """One attention core: its form, the node a rule replaces (``anchor``: the fused op, or an
    eager core's context MatMul; None when the Softmax reaches no such MatMul), and what the rule
    of its form made of it (``operands``) or why none could (``near_misses``)."""

    form: str  # EAGER or the fused op's name
    anchor: ir.Node | None
    softmax: ir.Node | None = None
    rule: AttentionRule | None = None
    operands: Core | None = None
    near_misses: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (rule, why)

    @property
    def candidate(self) -> bool:
        """Whether a rewrite is asked about this core (a PopcountAttention already is one)."""
        return self.form not in (f"{DOMAIN}.{OP_TYPE}", f"{DOMAIN}.{GQA_OP_TYPE}")

    @property
    def anchor_name(self) -> str:
        node = self.anchor if self.anchor is not None else self.softmax
        return (node.name if node is not None else "") or ""


@dataclasses.dataclass
class AttentionCores:
    """Where attention happens in a graph: the cores, which node inputs take q, k, v, which values
    are attention outputs (context before the output projection), which MatMuls are a core's."""

    cores: list[AttentionCore] = dataclasses.field(default_factory=list)
    slots: dict[tuple[int, int], str] = dataclasses.field(default_factory=dict)  # (id(node), input) -> q|k|v
    outputs: set[int] = dataclasses.field(default_factory=set)  # id(value)
    core_nodes: set[int] = dataclasses.field(default_factory=set)  # id(node) of score/context MatMuls

    @property
    def count(self) -> int:
        return len(self.cores)

    @property
    def candidates(self) -> list[AttentionCore]:
        return [core for core in self.cores if core.candidate]

    def slot(self, node: ir.Node, input_index: int) -> str | None:
        return self.slots.get((id(node), input_index))

    def is_core_output(self, value: ir.Value) -> bool:
        return id(value) in self.outputs

    def is_core_node(self, node: ir.Node) -> bool:
        return id(node) in self.core_nodes


def _is_activation_matmul(node: ir.Node | None) -> bool:
    if not (is_onnx_op(node, "MatMul") or (node is not None and op_name(node) == f"{MS_DOMAIN}.FusedMatMul")):
        return False
    return all(not is_constant_like(v) for v in node.inputs[:2])


def _score_matmul(softmax: ir.Node) -> ir.Node | None:
    def step(value: ir.Value):
        producer = value.producer()
        if is_onnx_op(producer, *_SCORE_OPS):
            return [v for v in data_inputs(producer) if not is_constant_like(v)]
        return []

    for value in walk([softmax.inputs[0]], step, max_values=32):
        if _is_activation_matmul(value.producer()):
            return value.producer()
    return None


def _context_matmul(softmax: ir.Node) -> ir.Node | None:
    def step(value: ir.Value):
        return [out for node, _ in data_uses(value) if is_onnx_op(node, *_PROB_OPS) for out in node.outputs]

    for value in walk([softmax.outputs[0]], step, max_values=16):
        for node, index in data_uses(value):
            if index == 0 and _is_activation_matmul(node):
                return node
    return None


def default_opset(model: ir.Model) -> int:
    """The default-domain opset version the model imports."""
    return model.opset_imports.get("", model.opset_imports.get("ai.onnx", 17))


def _analyze(core: AttentionCore, opset: int) -> None:
    """Ask the rules of the core's form, in order; the first that takes it wins."""
    if core.anchor is None:
        core.near_misses.append(("-", f"no MatMul(P, V) found after Softmax '{core.anchor_name}'"))
        return
    if core.form in _NOT_YET:
        core.near_misses.append(("-", f"{core.form} is not rewritten yet"))
    for rule in RULES:
        if not rule.takes(core.anchor):
            continue
        result, operands = rule.analyze(core.anchor, opset)
        if result and not (math.isfinite(operands.scale) and operands.scale >= 0):
            # onnxruntime runs a negative scale; PopcountAttention refuses it (a node written with it
            # would not load), so the core stays as it is.
            core.near_misses.append((rule.rule_name, f"scale={operands.scale:g}: the op takes a finite scale >= 0"))
            continue
        if result:
            core.rule, core.operands = rule, operands
            return
        if result.reason:
            core.near_misses.append((rule.rule_name, result.reason))


def recognise_attention(model: ir.Model) -> AttentionCores:
    """Every attention core of the main graph in graph order, each analysed by its form's rule."""
    cores = AttentionCores()
    for node in model.graph:
        fused = FUSED_ATTENTION.get(op_name(node))
        if fused is not None:
            cores.cores.append(AttentionCore(form=op_name(node), anchor=node))
            cores.outputs.add(id(node.outputs[0]))
            for index, slot in fused.items():
                cores.slots[(id(node), index)] = slot
            continue
        if not is_onnx_op(node, "Softmax"):
            continue
        score = _score_matmul(node)
        if score is None:
            continue
        cores.core_nodes.add(id(score))
        cores.slots[(id(score), 0)] = "q"
        cores.slots[(id(score), 1)] = "k"
        context = _context_matmul(node)
        if context is not None:
            cores.core_nodes.add(id(context))
            cores.slots[(id(context), 1)] = "v"
            cores.outputs.add(id(context.outputs[0]))
        cores.cores.append(AttentionCore(form=EAGER, anchor=context, softmax=node))
    opset = default_opset(model)
    for core in cores.candidates:
        _analyze(core, opset)
    return cores

