"""Per-layer settings keyed by the survey's layer records (graph_rewrite/layer_settings.py): the layers
handed out are the ones the rewrite takes, and ``node`` entries rewrite exactly as the glob-escaped
``match`` entries the harness used to write (and users' files may still hold)."""
from __future__ import annotations

from pathlib import Path

import onnx
import pytest

from ortsparse.graph_rewrite import KwtaSettings, RewriteConfig, TechniqueChoice, list_layers
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


@pytest.mark.parametrize("path", MODELS)
def test_node_entries_rewrite_exactly_as_escaped_globs(path):
    model = onnx.load(str(TINY / path))
    layers = selected_layers(model, "kwta", "all")
    per_layer = [(layer.name, {"threshold": 0.01 * (i + 1), "k_frac": 1.0, "block": 1})
                 for i, layer in enumerate(layers) if i % 2 == 0]
    entries = override_entries("kwta", per_layer)
    assert entries[0] == {"match": "*", "kwta": "off"} and all("node" in e for e in entries[1:])
    as_globs = [entries[0]] + [{"match": _glob_escape(e["node"]), "kwta": e["kwta"]} for e in entries[1:]]
    new, old = rewritten_with(model, entries), rewritten_with(model, as_globs)
    assert new.SerializeToString() == old.SerializeToString()
    assert sum(n.op_type == "KwtaBlockMatMul" for n in new.graph.node) == len(per_layer)


def test_override_entries_without_a_rest_entry():
    assert override_entries("tt", [("a*", {})], rest=None) == [{"node": "a*", "tt": {}}]
