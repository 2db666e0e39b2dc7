"""rewrite_model end to end on the tiny families: counts, op types, checker, numerics, report."""
from __future__ import annotations

import json

import onnx
import onnx_ir as ir
import pytest

import tiny_graphs as tg
from configs import kwta, without_kwta
from ort_run import assert_same_outputs, kwta_nodes, relative_l2, token_feeds
from ortsparse.graph_rewrite import LayerOverride, RewriteConfig, rewrite_model

BUILDERS = {"gpt2": tg.gpt2_like, "bert": tg.bert_like, "llama": tg.llama_like, "bert_fused": tg.bert_fused_like}
# (mlp, attn, head) layer counts of the 2-layer tiny models
COUNTS = {"gpt2": (4, 4, 1), "bert": (4, 8, 0), "llama": (6, 8, 1), "bert_fused": (4, 5, 0)}


@pytest.mark.parametrize("family", BUILDERS)
@pytest.mark.parametrize("target", ["mlp", "both", "all"])
def test_counts_checker_and_exact_numerics(family, target):
    model = BUILDERS[family]()
    out, report = rewrite_model(model, kwta(target, k_frac=1.0))
    onnx.checker.check_model(out, full_check=True)
    mlp, attn, head = COUNTS[family]
    expected = {"mlp": mlp, "both": mlp + attn, "all": mlp + attn + head}[target]
    assert len(kwta_nodes(out)) == expected == len(report.rewritten)
    counts = report.counts()
    assert counts["mlp"]["rewritten"] == mlp
    assert counts.get("attn", {}).get("rewritten", 0) == (0 if target == "mlp" else attn)
    assert report.exact
    assert_same_outputs(model, out, token_feeds(model))


@pytest.mark.parametrize("family", BUILDERS)
def test_gating_changes_the_result(family):
    model = BUILDERS[family]()
    out, report = rewrite_model(model, kwta("all", k_frac=0.3))
    assert not report.exact
    error = relative_l2(model, out, token_feeds(model))
    assert 1e-3 < error < 10


def test_model_proto_input_is_not_modified():
    model = tg.gpt2_like()
    before = model.SerializeToString()
    out, _ = rewrite_model(model, kwta("all"))
    assert model.SerializeToString() == before
    assert isinstance(out, onnx.ModelProto)


def test_ir_model_is_rewritten_in_place():
    model = ir.from_proto(tg.llama_like())
    out, report = rewrite_model(model, RewriteConfig())
    assert out is model
    assert sum(1 for n in model.graph if n.op_type == "KwtaBlockMatMul") == len(report.rewritten) == 6
    assert model.opset_imports["ai.ortsparse"] == 1


def test_nothing_selected_leaves_model_valid_and_says_so():
    model = tg.bert_like()
    out, report = rewrite_model(model, without_kwta())
    assert not kwta_nodes(out) and not report.rewritten
    assert "no layer matched the selection" in report.summary()
    assert not any(o.domain == "ai.ortsparse" for o in out.opset_import)
    onnx.checker.check_model(out, full_check=True)


def test_overrides_glob_layer_index_class_and_off():
    model = tg.llama_like()
    overrides = (
        LayerOverride("*down_proj*", techniques={"kwta": {"k_frac": 0.9}}),
        LayerOverride("layer:0", techniques={"kwta": {"k_frac": 0.6, "score": "mean_abs"}}),
        LayerOverride("class:head", techniques={"kwta": {}}),
        LayerOverride("/model.layers.1.mlp.up_proj/MatMul", techniques={"kwta": "off"}),
        LayerOverride("role:down", techniques={"kwta": {"block": 2}}),  # later entries win, and accumulate
        LayerOverride("layer:4", off=True),
    )
    out, report = rewrite_model(model, kwta(k_frac=0.5, overrides=overrides))
    by_name = {r.name: r for r in report.layers}
    assert by_name["/model.layers.0.self_attn.q_proj/MatMul"].settings.score == "mean_abs"  # layer:0 selects attn
    assert by_name["/model.layers.0.mlp.gate_proj/MatMul"].decision == "skipped"  # layer:4 off
    assert "off by" in by_name["/model.layers.0.mlp.gate_proj/MatMul"].reason
    assert by_name["/model.layers.1.mlp.up_proj/MatMul"].decision == "skipped"
    down = by_name["/model.layers.1.mlp.down_proj/MatMul"].settings
    assert (down.k_frac, down.block) == (0.9, 2)
    assert by_name["/lm_head/MatMul"].decision == "rewritten"
    assert by_name["/model.layers.0.mlp.up_proj/MatMul"].settings.k_frac == 0.5
    nodes = {n.name: n for n in kwta_nodes(out)}
    k_frac = next(a.f for a in nodes["/model.layers.1.mlp.down_proj/MatMul"].attribute if a.name == "k_frac")
    assert k_frac == pytest.approx(0.9)
    assert len(nodes) == len(report.rewritten) == 6


def test_report_table_and_json():
    _, report = rewrite_model(tg.gpt2_like(), RewriteConfig())
    table = report.layer_table()
    assert "/transformer.h.0.mlp.c_fc/Gemm" in table and "not in --kwta-target=mlp" in table
    summary = report.summary()
    assert "9 linear layers, 4 rewritten (4 -> KwtaBlockMatMul)" in summary
    assert "class attn not in --kwta-target=mlp" in summary
    data = json.loads(json.dumps(report.to_dict()))
    assert data["counts"]["mlp"] == {"layers": 4, "rewritten": 4, "skipped": 0}
    assert data["layers"][2]["settings"]["k_frac"] == 0.5
    assert data["layers"][0]["decision"] == "skipped"
