"""The replacement step: from the survey's records (operands of each layer, each attention core's
normalised operands) to edited graph nodes, with onnx_ir's graph editing. No pattern is matched
here.

- :class:`GraphEditor` replaces nodes and remembers which value took the place of which, so the
  operands the survey found before any edit stay valid (a layer's input may be another layer's
  output, an attention core's Q a projection's).
- :class:`WeightPreparer` makes the initializers the ops take ([K, N] copies of transposed weights,
  [N] biases, quantized weights, a technique's own tensors) and drops the originals nothing uses
  anymore; a quantized weight of the input (MatMulNBits) is passed through as it is.
- :func:`emit_linear` / :func:`emit_attention` build the new nodes.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnx_ir as ir

from .attention import AttentionCore
from .graph_utils import ValueNames
from .rules import DOMAIN, DOMAIN_VERSION, FloatWeight, LayerWeight, LinearOperands, NBitsWeight
from .techniques import BIAS, WEIGHT, OpBuild
from .techniques.popcount import AttentionSettings

RULE_KEY = "ortsparse.rule"  # metadata_props key of a new node: the rule that matched what it replaces


class NodeBuilder:
    """Collects new nodes: ``op.Transpose(x, perm=[...])``, ``op.op(type, *inputs, _domain=...,
    _version=..., _outputs=n, _name=..., **attributes)`` return the output value(s)."""

    def __init__(self) -> None:
        self.nodes: list[ir.Node] = []

    def __getattr__(self, op_type: str) -> Callable[..., Any]:
        return lambda *inputs, **kwargs: self.op(op_type, *inputs, **kwargs)

    def op(self, op_type: str, *inputs: ir.Value | None, _domain: str = "", _version: int | None = None,
           _outputs: int = 1, _name: str | None = None, **attributes: Any) -> ir.Value | Sequence[ir.Value]:
        node = ir.Node(_domain, op_type, inputs, attributes=ir.convenience.convert_attributes(attributes),
                       num_outputs=_outputs, version=_version, name=_name)
        self.nodes.append(node)
        return node.outputs[0] if _outputs == 1 else node.outputs


class GraphEditor:
    """Edits one model's main graph."""

    def __init__(self, model: ir.Model) -> None:
        self.model = model
        self.graph = model.graph
        self._forward: dict[int, ir.Value] = {}
        self._node_names: set[str] | None = None  # taken names, read when first needed

    def current(self, value: ir.Value) -> ir.Value:
        """The value now standing for ``value`` (itself unless a replacement took its place)."""
        while id(value) in self._forward:
            value = self._forward[id(value)]
        return value

    def alive(self, nodes: Sequence[ir.Node]) -> bool:
        """Whether every node is still in the graph (no earlier replacement consumed it)."""
        return all(node.graph is self.graph for node in nodes)

    def new_node_name(self, wanted: str) -> str:
        """A node name no node of the graph has yet (``wanted``, ``wanted_1``...)."""
        if self._node_names is None:
            self._node_names = {node.name for node in self.graph if node.name}
        name, suffix = wanted, 0
        while name in self._node_names:
            suffix += 1
            name = f"{wanted}_{suffix}"
        self._node_names.add(name)
        return name

    def replace(self, old_nodes: Sequence[ir.Node], new_nodes: Sequence[ir.Node],
                old_output: ir.Value | Sequence[ir.Value], new_output: ir.Value | Sequence[ir.Value], rule: str) -> None:
        """Put ``new_nodes`` after ``old_output``'s producer, make ``new_output`` take
        ``old_output``'s place (name, type, shape, every use, graph output), remove ``old_nodes``
        (several outputs: pairwise, in order). The new nodes carry the replaced nodes' metadata
        (first value wins) and the rule's name."""
        old_outputs = list(old_output) if isinstance(old_output, Sequence) else [old_output]
        new_outputs = list(new_output) if isinstance(new_output, Sequence) else [new_output]
        merged: dict[str, str] = {RULE_KEY: rule}
        for node in old_nodes:
            for key, value in node.metadata_props.items():
                if value and not merged.get(key):
                    merged[key] = value
        for node in new_nodes:
            node.metadata_props.update(merged)
        ir.convenience.replace_nodes_and_values(self.graph, old_outputs[0].producer(), old_nodes, new_nodes,
                                                old_outputs, new_outputs)
        for old, new in zip(old_outputs, new_outputs):
            self._forward[id(old)] = new

    def remove_dead(self, seeds: Sequence[ir.Node]) -> None:
        """Remove the seed nodes and their producers once nothing uses their outputs (and the
        initializers only they read)."""
        graph = self.graph
        outputs = set(map(id, graph.outputs))
        work = list(seeds)
        while work:
            node = work.pop()
            if node.graph is not graph:
                continue
            if any(out.uses() or id(out) in outputs for out in node.outputs):
                continue
            inputs = [v for v in node.inputs if v is not None]
            graph.remove(node, safe=True)
            for value in inputs:
                if value.producer() is not None:
                    work.append(value.producer())
                elif value.is_initializer() and not value.uses() and not value.is_graph_input() \
                        and graph.initializers.get(value.name) is value:
                    del graph.initializers[value.name]


class WeightPreparer:
    """Makes (once per original initializer) the [K, N] weights and [N] biases the ops take, and
    afterwards drops originals nothing uses anymore, so the model never carries a weight twice."""

    def __init__(self, graph: ir.Graph) -> None:
        self._graph = graph
        self._names = ValueNames(graph)
        self._made: dict[int, ir.Value] = {}
        self._quantized: dict[tuple, NBitsWeight] = {}
        self._sources: list[ir.Value] = []
        self.added: list[str] = []
        self.removed: list[str] = []

    def _register(self, source: ir.Value, array: np.ndarray, suffix: str) -> ir.Value:
        name = self._names.new(f"{source.name}{suffix}")
        tensor = ir.tensor(np.ascontiguousarray(array, dtype=np.float32), name=name)
        value = ir.Value(name=name, shape=ir.Shape(array.shape), type=ir.TensorType(ir.DataType.FLOAT),
                         const_value=tensor)
        self._graph.register_initializer(value)
        self._made[id(source)] = value
        self._sources.append(source)
        self.added.append(name)
        return value

    def new_initializer(self, name_hint: str, array: np.ndarray) -> ir.Value:
        """A new initializer (a technique's own tensor, e.g. packed deltas or TT cores)."""
        name = self._names.new(name_hint)
        tensor = ir.tensor(np.ascontiguousarray(array), name=name)
        value = ir.Value(name=name, shape=ir.Shape(array.shape), type=ir.TensorType(tensor.dtype),
                         const_value=tensor)
        self._graph.register_initializer(value)
        self.added.append(name)
        return value

    def replaced_values(self, values: Sequence[ir.Value]) -> None:
        """Initializers a later edit may leave unused (e.g. weights fused into one)."""
        self._sources.extend(values)

    def replaced(self, operands: LinearOperands) -> None:
        """The layer's original weight/bias may become unused (a technique stored its own form)."""
        self._sources.extend(operands.weight.sources)
        if operands.bias is not None:
            self._sources.append(operands.bias)

    def weight(self, weight: LayerWeight) -> list[ir.Value | None]:
        """The op inputs ``WEIGHT`` stands for. A float32 weight: itself, or one shared [K, N]
        copy of a transposed one. A quantized weight: B, scales, zero points (None when absent:
        an omitted input), the initializers it was read from, untouched."""
        if isinstance(weight, NBitsWeight):
            return [weight.b, weight.scales, weight.zero_points]
        source = weight.value
        if not weight.transposed:
            return [source]
        if id(source) not in self._made:
            self._register(source, source.const_value.numpy().T, "_T")
        return [self._made[id(source)]]

    def quantized(self, weight: FloatWeight, settings) -> NBitsWeight:
        """The quantized form of a float weight (``settings``: techniques.quant.QuantSettings),
        made once per original initializer and quantization, named as onnxruntime's quantizer
        names them (``<W>_Q8``, ``<W>_scales``, ``<W>_zero_points``); the original is dropped when
        nothing else reads it."""
        key = (id(weight.value), weight.transposed, settings.bits, settings.block_size, settings.symmetric)
        if key not in self._quantized:
            matrix = weight.matrix()
            k, n = matrix.shape
            b, scales, zero_points = settings.quantize(matrix)
            stem = weight.value.name + ("_T" if weight.transposed else "")
            made = [self.new_initializer(f"{stem}_{suffix}", array) if array is not None else None
                    for suffix, array in ((f"Q{settings.bits}", b), ("scales", scales), ("zero_points", zero_points))]
            self._quantized[key] = NBitsWeight(*made, k=k, n=n, bits=settings.bits, block_size=settings.block_size,
                                               accuracy_level=int(settings.accuracy_level))
            self._sources.append(weight.value)
        return self._quantized[key]

    def bias(self, operands: LinearOperands) -> ir.Value | None:
        source = operands.bias
        if source is None or tuple(source.const_value.shape) == (operands.n,):
            return source
        if id(source) not in self._made:
            flat = source.const_value.numpy().reshape(-1)
            self._register(source, np.broadcast_to(flat, (operands.n,)), "_vec")
        return self._made[id(source)]

    def drop_unused(self) -> None:
        graph_io = set(map(id, self._graph.inputs)) | set(map(id, self._graph.outputs))
        candidates = self._sources + list(self._made.values())
        for value in candidates:
            if (value.name in self._graph.initializers and self._graph.initializers[value.name] is value
                    and not value.uses() and id(value) not in graph_io):
                del self._graph.initializers[value.name]
                if value.name in self.added:
                    self.added.remove(value.name)
                else:
                    self.removed.append(value.name)


def emit_linear(editor: GraphEditor, preparer: WeightPreparer, name: str, rule: str, operands: LinearOperands,
                built: OpBuild) -> None:
    """Replace one layer's matched nodes by ``built``'s node: ``op_type(X, *inputs)`` (the weight
    quantized first when the build asks for it)."""
    weight = operands.weight
    if built.quantize is not None:
        weight = preparer.quantized(weight, built.quantize)
    inputs: list[ir.Value | None] = [editor.current(operands.x)]
    for position, entry in enumerate(built.inputs):
        if isinstance(entry, str) and entry == WEIGHT:
            inputs.extend(preparer.weight(weight))
        elif isinstance(entry, str) and entry == BIAS:
            inputs.append(preparer.bias(operands))
        elif entry is None:
            inputs.append(None)
        else:
            inputs.append(preparer.new_initializer(f"{name or 'layer'}_{built.op_type}_{position}", entry))
    if WEIGHT not in [e for e in built.inputs if isinstance(e, str)]:
        preparer.replaced(operands)
    while inputs and inputs[-1] is None:  # trailing optional inputs are simply left out
        inputs.pop()
    op = NodeBuilder()
    version = DOMAIN_VERSION if built.domain == DOMAIN else 1
    output = op.op(built.op_type, *inputs, _domain=built.domain, _version=version, _name=name or None,
                   **built.attributes)
    editor.model.opset_imports.setdefault(built.domain, version)
    editor.replace(operands.nodes, op.nodes, operands.y, output, rule)
    op.nodes[-1].metadata_props.update(built.metadata)


def emit_attention(editor: GraphEditor, core: AttentionCore, settings: AttentionSettings, opset: int) -> str:
    """Replace one attention core by the rule's op (and the layout ops its form needs); returns
    the new node's name. The core's other nodes go once nothing else reads them."""
    anchor = core.anchor
    operands = core.operands.resolved(editor.current)
    hint = operands.name_hint or anchor.name or ""
    prefix = hint.rsplit("/", 1)[0] if "/" in hint else hint
    new_op = core.rule.new_op
    name = editor.new_node_name(f"{prefix}/{new_op}" if prefix else new_op)
    op = NodeBuilder()
    output = core.rule.emit(op, operands, anchor, settings, name, opset)
    replaced = anchor.outputs[:len(output)] if isinstance(output, Sequence) else anchor.outputs[0]
    editor.replace([anchor], op.nodes, replaced, output, core.rule.rule_name)
    editor.remove_dead(operands.nodes[1:])
    return name
