"""One-node ONNX models of the ortsparse ops, for tests."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper


def kwta_model(w: np.ndarray, bias: np.ndarray | None = None, *, x_shape=("m", None),
               w_as_graph_input: bool = False, node_name: str = "kwta_node", **attrs):
    k = w.shape[0]
    x_dims = [k if d is None else d for d in x_shape]
    inputs = ["X", "W"] + (["B"] if bias is not None else [])
    node = helper.make_node("KwtaBlockMatMul", inputs, ["Y"], domain="ai.ortsparse", name=node_name, **attrs)
    graph_inputs = [helper.make_tensor_value_info("X", TensorProto.FLOAT, x_dims)]
    initializers = [numpy_helper.from_array(w, "W")]
    if w_as_graph_input:
        graph_inputs.append(helper.make_tensor_value_info("W", TensorProto.FLOAT, list(w.shape)))
    if bias is not None:
        initializers.append(numpy_helper.from_array(bias, "B"))
    graph = helper.make_graph([node], "kwta", graph_inputs,
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.ortsparse", 1)],
                             ir_version=9)


def proc_model(indices: np.ndarray, deltas: np.ndarray, bias: np.ndarray | None = None, *, k: int, block: int,
               x_shape=("m", None), node_name: str = "proc_node", constant: bool = True, **attrs):
    """ProcSparseMatMul(X, indices, deltas, B?) with the packed arrays as initializers."""
    n, fanout = indices.shape
    x_dims = [k if d is None else d for d in x_shape]
    inputs = ["X", "indices", "deltas"] + (["B"] if bias is not None else [])
    attrs = {"K": k, "N": n, "block": block, "fanout": fanout, **attrs}
    node = helper.make_node("ProcSparseMatMul", inputs, ["Y"], domain="ai.ortsparse", name=node_name, **attrs)
    graph_inputs = [helper.make_tensor_value_info("X", TensorProto.FLOAT, x_dims)]
    initializers = [numpy_helper.from_array(indices, "indices"), numpy_helper.from_array(deltas, "deltas")]
    if not constant:
        graph_inputs.append(helper.make_tensor_value_info("deltas", TensorProto.FLOAT, list(deltas.shape)))
        initializers = initializers[:1]
    if bias is not None:
        initializers.append(numpy_helper.from_array(bias, "B"))
    graph = helper.make_graph([node], "proc", graph_inputs,
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.ortsparse", 1)],
                             ir_version=9)


def event_model(w: np.ndarray, bias: np.ndarray | None = None, *, x_shape=("m", None), reset_input: bool = False,
                w_as_graph_input: bool = False, node_name: str = "event_node", **attrs):
    """EventDrivenMatMul(X, W, B?, reset?); reset is a bool scalar graph input when reset_input."""
    k = w.shape[0]
    x_dims = [k if d is None else d for d in x_shape]
    inputs = ["X", "W", "B" if bias is not None else ""] + (["reset"] if reset_input else [])
    while inputs and inputs[-1] == "":
        inputs.pop()
    node = helper.make_node("EventDrivenMatMul", inputs, ["Y"], domain="ai.ortsparse", name=node_name, **attrs)
    graph_inputs = [helper.make_tensor_value_info("X", TensorProto.FLOAT, x_dims)]
    if reset_input:
        graph_inputs.append(helper.make_tensor_value_info("reset", TensorProto.BOOL, []))
    initializers = [numpy_helper.from_array(w, "W")]
    if w_as_graph_input:
        graph_inputs.append(helper.make_tensor_value_info("W", TensorProto.FLOAT, list(w.shape)))
    if bias is not None:
        initializers.append(numpy_helper.from_array(bias, "B"))
    graph = helper.make_graph([node], "event", graph_inputs,
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.ortsparse", 1)],
                             ir_version=9)
