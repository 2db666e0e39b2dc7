"""Per-layer settings keyed by the survey's layer records (graph_rewrite/layer_settings.py): the layers
handed out are the ones the rewrite takes, and a caller's plan rewrites exactly as its override file
and as the glob-escaped ``match`` entries the harness used to write (and users' files may still hold)."""
from __future__ import annotations

from pathlib import Path

import onnx
import pytest

from ortsparse.graph_rewrite import (ConfigError, KwtaSettings, NodePlan, RewriteConfig, TechniqueChoice, list_layers,
                                     parse_overrides, rewrite_model)
from ortsparse.graph_rewrite.fuse import FUSED_NAME_SEPARATOR
from ortsparse.graph_rewrite.layer_settings import override_entries, rewritten_with, selected_layers

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny"
MODELS = ["llama_tiny.torchscript.onnx", "bert_tiny.torchscript.onnx", "gpt2_tiny.dynamo.onnx",
          "llama_tiny_genai/model.onnx"]


def _glob_escape(name: str) -> str:
    """The escaping the harness's override files used (a user's file may hold such entries)."""
    return "".join(f"[{c}]" if c in "*?[]" else c for c in name)


@pytest.mark.parametrize("path", MODELS)
@pytest.mark.parametrize("target", ["mlp", "both", "all"])
def test_selected_layers_are_the_ones_the_rewrite_reports_rewritten(path, target):
    model = onnx.load(str(TINY / path))
    config = RewriteConfig(techniques={"kwta": TechniqueChoice(KwtaSettings(), enabled=True, target=target)})
    rewritten = [(r.name, r.layer_class, r.role, r.k, r.n) for r in list_layers(model, config).layers
                 if r.rule is not None and r.decision == "rewritten"]
    layers = selected_layers(model, "kwta", target)
    assert rewritten and [(layer.name, layer.layer_class, layer.role, layer.k, layer.n) for layer in layers] == rewritten
    assert all(layer.operands is not None for layer in layers)


@pytest.mark.parametrize("path, target, expected", [
    ("llama_tiny.torchscript.onnx", "mlp", {("mlp", "up"): 4, ("mlp", "down"): 2}),  # 2 blocks x gate, up, down
    ("llama_tiny.torchscript.onnx", "both", {("mlp", "up"): 4, ("mlp", "down"): 2, ("attn", "q"): 2, ("attn", "k"): 2,
                                             ("attn", "v"): 2, ("attn", "out"): 2}),
    ("llama_tiny.torchscript.onnx", "all", {("mlp", "up"): 4, ("mlp", "down"): 2, ("attn", "q"): 2, ("attn", "k"): 2,
                                            ("attn", "v"): 2, ("attn", "out"): 2, ("head", "head"): 1}),
    ("llama_tiny_genai/model.onnx", "both", {("mlp", "up"): 4, ("mlp", "down"): 2, ("attn", "qkv"): 2,
                                             ("attn", "out"): 2}),  # the builder fuses q, k and v
])
def test_selected_layers_are_the_architectures(path, target, expected):
    """What the target selects, against the tiny models' known architecture (2 decoder blocks)."""
    counts: dict[tuple[str, str], int] = {}
    for layer in selected_layers(onnx.load(str(TINY / path)), "kwta", target):
        counts[(layer.layer_class, layer.role)] = counts.get((layer.layer_class, layer.role), 0) + 1
    assert counts == expected


@pytest.mark.parametrize("path", MODELS)
def test_a_plan_rewrites_exactly_as_its_override_file_and_escaped_globs(path):
    """The rewriter takes a caller's plan as data; written out as an override file (``node`` entries,
    or the glob-escaped ``match`` entries the harness used to write) it rewrites byte for byte the same."""
    model = onnx.load(str(TINY / path))
    layers = selected_layers(model, "kwta", "all")
    plan = NodePlan("kwta", {layer.name: {"threshold": 0.01 * (i + 1), "k_frac": 1.0, "block": 1}
                             for i, layer in enumerate(layers) if i % 2 == 0})
    entries = plan.entries()
    assert entries[0] == {"match": "*", "kwta": "off"} and all("node" in e for e in entries[1:])
    as_globs = [entries[0]] + [{"match": _glob_escape(e["node"]), "kwta": e["kwta"]} for e in entries[1:]]
    planned = rewritten_with(model, plan)
    assert planned.SerializeToString() == _rewritten_by_file(model, entries).SerializeToString()
    assert planned.SerializeToString() == _rewritten_by_file(model, as_globs).SerializeToString()
    gated = [n for n in planned.graph.node if n.op_type == "KwtaBlockMatMul"]
    assert sum(len(n.name.split(FUSED_NAME_SEPARATOR)) for n in gated) == len(plan.nodes)


def test_a_plan_naming_no_layer_and_bad_settings_are_refused():
    model = onnx.load(str(TINY / MODELS[0]))
    with pytest.raises(ConfigError, match="plan: node 'nope' is no linear layer"):
        rewritten_with(model, NodePlan("kwta", {"nope": {"k_frac": 0.5}}))
    with pytest.raises(ConfigError, match="plan node 'x': unknown"):
        NodePlan("kwta", {"x": {"k_fraction": 0.5}})


def _rewritten_by_file(model, entries):
    config = RewriteConfig(techniques={"kwta": TechniqueChoice(KwtaSettings(), enabled=False, target="all")},
                           overrides=parse_overrides({"layers": entries}))
    return rewrite_model(model, config)[0]


def test_override_entries_without_a_rest_entry():
    assert override_entries("tt", [("a*", {})], rest=None) == [{"node": "a*", "tt": {}}]
