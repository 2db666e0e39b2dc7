"""Attention cores -> PopcountAttention: every form (hand-built one-core graphs and the torch exports
of models/tiny), what is emitted, why near-misses are declined, and numeric equality with the
original in onnxruntime when the op runs exact (select="none"), masks included."""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import attention_graphs as ag
import numpy as np
import onnx
import pytest
import tiny_graphs as tg
from ort_run import run_ortsparse, run_reference, token_feeds
from configs import kwta, without_kwta
from ortsparse.graph_rewrite import (
    ConfigError,
    RewriteConfig,
    config_from_flags,
    list_layers,
    rewrite_model,
)
from ortsparse.graph_rewrite.attention_rules import describe_rules
from ortsparse.graph_rewrite.techniques import popcount
from ortsparse.graph_rewrite.techniques.popcount import AttentionSettings

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "models" / "tiny"
TINY_FILES = sorted(p.name for p in TINY.glob("*.onnx")) if TINY.is_dir() else []
EXACT = AttentionSettings(select="none")
ATTN_ONLY = RewriteConfig(attention=EXACT)  # KWTA's auto steps aside
ATTRIBUTES = {"scale", "is_causal", "mode", "select", "topk", "min_keys", "eps", "density_max", "candidates",
              "keep_first", "keep_recent", "pack_cache", "center", "proj_bits", "page_size"}


def rewrite(model: onnx.ModelProto, config: RewriteConfig = ATTN_ONLY):
    out, report = rewrite_model(model, config)
    onnx.checker.check_model(out, full_check=True)
    return out, report


def pop_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == "PopcountAttention" and n.domain == "ai.ortsparse"]


def attrs(node: onnx.NodeProto) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def assert_close(reference: onnx.ModelProto, rewritten: onnx.ModelProto, feeds, rtol: float = 1e-5):
    expected, actual = run_reference(reference, feeds), run_ortsparse(rewritten, feeds)
    for e, a in zip(expected, actual):
        assert np.isfinite(a).all() == np.isfinite(e).all()
        scale = float(np.abs(e).max()) or 1.0
        np.testing.assert_allclose(a, e, rtol=rtol, atol=rtol * scale)


def test_rules_have_before_after_docstrings():
    rules = describe_rules()
    assert [name for name, _, _ in rules] == ["attention_onnx", "attention_ms_attention", "attention_ms_mha",
                                              "attention_ms_gqa", "attention_eager"]
    for _, before_after, doc in rules:
        assert "->" in before_after and "Before -> After" in doc


# -- decomposed (eager) attention -------------------------------------------------------------

EAGER_FORMS = [
    {"k_form": "t0132", "scale": "div"},
    {"k_form": "t0231", "scale": "mul"},
    {"k_form": "rtr", "scale": "split"},
    {"k_form": "t0132", "scale": "none"},
    {"k_form": "t0132", "scale": "div", "masks": ("add",)},
    {"k_form": "t0231", "scale": "div", "masks": ("bool",)},
    {"k_form": "t0132", "scale": "mul", "masks": ("add", "bool")},
    {"k_form": "t0132", "scale": "split", "masks": ("inf",), "tail": "nanguard"},
    {"k_form": "t0132", "scale": "div", "masks": ("add",), "tail": "cast"},
    {"k_form": "t0132", "scale": "div", "masks": ("add",), "gqa": True},
    {"k_form": "t0132", "scale": "split", "masks": ("inf",), "tail": "nanguard", "gqa": True},
]


@pytest.mark.parametrize("form", EAGER_FORMS, ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()))
def test_eager_form_rewritten_and_exact(form):
    model = ag.eager_core(**form)
    out, report = rewrite(model)
    nodes = pop_nodes(out)
    assert len(nodes) == 1 and report.attention[0].rule == "attention_eager"
    assert not {"Softmax", "IsNaN"} & {n.op_type for n in out.graph.node}
    a = attrs(nodes[0])
    assert set(a) == ATTRIBUTES
    expected_scale = 1.0 if form["scale"] == "none" else 1 / math.sqrt(ag.D)
    assert a["scale"] == pytest.approx(expected_scale, rel=1e-6)
    assert a["select"] == b"none" and a["is_causal"] == 0
    assert (len(nodes[0].input) == 4) == bool(form.get("masks"))
    if form.get("gqa"):
        # the un-expanded K/V graph inputs go straight into the op; the repeat is gone
        assert list(nodes[0].input[1:3]) == ["K", "V"]
        assert "Expand" not in {n.op_type for n in out.graph.node}
    feeds = ag.feeds(model)
    assert_close(model, out, feeds)


def test_fully_masked_rows_match_sdpa_nan_guard():
    """Where(IsNaN(P), 0, P) after an all -inf row gives 0; the op gives 0 for such rows too."""
    model = ag.eager_core(masks=("inf",), tail="nanguard")
    out, _ = rewrite(model)
    feeds = ag.feeds(model)
    feeds["add_mask"][0, :, 2, :] = -np.inf  # batch 0, query 2 sees no key
    expected = run_reference(model, feeds)[0]
    assert np.all(expected[0, :, 2] == 0)
    assert_close(model, out, feeds)


@pytest.mark.parametrize("kwargs, reason", [
    ({"mask_before_scale": True, "masks": ("add",)}, "comes before a scale"),
    ({"dynamic_scale": True}, "does not scale by a constant scalar"),
    ({"softmax_axis": 2}, "normalises axis 2"),
])
def test_eager_near_misses_explain_themselves(kwargs, reason):
    model = ag.eager_core(**kwargs)
    out, report = rewrite(model)
    assert not pop_nodes(out)
    record = report.attention[0]
    assert record.decision == "skipped" and record.rule is None
    assert reason in record.reason
    assert record.near_misses[0][0] == "attention_eager"


def test_three_d_bmm_attention_is_declined():
    report = list_layers(ag.bmm_core(), ATTN_ONLY)
    assert "only 4-D [B, H, S, D] attention" in report.attention[0].reason


def test_linear_matmuls_are_no_attention_candidates():
    report = list_layers(tg.matmul_model(), ATTN_ONLY)
    assert report.attention == []


def test_off_by_default_reports_cores_without_rewriting():
    model = ag.eager_core()
    out, report = rewrite(model, without_kwta())
    assert not pop_nodes(out)
    assert report.attention[0].rule == "attention_eager"
    assert report.attention[0].reason == "--attn=off"


def test_settings_become_attributes():
    settings = AttentionSettings(mode="ternary", select="popcount", topk=7, min_keys=3, eps=0.01, density_max=0.3,
                                 keep_first=1)
    out, report = rewrite(ag.eager_core(), RewriteConfig(attention=settings))
    a = attrs(pop_nodes(out)[0])
    assert (a["mode"], a["select"], a["topk"], a["min_keys"]) == (b"ternary", b"popcount", 7, 3)
    assert a["eps"] == pytest.approx(0.01) and a["density_max"] == pytest.approx(0.3)
    assert (a["keep_first"], a["keep_recent"], a["pack_cache"]) == (1, 0, 1) and a["candidates"] == 1.0
    assert not report.exact  # approximate attention: --verify uses the loose budget
    _, exact_report = rewrite(ag.eager_core())
    assert exact_report.exact


# -- hand-built transformers of tiny_graphs (Where-causal GPT-2, BERT, Llama, ORT-fused BERT) ---

@pytest.mark.parametrize("builder", ["gpt2_like", "bert_like", "llama_like", "bert_fused_like"])
def test_tiny_graph_families(builder):
    model = getattr(tg, builder)()
    out, report = rewrite(model)
    assert len(pop_nodes(out)) == 2 and all(r.rewritten for r in report.attention)
    assert_close(model, out, token_feeds(model))


def test_attention_and_kwta_together():
    model = tg.llama_like()
    out, report = rewrite(model, kwta("all", k_frac=1.0, attention=EXACT))
    assert len(pop_nodes(out)) == 2
    assert len([n for n in out.graph.node if n.op_type == "KwtaBlockMatMul"]) == len(report.layers)
    assert_close(model, out, token_feeds(model), rtol=1e-4)


# -- ONNX Attention (opset 23) ------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [
    {"mask": "bool"}, {"mask": "add"}, {"mask": None, "is_causal": 1}, {"mask": "bool", "gqa": True},
    {"mask": "add", "scale": 0.3},
])
def test_onnx_attention(kwargs):
    model = ag.onnx_attention(**kwargs)
    out, report = rewrite(model)
    node = pop_nodes(out)[0]
    assert report.attention[0].rule == "attention_onnx"
    assert "Attention" not in [n.op_type for n in out.graph.node if n.domain == ""]
    a = attrs(node)
    assert a["is_causal"] == kwargs.get("is_causal", 0)
    assert a["scale"] == pytest.approx(kwargs.get("scale", 0.0))  # 0 = 1/sqrt(D) in both ops
    assert_close(model, out, ag.feeds(model))


@pytest.mark.parametrize("kwargs, reason", [
    ({"softcap": 30.0}, "softcap"),
    ({"mask": None, "is_causal": 1, "k_len": "total"}, "not provably equal"),
    ({"scale": -0.5}, "scale=-0.5: the op takes a finite scale >= 0"),  # onnxruntime runs it; the op refuses it
    ({"scale": float("nan")}, "scale=nan"),
])
def test_onnx_attention_near_misses(kwargs, reason):
    out, report = rewrite(ag.onnx_attention(**kwargs))
    assert not pop_nodes(out)
    assert reason in report.attention[0].reason


# -- onnxruntime's fused ops --------------------------------------------------------------------

@pytest.mark.parametrize("mask, unidirectional", [("2d", 0), ("1d", 0), (None, 1), ("2d", 1)])
def test_ms_attention(mask, unidirectional):
    model = ag.ms_attention(mask=mask, unidirectional=unidirectional)
    out, report = rewrite(model)
    assert report.attention[0].rule == "attention_ms_attention"
    assert attrs(pop_nodes(out)[0])["is_causal"] == unidirectional
    assert not [n for n in out.graph.node if n.domain == ag.MS]
    assert_close(model, out, ag.feeds(model))


@pytest.mark.parametrize("key_padding, bias", [(True, True), (False, False)])
def test_ms_multihead_attention(key_padding, bias):
    model = ag.ms_mha(key_padding=key_padding, bias=bias)
    out, report = rewrite(model)
    assert report.attention[0].rule == "attention_ms_mha"
    assert_close(model, out, ag.feeds(model))


# -- the torch exports of models/tiny ------------------------------------------------------------

@pytest.fixture(scope="module")
def manifest() -> dict:
    return json.loads((TINY / "manifest.json").read_text())["files"]


@pytest.mark.parametrize("name", TINY_FILES)
def test_tiny_export_attention(name, manifest):
    sys.path.insert(0, str(ROOT / "models"))
    from make_tiny_models import reference_inputs

    entry = manifest[name]
    layers = entry["config"].get("n_layer") or entry["config"].get("num_hidden_layers")
    model = onnx.load(TINY / name)
    out, report = rewrite(model)
    assert len(pop_nodes(out)) == layers
    assert all(r.rewritten for r in report.attention), report.attention_table()
    expected_rule = "attention_onnx" if "opset23" in name else "attention_eager"
    assert {r.rule for r in report.attention} == {expected_rule}
    assert not {"Softmax", "Attention"} & {n.op_type for n in out.graph.node if n.domain == ""}
    if entry["family"] == "llama":  # 4 query heads on 2 KV heads
        assert all("GQA un-expanded" in r.detail for r in report.attention)
    feeds = reference_inputs(entry)  # padded batch rows (right, or left for the KV export)
    assert (feeds["attention_mask"] == 0).any()
    assert_close(model, out, feeds)


# -- settings, flags, composition ----------------------------------------------------------------

@pytest.mark.parametrize("changes, message", [
    ({"mode": "quaternary"}, "mode="), ({"topk": -1}, "topk="), ({"density_max": 1.5}, "density_max="),
    ({"select": "energy", "topk": 0}, "needs topk > 0"), ({"candidates": 0.5}, "candidates="),
    ({"keep_first": -1}, "keep_first="), ({"pack_cache": 2}, "pack_cache="),
    ({"prefill_select": "fast"}, "prefill_select='fast' must be one of exact, certified, budget"),
    ({"prefill_eps": 1.0}, "prefill_eps=1.0 must be in"), ({"prefill_budget": -1}, "prefill_budget=-1"),
    ({"select": "pages", "candidates": 3.0, "mass_eps": 1.0}, r"mass_eps=1.0 must be in \[0, 1\)"),
    ({"select": "pages", "candidates": 0.0, "mass_eps": 0.1}, "mass_eps=0.1 needs select='pages' with candidates > 0"),
    ({"select": "pages", "candidates": 3.0, "mass_eps": 0.1, "event": 1}, "and event 0"),
    ({"select": "popcount", "mass_eps": 0.1}, "mass_eps=0.1 needs select='pages'"),
])
def test_invalid_settings(changes, message):
    with pytest.raises(ConfigError, match=message):
        AttentionSettings(**changes)


def _args(argv):
    from ortsparse.cli import add_rewrite_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_rewrite_arguments(parser)
    return config_from_args(parser.parse_args(["in.onnx", *argv]))


def test_cli_flags():
    config = _args(["--attn=popcount", "--attn-topk=16", "--attn-mode=ternary", "--attn-eps=0.001",
                    "--attn-min-keys=8", "--attn-density-max=0.2", "--attn-candidates=2", "--attn-keep-first=4",
                    "--attn-keep-recent=8", "--attn-pack-cache=0"])
    assert config.attention == AttentionSettings(mode="ternary", select="popcount", topk=16, min_keys=8, eps=0.001,
                                                 density_max=0.2, candidates=2.0, keep_first=4, keep_recent=8,
                                                 pack_cache=0)
    assert not config.choice("kwta").enabled  # --kwta=auto: off when attention is chosen
    assert _args([]).attention is None
    assert _args(["--attn=off"]).attention is None
    assert _args(["--attn=none"]).attention.select == "none"


@pytest.mark.parametrize("target, expected", [("attn", "energy"), ("both", "energy"), ("mlp", None)])
def test_kwta_target_attn_means_energy_selection(target, expected):
    config = _args(["--kwta=on", f"--kwta-target={target}"])
    assert (config.attention.select if config.attention else None) == expected
    if expected:
        assert "kwta-target" in config.attention_why
    # an explicit --attn wins over the --kwta-target mapping
    assert _args(["--kwta=on", f"--kwta-target={target}", "--attn=off"]).attention is None


def test_composition_popcount_approximate_with_event_driven_refused():
    approximate = AttentionSettings(select="popcount", topk=0)
    with pytest.raises(ConfigError, match="event-driven"):
        popcount.check_composition(approximate, event_on_attention=True)
    popcount.check_composition(approximate, event_on_attention=False)
    popcount.check_composition(AttentionSettings(select="popcount", topk=8), event_on_attention=True)


def test_a_config_made_in_code_is_checked_when_made():
    """The composition check runs once, when the RewriteConfig is made (flags or code alike), not
    again in the rewrite."""
    from ortsparse.graph_rewrite.techniques import EventSettings, TechniqueChoice

    event = {"event": TechniqueChoice(EventSettings(), enabled=True, target="attn")}
    with pytest.raises(ConfigError, match="event-driven"):
        RewriteConfig(techniques=event, attention=AttentionSettings(select="popcount", topk=0))
    assert RewriteConfig(techniques=event, attention=AttentionSettings(select="popcount", topk=8)).attention.topk == 8


@pytest.mark.parametrize("argv, got", [
    (["--attn=popcount"], "select=popcount"), (["--attn=energy"], "select=energy"), (["--attn=none"], "select=none"),
    (["--attn=pages", "--attn-candidates=0"], "select=pages with candidates=0")])
def test_attn_event_where_the_op_would_not_reuse_is_refused_naming_the_core(argv, got, capsys, tmp_path):
    """--attn-event=1 acts only on the budgeted page selector: on a 4-D core that selects otherwise
    it used to be written and do nothing; now one line naming the core, exit 2, nothing written."""
    from ortsparse.cli import main

    path, out = tmp_path / "core.onnx", tmp_path / "out.onnx"
    onnx.save(ag.eager_core(masks=("add",)), path)
    for command in (["-o", str(out)], ["--list-layers"]):
        assert main(["rewrite", str(path), *command, *argv, "--attn-event=1"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "'/attn/MatMul_7' (eager)" in err[0] and "--attn-event=1" in err[0] and got in err[0]
    assert not out.exists()
    assert main(["rewrite", str(path), "-o", str(out), "--attn=pages", "--attn-event=1"]) == 0
    (node,) = pop_nodes(onnx.load(out))
    assert attrs(node)["event"] == 1 and attrs(node)["select"] == b"pages"


def test_cli_list_rules_and_layers(capsys, tmp_path):
    from ortsparse.cli import main

    assert main(["rewrite", "--list-rules"]) == 0
    assert "attention_eager" in capsys.readouterr().out
    path = tmp_path / "core.onnx"
    onnx.save(ag.eager_core(masks=("add",)), path)
    assert main(["rewrite", str(path), "--list-layers", "--attn=energy"]) == 0
    text = capsys.readouterr().out
    assert "attention_eager" in text and "select=energy" in text
    out = tmp_path / "out.onnx"
    assert main(["rewrite", str(path), "-o", str(out), "--attn=none", "--report", str(tmp_path / "r.json")]) == 0
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["attention"][0]["decision"] == "rewritten" and data["exact"]


def test_rewritten_model_still_classifies_attention_layers():
    model = tg.llama_like()
    out, _ = rewrite(model)
    before = [(r.layer_class, r.role) for r in list_layers(model, ATTN_ONLY).layers]
    again = list_layers(out, ATTN_ONLY)
    assert [(r.layer_class, r.role) for r in again.layers] == before
    assert again.attention == []  # PopcountAttention is no candidate for another attention rewrite


def test_ort_optimized_tiny_bert(tmp_path, manifest):
    """onnxruntime.transformers' BERT optimizer on the tiny TorchScript BERT: com.microsoft.Attention
    fed by EmbedLayerNormalization's [B] mask_index; the padded batch row must stay masked."""
    from onnxruntime.transformers import optimizer
    sys.path.insert(0, str(ROOT / "models"))
    from make_tiny_models import reference_inputs

    optimized = optimizer.optimize_model(str(TINY / "bert_tiny.torchscript.onnx"), model_type="bert", num_heads=4,
                                         hidden_size=64, opt_level=0).model
    assert [n.op_type for n in optimized.graph.node].count("Attention") == 2
    if not any(o.domain == ag.MS for o in optimized.opset_import):  # the optimizer leaves it out; ORT does not mind
        optimized.opset_import.append(onnx.helper.make_opsetid(ag.MS, 1))
    out, report = rewrite(optimized)
    assert [r.rule for r in report.attention] == ["attention_ms_attention"] * 2
    assert all(r.rewritten for r in report.attention)
    feeds = reference_inputs(manifest["bert_tiny.torchscript.onnx"])
    assert (feeds["attention_mask"] == 0).any()
    assert_close(optimized, out, feeds)


@pytest.mark.parametrize("select", ["popcount", "energy"])
def test_selection_settings_run_on_the_rewritten_graph(select):
    """Through the rewrite the op's selectors see the original masks: with topk >= every query's
    keys a selector keeps all attendable keys (exact); with topk 2 the output stays finite and the
    padded keys of batch row 1 (masked with -inf) are never attended."""
    model = ag.eager_core(masks=("inf",), tail="nanguard", gqa=True)
    feeds = ag.feeds(model)
    wide = AttentionSettings(select=select, topk=ag.S, min_keys=0)
    out, _ = rewrite(model, RewriteConfig(attention=wide))
    assert_close(model, out, feeds)
    narrow = AttentionSettings(select=select, topk=2, min_keys=0, density_max=1.0)
    out, report = rewrite(model, RewriteConfig(attention=narrow))
    assert not report.exact
    y = run_ortsparse(out, feeds)[0]
    assert np.isfinite(y).all()
    changed = dict(feeds)
    changed["V"] = feeds["V"].copy()
    changed["V"][1, :, ag.S - 2:] = 1e6  # values of the padded keys of row 1
    assert np.array_equal(run_ortsparse(out, changed)[0][1], y[1])


def test_center_and_proj_bits_flags_reach_the_settings():
    settings = _args(["--attn", "popcount", "--attn-proj-bits", "256", "--attn-center", "0"]).attention
    assert settings.attributes()["proj_bits"] == 256 and settings.attributes()["center"] == 0
    # the library reads the same flag values without argparse
    values = {"attn": "popcount", "attn_proj_bits": 256, "attn_center": 0}
    assert config_from_flags(values).attention == settings
    with pytest.raises(ConfigError, match="density_max=0.0 must be in \\(0, 1\\]"):
        popcount.AttentionSettings(density_max=0.0)
