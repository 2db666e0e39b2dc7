"""The survey matches once and its records carry everything the replacement needs: layer operands,
attention cores analysed by the one recogniser; the replacement matches nothing again."""
from __future__ import annotations

import attention_graphs as ag
import numpy as np
import onnx
import onnx_ir as ir
import pytest
import tiny_graphs as tg
from configs import kwta
from ort_run import assert_same_outputs, kwta_nodes, token_feeds
from ortsparse.graph_rewrite import list_layers, rewrite_model
from ortsparse.graph_rewrite import rules as rules_module
from ortsparse.graph_rewrite.attention_rules import RULES as ATTENTION_RULES
from ortsparse.graph_rewrite.layers import survey
from ortsparse.graph_rewrite.replace import RULE_KEY
from ortsparse.graph_rewrite.rules import FloatWeight
from ortsparse.graph_rewrite.techniques.popcount import AttentionSettings

EXACT_ATTENTION = AttentionSettings(select="none")


@pytest.fixture()
def match_calls(monkeypatch):
    """Counts every linear rule match and every attention analysis."""
    calls = {"linear": 0, "attention": 0}
    for rule in rules_module.RULES:
        original = rule.try_layer

        def counted(*args, _original=original, **kwargs):
            calls["linear"] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(rule, "try_layer", counted)
    for rule in ATTENTION_RULES:
        original = rule.analyze

        def analyzed(*args, _original=original, **kwargs):
            calls["attention"] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(rule, "analyze", analyzed)
    return calls


@pytest.mark.parametrize("builder", ["gpt2_like", "llama_like", "bert_fused_like"])
def test_rewrite_matches_no_more_than_the_survey(builder, match_calls):
    model = getattr(tg, builder)()
    config = kwta("all", k_frac=1.0, attention=EXACT_ATTENTION)
    list_layers(model, config)
    surveyed = dict(match_calls)
    assert surveyed["linear"] > 0 and surveyed["attention"] == 2
    match_calls.update(linear=0, attention=0)
    out, report = rewrite_model(model, config)
    assert match_calls == surveyed  # the replacement step matched nothing again
    assert len(kwta_nodes(out)) == len(report.layers) and all(a.rewritten for a in report.attention)


def test_layer_records_hold_the_operands():
    model = ir.from_proto(tg.gpt2_like(n_layers=1))
    layers = survey(model).layers
    by_rule = {layer.rule: layer for layer in layers}
    assert set(by_rule) == {"gemm", "matmul_transposed_weight"}
    head = by_rule["matmul_transposed_weight"]
    ops = head.operands
    assert isinstance(ops.weight, FloatWeight) and ops.weight.transposed and ops.weight.form == "float32"
    assert ops.x is head.node.inputs[0] and ops.bias is None
    assert sorted(n.op_type for n in ops.nodes) == ["MatMul", "Transpose"] and ops.y is head.node.outputs[0]
    embedding = ops.weight.value.const_value.numpy()
    np.testing.assert_array_equal(ops.weight.matrix(), embedding.T)
    assert (ops.k, ops.n) == (head.k, head.n) == embedding.shape[::-1]
    for layer in layers:
        assert layer.node in layer.operands.nodes and layer.operands.y.producer() in layer.operands.nodes
    gemm = next(layer for layer in layers if layer.rule == "gemm")
    assert gemm.operands.bias is gemm.node.inputs[2]
    assert gemm.operands.bias_vector().shape == (gemm.operands.n,)


def test_matmul_add_record_replaces_both_nodes():
    model = ir.from_proto(tg.matmul_model(bias="before"))
    (layer,) = survey(model).layers
    assert layer.rule == "matmul_add"
    assert sorted(n.op_type for n in layer.operands.nodes) == ["Add", "MatMul"]
    assert layer.operands.y.is_graph_output()


def test_projections_feeding_a_fused_core_directly():
    """bert_fused_like's layer 1: q/k/v MatMul+Add straight into MultiHeadAttention. Both are
    rewritten; the core reads the values that took the projections' place."""
    model = tg.bert_fused_like()
    out, report = rewrite_model(model, kwta("all", k_frac=1.0, attention=EXACT_ATTENTION))
    onnx.checker.check_model(out, full_check=True)
    assert not report.skipped and [a.rule for a in report.attention] == ["attention_ms_attention", "attention_ms_mha"]
    assert len(kwta_nodes(out)) == len(report.layers)
    assert not [n for n in out.graph.node if n.domain == "com.microsoft" and "Attention" in n.op_type]
    assert_same_outputs(model, out, token_feeds(model))


def test_new_nodes_keep_the_replaced_nodes_metadata_and_name_the_rule():
    model = tg.matmul_model(bias="after")
    for node in model.graph.node:
        onnx.helper.set_metadata_props(node, {"pkg.exporter.scope": node.op_type})
    out, _ = rewrite_model(model, kwta("all"))
    (node,) = kwta_nodes(out)
    meta = {p.key: p.value for p in node.metadata_props}
    assert meta[RULE_KEY] == "matmul_add"
    assert meta["pkg.exporter.scope"] == "Add"  # the first matched node's (the pattern's root) value wins


def test_one_recogniser_classifies_and_rewrites():
    """The cores that classify the q/k/v/out projections are the ones the rewrite replaces."""
    model = ir.from_proto(tg.llama_like())
    found = survey(model)
    cores = found.attention.candidates
    assert found.attention_cores == len(cores) == 2
    assert all(core.rule is not None and core.operands is not None for core in cores)
    roles = {layer.role for layer in found.layers if layer.layer_class == "attn"}
    assert roles == {"q", "k", "v", "out"}


def test_packed_multihead_attention_is_a_near_miss_with_a_reason():
    model = ag.ms_mha(key_padding=False, bias=False)
    for node in model.graph.node:
        if node.op_type == "MultiHeadAttention":
            node.input[1] = node.input[2] = ""
    report = list_layers(model, kwta(attention=EXACT_ATTENTION))
    (record,) = report.attention
    assert record.decision == "skipped" and "packed QKV" in record.reason
    assert record.near_misses[0][0] == "attention_ms_mha"
