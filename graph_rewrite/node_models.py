"""Nodes cut out of a model into a model of their own: the one way the package does it.

Three users: the load check opens each attention node a rewrite wrote alone, without weights, to let
the op library refuse its attributes in milliseconds (:mod:`.load_check`); head placement times the
LM head alone with its real weights (``ortsparse.calibration.head_placement``); tune's layer speed
times a class of layers alone with theirs (``ortsparse.tuning.layer_speed``).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import onnx
from onnx import helper


def nodes_alone(nodes: Sequence[onnx.NodeProto], constants: Mapping[str, onnx.TensorProto],
                opsets: Iterable[onnx.OperatorSetIdProto], *, ir_version: int,
                input_shapes: Mapping[str, Sequence[int]] | None = None,
                input_types: Mapping[str, int] | None = None, name: str = "nodes_alone") -> onnx.ModelProto:
    """A model of copies of ``nodes``: an input found in ``constants`` travels with them as an
    initializer; every other input becomes a graph input (once per name; shape from
    ``input_shapes``, else unknown; element type from ``input_types``, else float); every output a
    float graph output of unknown shape. The opsets are those of ``opsets`` the nodes' domains use."""
    input_shapes, input_types = input_shapes or {}, input_types or {}
    copies, inputs, outputs, initializers, seen = [], [], [], [], set()
    for node in nodes:
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copies.append(copy)
        for value in copy.input:
            if not value or value in seen:
                continue
            seen.add(value)
            if value in constants:
                initializers.append(constants[value])
            else:
                inputs.append(helper.make_tensor_value_info(value, input_types.get(value, onnx.TensorProto.FLOAT),
                                                            input_shapes.get(value)))
        outputs.extend(helper.make_tensor_value_info(value, onnx.TensorProto.FLOAT, None)
                       for value in copy.output if value)
    domains = {node.domain for node in copies} | {""}
    graph = helper.make_graph(copies, name, inputs, outputs, initializers)
    used = [o for o in opsets if o.domain in domains or (o.domain == "ai.onnx" and "" in domains)]
    model = helper.make_model(graph, opset_imports=used)
    model.ir_version = ir_version
    return model


def layers_alone(model: onnx.ModelProto, names: Sequence[str],
                 input_shapes: Mapping[str, Sequence[int]] | None = None) -> onnx.ModelProto:
    """The linear-layer nodes ``names`` of ``model`` with their weights, each reading its data input
    (its first) as a graph input. ValueError naming the node and input when a node is not in the
    model or reads anything but a constant initializer beyond its first input (a computed weight
    would need the rest of the graph)."""
    nodes = {node.name: node for node in model.graph.node}
    constants = {tensor.name: tensor for tensor in model.graph.initializer}
    picked = []
    for name in names:
        node = nodes.get(name)
        if node is None:
            raise ValueError(f"no node {name!r} in the model")
        for value in node.input[1:]:
            if value and value not in constants:
                raise ValueError(f"{name}: input {value!r} is not a constant initializer")
        picked.append(node)
    return nodes_alone(picked, constants, model.opset_import, ir_version=model.ir_version,
                       input_shapes=input_shapes, name="layers_alone")
