"""The rewriter on real torch exports (models/tiny/*.onnx: TorchScript and dynamo exporters, eager,
SDPA, opset-23 Attention, KV cache). Skipped when the files are absent."""
from __future__ import annotations

import collections
import json
from pathlib import Path

import onnx
import onnx_ir as ir
import pytest

from configs import kwta
from ort_run import kwta_nodes
from ortsparse.graph_rewrite import load_model, rewrite_model
from ortsparse.verify import EXACT_BUDGET, verify_models

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny"
MANIFEST = TINY / "manifest.json"
FILES = sorted(p.name for p in TINY.glob("*.onnx")) if TINY.is_dir() else []


def _expected(entry: dict) -> dict[tuple[str, str], int]:
    config = entry["config"]
    layers = config.get("n_layer") or config.get("num_hidden_layers")
    if entry["family"] == "gpt2":
        return {("attn", "qkv"): layers, ("attn", "out"): layers, ("mlp", "up"): layers,
                ("mlp", "down"): layers, ("head", "head"): 1}
    attention = {("attn", r): layers for r in ("q", "k", "v", "out")}
    if entry["family"] == "bert":
        return {**attention, ("mlp", "up"): layers, ("mlp", "down"): layers, ("other", "other"): 1}
    return {**attention, ("mlp", "up"): 2 * layers, ("mlp", "down"): layers, ("head", "head"): 1}


@pytest.fixture(scope="module")
def manifest() -> dict:
    return json.loads(MANIFEST.read_text())["files"]


@pytest.mark.parametrize("name", FILES)
def test_tiny_export(name, manifest):
    entry = manifest[name]
    model = load_model(TINY / name)
    model, report = rewrite_model(model, kwta("all", k_frac=1.0))
    counts = collections.Counter((r.layer_class, r.role) for r in report.layers)
    assert dict(counts) == _expected(entry)
    assert not report.skipped, report.layer_table()
    assert report.attention_cores == entry["config"].get("n_layer", entry["config"].get("num_hidden_layers"))
    proto = ir.to_proto(model)
    onnx.checker.check_model(proto, full_check=True)
    assert len(kwta_nodes(proto)) == len(report.layers)
    assert {n.op_type for n in proto.graph.node}.isdisjoint({"Gemm"})
    result = verify_models(TINY / name, proto, runs=1, budget=EXACT_BUDGET)
    assert result.passed, result.format()

