"""The one way nodes are cut out of a model (graph_rewrite/node_models.py): what head placement and
tune's layer speed time, and what the load check opens. The cut graph computes what the node
computed in the model (checked against numpy), shares an input its nodes share, refuses a node whose
weight is computed, and keeps only the opsets its nodes use."""
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from ortsparse.calibration import allocation
from ortsparse.graph_rewrite.node_models import layers_alone, nodes_alone
from ortsparse.runtime import open_session

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny"
LLAMA = TINY / "llama_tiny.torchscript.onnx"


@pytest.fixture(scope="module")
def llama():
    model = onnx.load(str(LLAMA))
    return model, allocation.units_of(allocation.gated_layers(model, "both"))


def test_layers_alone_computes_the_layers_with_their_weights(llama):
    model, units = llama
    unit = next(u for u in units if len(u.layers) == 3)  # q, k, v: one X
    k = unit.layers[0].weight.shape[0]
    graph = layers_alone(model, [layer.name for layer in unit.layers], {unit.input_name: [1, 1, k]})
    assert [node.name for node in graph.graph.node] == [layer.name for layer in unit.layers]
    assert [i.name for i in graph.graph.input] == [unit.input_name]  # the shared X once
    assert [d.dim_value for d in graph.graph.input[0].type.tensor_type.shape.dim] == [1, 1, k]
    row = np.random.default_rng(1).standard_normal((1, 1, k)).astype(np.float32)
    outputs = open_session(graph).run(None, {unit.input_name: row})
    for got, layer in zip(outputs, unit.layers):
        np.testing.assert_allclose(got.reshape(-1), row[0, 0] @ layer.weight, rtol=1e-4, atol=1e-5)


def test_layers_alone_names_the_node_and_input_it_cannot_take(llama):
    model, units = llama
    broken = onnx.ModelProto()
    broken.CopyFrom(model)
    name = units[0].layers[0].name
    next(n for n in broken.graph.node if n.name == name).input[1] = "computed_weight"
    with pytest.raises(ValueError, match=f"{name}: input 'computed_weight' is not a constant initializer"):
        layers_alone(broken, [name])
    with pytest.raises(ValueError, match="no node 'nowhere' in the model"):
        layers_alone(model, ["nowhere"])


def test_nodes_alone_keeps_the_used_opsets_and_the_input_types():
    weight = numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(2, 3), "W")
    node = helper.make_node("MatMul", ["X", "W"], ["Y"], name="mm")
    cast = helper.make_node("Cast", ["I"], ["J"], name="cast", to=onnx.TensorProto.FLOAT)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("ai.ortsparse", 1), helper.make_opsetid("com.microsoft", 1)]
    model = nodes_alone([node, cast], {"W": weight}, opsets, ir_version=9, input_types={"I": onnx.TensorProto.INT64})
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 17)]
    assert [i.name for i in model.graph.input] == ["X", "I"]
    assert model.graph.input[1].type.tensor_type.elem_type == onnx.TensorProto.INT64
    assert [t.name for t in model.graph.initializer] == ["W"] and model.ir_version == 9
    y, j = open_session(model).run(None, {"X": np.ones((1, 2), np.float32), "I": np.array([3], np.int64)})
    np.testing.assert_array_equal(y, [[3.0, 5.0, 7.0]])
    np.testing.assert_array_equal(j, [3.0])
