"""Survey a graph, matching once: every candidate linear layer with its class and the operands the
first fitting rule found (or every rule's reason for not fitting), and every attention core as the
recogniser analysed it. Nothing is modified here; the replacement works from these records.
"""
from __future__ import annotations

import dataclasses

import onnx_ir as ir

from .attention import AttentionCores, recognise_attention
from .classify import LayerClass, classify_layers
from .graph_utils import MS_DOMAIN, dims_of, is_onnx_op, op_name, single_consumer
from .rules import RULES, LinearOperands

MATMUL_NBITS = f"{MS_DOMAIN}.MatMulNBits"  # a linear layer with a block-quantized weight


@dataclasses.dataclass
class LinearLayer:
    """One candidate linear layer of the input graph (``index`` = position in topological order)
    and, when a rule fits, its operands (``x``, weight, bias, ``y`` and the nodes to replace)."""

    index: int
    node: ir.Node
    name: str
    op_type: str
    layer_class: str
    role: str
    class_reason: str
    k: int | None
    n: int | None
    weight_name: str
    rule: str | None = None  # the rule that fits it, None if no rule does
    operands: LinearOperands | None = None
    near_misses: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (rule, why)

    @property
    def blocker(self) -> str:
        """Why no rule applies (the most specific rule's reason first)."""
        if self.near_misses:
            return self.near_misses[0][1]
        return "no rule pattern matches this layer"


def _weight_input(node: ir.Node) -> ir.Value | None:
    weight = node.inputs[1] if len(node.inputs) > 1 else None
    producer = weight.producer() if weight is not None else None
    if is_onnx_op(producer, "Transpose", "Cast", "Identity"):
        weight = producer.inputs[0]
    return weight


def _looks_like_linear(node: ir.Node, cores: AttentionCores) -> bool:
    """MatMul/Gemm whose second operand is a weight (constant, fed from outside, or 2-D), not the
    activation x activation products of attention or rotary tables; every MatMulNBits (its weight
    is quantized by definition)."""
    if is_onnx_op(node, "Gemm") or op_name(node) == MATMUL_NBITS:
        return True
    if not is_onnx_op(node, "MatMul") or cores.is_core_node(node):
        return False
    weight = _weight_input(node)
    if weight is None:
        return False
    dims = dims_of(weight)
    rank = None if dims is None else len(dims)
    if weight.is_initializer() or weight.is_graph_input() or weight.const_value is not None:
        return rank is None or rank <= 2 or weight.is_initializer()
    producer = weight.producer()
    if is_onnx_op(producer, "Constant", "DequantizeLinear"):
        return True
    return rank == 2


def _weight_shape(node: ir.Node) -> tuple[int | None, int | None, str]:
    """Best-effort (K, N, weight name) for the report, also for layers no rule can take."""
    weight = node.inputs[1] if len(node.inputs) > 1 else None
    if weight is None:
        return None, None, ""
    if op_name(node) == MATMUL_NBITS:  # B is [N, blocks, blob]: K and N are attributes
        k, n = node.attributes.get_int("K", 0), node.attributes.get_int("N", 0)
        return k or None, n or None, weight.name or ""
    transposed = is_onnx_op(node, "Gemm") and node.attributes.get_int("transB", 0) == 1
    producer = weight.producer()
    if is_onnx_op(producer, "Transpose"):
        weight, transposed = producer.inputs[0], not transposed
    dims = dims_of(weight)
    if dims is None or len(dims) != 2:
        return None, None, weight.name or ""
    k, n = (dims[1], dims[0]) if transposed else dims
    return (k if isinstance(k, int) else None), (n if isinstance(n, int) else None), weight.name or ""


def _match(model: ir.Model, layer: LinearLayer) -> None:
    """The first rule that fits ``layer`` (in priority order) gives its operands; the reasons of
    the rules tried before it are kept as near-misses."""
    # A pattern is rooted at its last node: the layer itself, or its bias Add.
    consumer = single_consumer(layer.node.outputs[0])
    anchors = [layer.node] + ([consumer] if consumer is not None else [])
    for rule in RULES:
        found = rule.try_layer(model, layer.node, anchors)
        if found.operands is not None:
            layer.rule, layer.operands = rule.rule_name, found.operands
            return
        layer.near_misses.extend((rule.rule_name, why) for why in found.near_misses)


@dataclasses.dataclass
class Survey:
    layers: list[LinearLayer]
    attention: AttentionCores

    @property
    def attention_cores(self) -> int:
        return self.attention.count


def survey(model: ir.Model) -> Survey:
    """Candidate linear layers of the main graph in topological order, classified and matched,
    and the attention cores."""
    graph = model.graph
    cores = recognise_attention(model)
    linears = [node for node in graph if _looks_like_linear(node, cores)]
    classes: dict[int, LayerClass] = classify_layers(linears, cores)
    layers = []
    for index, node in enumerate(linears):
        k, n, weight_name = _weight_shape(node)
        layer_class = classes[id(node)]
        layer = LinearLayer(index=index, node=node, name=node.name or "", op_type=op_name(node),
                            layer_class=layer_class.layer_class, role=layer_class.role,
                            class_reason=layer_class.why, k=k, n=n, weight_name=weight_name)
        _match(model, layer)
        layers.append(layer)
    return Survey(layers, cores)
