"""Layer classification from graph structure and the --kwta-target selection."""
from __future__ import annotations

import onnx
import pytest

import tiny_graphs as tg
from configs import kwta
from ortsparse.graph_rewrite import list_layers

FAMILIES = {
    "gpt2": (tg.gpt2_like, tg.expected_classes("gpt2")),
    "bert": (tg.bert_like, tg.expected_classes("bert")),
    "bert_pooler": (lambda: tg.bert_like(pooler=True), tg.expected_classes("bert", pooler=True)),
    "llama": (tg.llama_like, tg.expected_classes("llama")),
    "bert_fused": (tg.bert_fused_like, tg.BERT_FUSED_CLASSES),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_classes_and_roles(family):
    build, expected = FAMILIES[family]
    report = list_layers(build())
    assert [(r.layer_class, r.role) for r in report.layers] == expected
    assert report.attention_cores == 2
    assert [r.index for r in report.layers] == list(range(len(expected)))


def test_classification_ignores_names():
    model = tg.llama_like()
    for i, node in enumerate(model.graph.node):
        node.name = f"n{i}"  # nothing left that says q_proj / mlp / lm_head
    report = list_layers(model)
    assert [(r.layer_class, r.role) for r in report.layers] == tg.expected_classes("llama")


def test_rotary_matmul_and_attention_matmuls_are_not_linear_layers():
    report = list_layers(tg.llama_like(n_layers=1))
    assert "/rotary_emb/MatMul" not in [r.name for r in report.layers]
    assert len(report.layers) == 8  # q k v o gate up down lm_head


@pytest.mark.parametrize("target, expected", [
    ("mlp", {"mlp"}),
    ("attn", {"attn"}),
    ("both", {"mlp", "attn"}),
    ("all", {"mlp", "attn", "head"}),
])
def test_target_selects_classes(target, expected):
    report = list_layers(tg.llama_like(), kwta(target))
    assert {r.layer_class for r in report.rewritten} == expected
    assert {r.layer_class for r in report.skipped} == {"mlp", "attn", "head"} - expected


def test_target_down_selects_only_down_projections():
    report = list_layers(tg.llama_like(), kwta("down"))
    assert [(r.layer_class, r.role) for r in report.rewritten] == [("mlp", "down")] * 2


def test_head_is_left_alone_by_default_and_says_so():
    report = list_layers(tg.gpt2_like(), kwta("both"))
    head = report.layers[-1]
    assert head.layer_class == "head" and head.decision == "skipped"
    assert "--kwta-target=all or an override" in head.reason


def test_other_class_only_with_all():
    model = tg.bert_like(pooler=True)
    assert list_layers(model, kwta("both")).layers[-1].decision == "skipped"
    assert list_layers(model, kwta("all")).layers[-1].decision == "rewritten"


def test_kwta_off_rewrites_nothing():
    report = list_layers(tg.gpt2_like(), kwta("all", enabled=False))
    assert not report.rewritten
    assert all(r.reason == "--kwta=off" for r in report.layers)


def test_list_layers_does_not_modify_the_model():
    model = tg.gpt2_like()
    before = model.SerializeToString()
    report = list_layers(model, kwta("all"))
    assert model.SerializeToString() == before
    assert report.preview and "rewrite" in report.layer_table()
    onnx.checker.check_model(model, full_check=True)
