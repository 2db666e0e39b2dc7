"""Each rewrite rule on one-layer models: what it replaces, what it emits, why it declines."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

import tiny_graphs as tg
from configs import kwta
from ort_run import assert_same_outputs, kwta_nodes, op_types, token_feeds
from ortsparse.graph_rewrite import RewriteConfig, describe_rules, list_layers, rewrite_model

EXACT_ALL = kwta("all", k_frac=1.0)
ALL_ATTRIBUTES = {"k_frac", "k_abs", "score", "threshold", "temp", "duty", "duty_mode", "renorm", "block",
                  "max_gated_rows"}


def rewrite(model: onnx.ModelProto, config: RewriteConfig = EXACT_ALL):
    out, report = rewrite_model(model, config)
    onnx.checker.check_model(out, full_check=True)
    return out, report


def initializer_names(model: onnx.ModelProto) -> list[str]:
    return [i.name for i in model.graph.initializer]


def test_rules_have_before_after_docstrings():
    rules = describe_rules()
    assert [name for name, _, _ in rules] == ["gemm", "matmul_add", "matmul_transposed_weight", "matmul",
                                              "matmul_nbits_add", "matmul_nbits"]
    for _, before_after, doc in rules:
        assert "->" in before_after
        assert "Before -> After" in doc


def test_matmul_becomes_kwta_with_every_attribute():
    model = tg.matmul_model()
    out, report = rewrite(model, kwta("all", k_frac=0.75, score="mean_abs"))
    assert op_types(out) == ["KwtaBlockMatMul"]
    node = kwta_nodes(out)[0]
    assert list(node.input) == ["X", "W"]
    assert node.name == "/layer/MatMul"
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert set(attributes) == ALL_ATTRIBUTES
    assert attributes["k_frac"] == pytest.approx(0.75)
    assert attributes["score"] == b"mean_abs"
    assert attributes["block"] == 1
    assert {(o.domain, o.version) for o in out.opset_import} >= {("ai.ortsparse", 1)}
    assert report.layers[0].rule == "matmul"
    assert report.layers[0].decision == "rewritten"


@pytest.mark.parametrize("bias_side", ["after", "before"])
def test_matmul_add_folds_bias_either_side(bias_side):
    model = tg.matmul_model(bias=bias_side)
    out, report = rewrite(model)
    assert op_types(out) == ["KwtaBlockMatMul"]
    assert list(kwta_nodes(out)[0].input) == ["X", "W", "b"]
    assert report.layers[0].rule == "matmul_add"
    assert_same_outputs(model, out, token_feeds(model))


def test_bias_broadcastable_to_n_gets_one_vector_copy():
    model = tg.matmul_model(bias="after", bias_shape=(1, 1, tg.N_OUT))
    out, report = rewrite(model)
    assert list(kwta_nodes(out)[0].input) == ["X", "W", "b_vec"]
    assert "b" not in initializer_names(out)  # the original has no user left
    assert report.added_initializers == ["b_vec"] and report.removed_initializers == ["b"]
    assert_same_outputs(model, out, token_feeds(model))


def test_bias_of_higher_rank_stays_as_add_with_reason():
    model = tg.matmul_model(bias="after", bias_shape=(1, 2, 1, tg.N_OUT))
    out, report = rewrite(model)
    assert op_types(out) == ["KwtaBlockMatMul", "Add"]
    layer = report.layers[0]
    assert layer.rule == "matmul"
    assert any(rule == "matmul_add" and "not broadcastable" in why for rule, why in layer.near_misses)


@pytest.mark.parametrize("trans_b", [0, 1])
@pytest.mark.parametrize("bias_shape", [(tg.N_OUT,), (1, tg.N_OUT), None])
def test_gemm_variants(trans_b, bias_shape):
    model = tg.gemm_model(trans_b=trans_b, bias_shape=bias_shape)
    out, report = rewrite(model)
    assert op_types(out) == ["KwtaBlockMatMul"]
    node = kwta_nodes(out)[0]
    assert len(node.input) == (3 if bias_shape else 2)
    weight = next(i for i in out.graph.initializer if i.name == node.input[1])
    assert tuple(weight.dims) == (tg.K_IN, tg.N_OUT)
    assert ("W" in initializer_names(out)) == (trans_b == 0)  # a transposed original is dropped
    assert report.layers[0].rule == "gemm"
    rows = np.random.default_rng(0).standard_normal((3, tg.K_IN)).astype(np.float32)
    assert_same_outputs(model, out, {"X": rows})


def test_tied_lm_head_gets_transposed_copy_and_keeps_embedding():
    model = tg.gpt2_like(n_layers=1)
    out, report = rewrite(model)
    head = next(n for n in kwta_nodes(out) if n.name == "/lm_head/MatMul")
    assert list(head.input)[1] == "transformer.wte.weight_T"
    names = initializer_names(out)
    assert "transformer.wte.weight" in names  # still used by the embedding Gather
    assert "Transpose" not in [n.op_type for n in out.graph.node if n.name.startswith("/lm_head")]
    assert report.layers[-1].rule == "matmul_transposed_weight"
    assert_same_outputs(model, out, token_feeds(model))


def test_shared_weights_stay_shared():
    model = tg.shared_weight_model()
    out, report = rewrite(model)
    nodes = kwta_nodes(out)
    assert [n.input[1] for n in nodes] == ["W", "W", "V_T", "V_T"]
    names = initializer_names(out)
    assert names.count("W") == 1 and names.count("V_T") == 1 and "V" not in names
    assert report.added_initializers == ["V_T"]
    rows = np.random.default_rng(1).standard_normal((4, tg.K_IN)).astype(np.float32)
    assert_same_outputs(model, out, {"X": rows})


@pytest.mark.parametrize("model_kwargs, reason", [
    ({"weight_as_graph_input": True}, "is a graph input, not a constant initializer"),
    ({"initializer_also_input": True}, "initializer that is also a graph input"),
    ({"weight_via_cast": True}, "is computed by Cast node"),
    ({"weight_dtype": np.float16}, "has dtype FLOAT16"),
])
def test_matmul_near_misses_explain_themselves(model_kwargs, reason):
    model = tg.matmul_model(**model_kwargs)
    out, report = rewrite(model)
    assert "KwtaBlockMatMul" not in op_types(out)
    layer = report.layers[0]
    assert layer.decision == "skipped" and layer.rule is None
    assert reason in layer.reason
    assert not any(o.domain == "ai.ortsparse" for o in out.opset_import)


@pytest.mark.parametrize("gemm_kwargs, reason", [
    ({"alpha": 0.5}, "alpha=0.5"),
    ({"beta": 2.0}, "beta=2"),
    ({"trans_a": 1}, "transA=1"),
    ({"bias_shape": (3, tg.N_OUT)}, "not broadcastable"),
])
def test_gemm_near_misses_explain_themselves(gemm_kwargs, reason):
    report = list_layers(tg.gemm_model(**gemm_kwargs), EXACT_ALL)
    layer = report.layers[0]
    assert layer.decision == "skipped"
    assert reason in layer.reason
    assert layer.near_misses[0][0] == "gemm"


def test_block_larger_than_k_is_clamped():
    model = tg.matmul_model()
    out, report = rewrite(model, kwta("all", block=64))
    block = next(a for a in kwta_nodes(out)[0].attribute if a.name == "block")
    assert block.i == tg.K_IN
    assert "block set to K" in report.layers[0].detail()
