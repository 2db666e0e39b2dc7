"""Find attention cores: ``MatMul(q, k) -> [scale / mask] -> Softmax -> MatMul(p, v)`` and the fused
attention ops of ONNX and onnxruntime. Linear layers are classified relative to them."""
from __future__ import annotations

import dataclasses

import onnx_ir as ir

from .graph_utils import MS_DOMAIN, data_inputs, data_uses, is_constant_like, is_onnx_op, op_name, walk

# Between the score MatMul and the Softmax: scaling, masks, soft-capping, layout.
_SCORE_OPS = frozenset({"Add", "Sub", "Mul", "Div", "Where", "Cast", "Reshape", "Slice", "Identity",
                        "Tanh", "Clip", "Max", "Min", "Squeeze", "Unsqueeze", "Transpose"})
# Between the Softmax and the context MatMul.
_PROB_OPS = frozenset({"Cast", "Dropout", "Identity", "Reshape", "Where", "Slice", "Mul", "Transpose"})

# Fused attention ops: op name -> which input index is q, k and v (None: the op projects its own
# input, so no linear layer of the graph feeds it as q/k/v).
FUSED_ATTENTION = {
    "Attention": {0: "q", 1: "k", 2: "v"},  # ONNX opset 23
    f"{MS_DOMAIN}.MultiHeadAttention": {0: "q", 1: "k", 2: "v"},
    f"{MS_DOMAIN}.GroupQueryAttention": {0: "q", 1: "k", 2: "v"},
    f"{MS_DOMAIN}.PackedMultiHeadAttention": {0: "q", 1: "k", 2: "v"},
    f"{MS_DOMAIN}.DecoderMaskedMultiHeadAttention": {0: "q", 1: "k", 2: "v"},
    f"{MS_DOMAIN}.SparseAttention": {0: "q", 1: "k", 2: "v"},
    "ai.ortsparse.PopcountAttention": {0: "q", 1: "k", 2: "v"},  # a model rewritten before
    f"{MS_DOMAIN}.Attention": {},
    f"{MS_DOMAIN}.PackedAttention": {},
    f"{MS_DOMAIN}.DecoderMaskedSelfAttention": {},
}


@dataclasses.dataclass
class AttentionCores:
    """Where attention happens in a graph: which node inputs take q, k, v and which values are
    attention outputs (context before the output projection)."""

    slots: dict[tuple[int, int], str] = dataclasses.field(default_factory=dict)  # (id(node), input) -> q|k|v
    outputs: set[int] = dataclasses.field(default_factory=set)  # id(value)
    core_nodes: set[int] = dataclasses.field(default_factory=set)  # id(node) of score/context MatMuls
    count: int = 0

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


def find_attention_cores(graph: ir.Graph) -> AttentionCores:
    cores = AttentionCores()
    for node in graph:
        fused = FUSED_ATTENTION.get(op_name(node))
        if fused is not None:
            cores.count += 1
            cores.outputs.add(id(node.outputs[0]))
            for index, slot in fused.items():
                cores.slots[(id(node), index)] = slot
            continue
        if not is_onnx_op(node, "Softmax"):
            continue
        score = _score_matmul(node)
        if score is None:
            continue
        cores.count += 1
        cores.core_nodes.add(id(score))
        cores.slots[(id(score), 0)] = "q"
        cores.slots[(id(score), 1)] = "k"
        context = _context_matmul(node)
        if context is not None:
            cores.core_nodes.add(id(context))
            cores.slots[(id(context), 1)] = "v"
            cores.outputs.add(id(context.outputs[0]))
    return cores
