"""as_decoded: the written model with every call computed as decode steps compute it (what quality
measurement on teacher-forced windows must see)."""
import onnx
from onnx import helper

from ortsparse.graph_rewrite.as_decoded import as_decoded


def _model():
    nodes = [
        helper.make_node("KwtaBlockMatMul", ["X", "W"], ["Y"], domain="ai.ortsparse", name="gated", max_gated_rows=8),
        helper.make_node("PopcountGroupQueryAttention", ["q"], ["o"], domain="ai.ortsparse", name="attn"),
        helper.make_node("PopcountAttention", ["q", "k", "v"], ["o2"], domain="ai.ortsparse", name="attn4",
                         prefill_rows=32),
        helper.make_node("MatMul", ["X", "W"], ["Z"], name="plain"),
    ]
    graph = helper.make_graph(nodes, "g", [], [])
    return helper.make_model(graph)


def _attributes(model):
    return {n.name: {a.name: a.i for a in n.attribute} for n in model.graph.node}


def test_every_row_limit_becomes_zero_and_the_input_is_untouched():
    model = _model()
    before = model.SerializeToString()
    decoded = _attributes(as_decoded(model))
    assert decoded == {"gated": {"max_gated_rows": 0}, "attn": {"prefill_rows": 0}, "attn4": {"prefill_rows": 0},
                       "plain": {}}
    assert model.SerializeToString() == before
    assert isinstance(as_decoded(model), onnx.ModelProto)
