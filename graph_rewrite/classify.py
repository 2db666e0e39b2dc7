"""Classify linear layers from graph structure (never from names).

- ``attn``: q/k/v projections (output reaches an attention core's q/k/v input through layout,
  rotary and scaling ops; ``qkv`` when one projection feeds several, or feeds a fused core's packed
  query input), and the output projection (input comes from an attention core's output
  through Transpose/Reshape).
- ``head``: the output reaches a graph output only through shape/cast ops (no norm, no residual).
- ``mlp``: ``down`` when the input comes from an activation (Gelu, Relu, Erf-gelu, Silu, the
  Sigmoid/Tanh pieces of decomposed activations, FastGelu...); ``up`` for the layers that feed
  such an activation.
- ``other``: anything else (e.g. a pooler ``Tanh(Linear(x))`` that feeds no further linear layer).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import onnx_ir as ir

from .attention import AttentionCores
from .graph_utils import MS_DOMAIN, data_inputs, data_uses, is_constant_like, is_op, unit_output, walk

# Between a q/k/v projection and the attention core: head split, rotary, scaling, KV-cache concat,
# repeat-kv. Normalisations (ReduceMean, LayerNormalization...) and linear layers stop the walk.
_QKV_PLUMBING = frozenset({
    "Reshape", "Transpose", "Split", "Slice", "Gather", "Squeeze", "Unsqueeze", "Concat", "Add", "Sub",
    "Mul", "Div", "Neg", "Cast", "Identity", "Expand", "Tile", "Where", "RotaryEmbedding",
    f"{MS_DOMAIN}.RotaryEmbedding",
})
# Between an attention core's output and the output projection: merging heads.
_OUT_PLUMBING = frozenset({"Reshape", "Transpose", "Cast", "Identity", "Squeeze", "Unsqueeze",
                           "Flatten", "Concat"})
# Between the head and a graph output.
_HEAD_PASSTHROUGH = frozenset({"Reshape", "Cast", "Identity", "Squeeze", "Unsqueeze", "Transpose",
                               "Flatten"})
# A down projection's input must have gone through one of these since the previous linear layers.
_NONLINEAR = frozenset({
    "Gelu", "Relu", "Sigmoid", "HardSigmoid", "HardSwish", "Swish", "Erf", "Tanh", "Softplus", "Elu",
    "Selu", "Celu", "LeakyRelu", "Mish", "PRelu", "ThresholdedRelu",
    f"{MS_DOMAIN}.FastGelu", f"{MS_DOMAIN}.BiasGelu", f"{MS_DOMAIN}.Gelu", f"{MS_DOMAIN}.QuickGelu",
    f"{MS_DOMAIN}.BiasSplitGelu",
})
# The elementwise pieces decomposed activations and gates are made of.
_ACTIVATION_REGION = _NONLINEAR | frozenset({
    "Mul", "Add", "Sub", "Div", "Pow", "Sqrt", "Neg", "Cast", "Reshape", "Transpose", "Identity",
    "Squeeze", "Unsqueeze", "Split", "Slice", "Dropout", "Clip",
})

_MAX_WALK = 256


@dataclasses.dataclass(frozen=True)
class LayerClass:
    layer_class: str  # mlp | attn | head | other
    role: str  # up | down | q | k | v | qkv | out | head | other
    why: str


def _slot(cores: AttentionCores, node: ir.Node, index: int) -> str | None:
    """The core input ``node.inputs[index]`` is (q, k or v); ``qkv`` for the query input of a fused
    core whose key and value inputs are absent: it takes q, k and v packed in one tensor
    (GroupQueryAttention and MultiHeadAttention fed by one fused projection, as in
    onnxruntime-genai graphs)."""
    slot = cores.slot(node, index)
    if slot == "q" and cores.slot(node, 1) == "k" and cores.slot(node, 2) == "v":
        if all(i >= len(node.inputs) or node.inputs[i] is None for i in (1, 2)):
            return "qkv"
    return slot


def _attention_slots(linear: ir.Node, linears: set[int], cores: AttentionCores) -> set[str]:
    slots: set[str] = set()

    def step(value: ir.Value):
        nexts = []
        for node, index in data_uses(value):
            slot = _slot(cores, node, index)
            if slot is not None:
                slots.add(slot)
            elif id(node) not in linears and is_op(node, _QKV_PLUMBING):
                nexts.extend(node.outputs)
        return nexts

    for _ in walk([linear.outputs[0]], step, _MAX_WALK):
        pass
    return slots


def _reads_attention_output(linear: ir.Node, cores: AttentionCores) -> bool:
    def step(value: ir.Value):
        producer = value.producer()
        if is_op(producer, _OUT_PLUMBING):
            return [v for v in data_inputs(producer) if not is_constant_like(v)]
        return []

    return any(cores.is_core_output(v) for v in walk([linear.inputs[0]], step, 32))


def _reaches_graph_output_directly(linear: ir.Node) -> bool:
    def step(value: ir.Value):
        return [out for node, _ in data_uses(value) if is_op(node, _HEAD_PASSTHROUGH) for out in node.outputs]

    return any(v.is_graph_output() for v in walk([unit_output(linear)], step, 32))


def _activation_inputs(linear: ir.Node, linear_outputs: dict[int, ir.Node]) -> tuple[bool, list[ir.Node]]:
    """Walk back from the layer's input through activation pieces. Returns whether a nonlinearity
    was crossed and which linear layers were reached (the up/gate projections)."""
    crossed = False
    reached: list[ir.Node] = []

    def step(value: ir.Value):
        nonlocal crossed
        upstream = linear_outputs.get(id(value))
        if upstream is not None:
            reached.append(upstream)
            return []
        producer = value.producer()
        if not is_op(producer, _ACTIVATION_REGION):
            return []
        if is_op(producer, _NONLINEAR):
            crossed = True
        return [v for v in data_inputs(producer) if not is_constant_like(v)]

    for _ in walk([linear.inputs[0]], step, _MAX_WALK):
        pass
    return crossed, reached


def classify_layers(linears: Sequence[ir.Node], cores: AttentionCores) -> dict[int, LayerClass]:
    """Class of each linear layer, keyed by ``id(node)``."""
    ids = {id(n) for n in linears}
    # A walk back from an input stops where a linear layer's result (after its own bias) appears.
    linear_outputs: dict[int, ir.Node] = {}
    for node in linears:
        linear_outputs[id(node.outputs[0])] = node
        linear_outputs[id(unit_output(node))] = node

    result: dict[int, LayerClass] = {}
    up_projections: dict[int, ir.Node] = {}
    for node in linears:
        slots = _attention_slots(node, ids, cores)
        if slots:
            role = slots.pop() if len(slots) == 1 else "qkv"
            result[id(node)] = LayerClass("attn", role, "output feeds attention core input " + role)
        elif _reads_attention_output(node, cores):
            result[id(node)] = LayerClass("attn", "out", "input comes from an attention core output")
        elif _reaches_graph_output_directly(node):
            result[id(node)] = LayerClass("head", "head", "output reaches a graph output through shape/cast ops only")
        else:
            crossed, reached = _activation_inputs(node, linear_outputs)
            if crossed:
                result[id(node)] = LayerClass("mlp", "down", "input comes from an activation")
                for upstream in reached:
                    up_projections[id(upstream)] = upstream
    for key in up_projections:
        if key not in result:
            result[key] = LayerClass("mlp", "up", "output feeds an activation that feeds a down projection")
    for node in linears:
        if id(node) not in result:
            result[id(node)] = LayerClass("other", "other", "not attention, not head, no activation around it")
    return result
