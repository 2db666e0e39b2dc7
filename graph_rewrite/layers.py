"""Survey a graph: every candidate linear layer, its class, and which rule can replace it (or why
none can). Nothing is modified here."""
from __future__ import annotations

import dataclasses
from typing import Any

import onnx_ir as ir
from onnxscript.rewriter import MatchingTracer, MatchStatus

from .attention import AttentionCores, find_attention_cores
from .classify import LayerClass, classify_layers
from .graph_utils import dims_of, is_onnx_op, op_name, single_consumer
from .rules import LinearRule, Operands, make_rules


@dataclasses.dataclass
class LinearLayer:
    """One candidate linear layer of the input graph (``index`` = position in topological order)."""

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
    rule: str | None = None  # the rule that can replace it, None if no rule can
    operands: Operands | None = None
    near_misses: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (rule, why)

    @property
    def blocker(self) -> str:
        """Why no rule applies (the most specific rule's reason first)."""
        if self.near_misses:
            return self.near_misses[0][1]
        return "no rule pattern matches this layer"


class _LastResult(MatchingTracer):
    """Keeps the outcome of the single match attempt it is handed (reason included)."""

    def __init__(self) -> None:
        super().__init__()
        self.status: MatchStatus | None = None
        self.result = None

    def log(self, rule, container, node, match_result, status) -> None:
        self.status, self.result = status, match_result


def _weight_input(node: ir.Node) -> ir.Value | None:
    weight = node.inputs[1] if len(node.inputs) > 1 else None
    producer = weight.producer() if weight is not None else None
    if is_onnx_op(producer, "Transpose", "Cast", "Identity"):
        weight = producer.inputs[0]
    return weight


def _looks_like_linear(node: ir.Node, cores: AttentionCores) -> bool:
    """MatMul/Gemm whose second operand is a weight (constant, fed from outside, or 2-D), not the
    activation x activation products of attention or rotary tables."""
    if is_onnx_op(node, "Gemm"):
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
    transposed = is_onnx_op(node, "Gemm") and node.attributes.get_int("transB", 0) == 1
    producer = weight.producer()
    if is_onnx_op(producer, "Transpose"):
        weight, transposed = producer.inputs[0], not transposed
    dims = dims_of(weight)
    if dims is None or len(dims) != 2:
        return None, None, weight.name or ""
    k, n = (dims[1], dims[0]) if transposed else dims
    return (k if isinstance(k, int) else None), (n if isinstance(n, int) else None), weight.name or ""


def _anchors(node: ir.Node) -> list[ir.Node]:
    # A pattern is rooted at its last node: the layer itself, or its bias Add.
    consumer = single_consumer(node.outputs[0])
    return [node] + ([consumer] if consumer is not None else [])


def _near_miss_reason(tracer: _LastResult) -> str | None:
    """The check's reason when the pattern's shape matched; structural mismatches (a MatMul is
    not a Gemm) are not near-misses, except a match blocked by outside uses of its inner values."""
    if tracer.result is None or not tracer.result.reason:
        return None
    if tracer.status in (MatchStatus.CONDITION_FAILED, MatchStatus.REPLACEMENT_FAILED):
        return tracer.result.reason
    if tracer.status == MatchStatus.NO_MATCH and "other uses" in tracer.result.reason:
        return "an inner value of the pattern is also used elsewhere, so its nodes cannot be replaced"
    return None


def _survey_rules(model: ir.Model, layer: LinearLayer, rules: list[tuple[type[LinearRule], Any]]) -> None:
    graph = model.graph
    for rule_class, rule in rules:
        for anchor in _anchors(layer.node):
            tracer = _LastResult()
            match = rule.match(model, graph, anchor, tracer=tracer)
            if match and layer.node in match.nodes:
                layer.rule = rule_class.rule_name
                layer.operands = rule_class().operands(layer.node, match.bindings)
                return
            reason = _near_miss_reason(tracer)
            if reason and layer.node in tracer.result.nodes and (rule_class.rule_name, reason) not in layer.near_misses:
                layer.near_misses.append((rule_class.rule_name, reason))


@dataclasses.dataclass
class Survey:
    layers: list[LinearLayer]
    attention_cores: int


def survey(model: ir.Model) -> Survey:
    """Candidate linear layers of the main graph in topological order, classified and matched."""
    graph = model.graph
    cores = find_attention_cores(graph)
    linears = [node for node in graph if _looks_like_linear(node, cores)]
    classes: dict[int, LayerClass] = classify_layers(linears, cores)
    rules = make_rules(plan=None)
    layers = []
    for index, node in enumerate(linears):
        k, n, weight_name = _weight_shape(node)
        layer_class = classes[id(node)]
        layer = LinearLayer(index=index, node=node, name=node.name or "", op_type=op_name(node),
                            layer_class=layer_class.layer_class, role=layer_class.role,
                            class_reason=layer_class.why, k=k, n=n, weight_name=weight_name)
        _survey_rules(model, layer, rules)
        layers.append(layer)
    return Survey(layers, cores.count)
