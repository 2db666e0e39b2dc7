"""ortsparse bench machinery (and ortsparse.runtime's decoder feeds) on the tiny torch exports (correctness of feeds, byte accounting and
report rows; no timing is asserted)."""
from pathlib import Path

import numpy as np
import onnx
import pytest

from ortsparse.graph_rewrite import KwtaSettings, RewriteConfig, TechniqueChoice, rewrite_model
from ortsparse.harness import speed
from ortsparse.runtime import decode_feeds, open_session

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny"
KV = TINY / "llama_tiny_kv.torchscript.onnx"
FULL = TINY / "llama_tiny.torchscript.onnx"


def test_kv_feeds_follow_the_graph():
    feeds = decode_feeds(KV, new_tokens=1, past=12, vocab=256)
    assert feeds["input_ids"].shape == (1, 1)
    assert feeds["attention_mask"].shape == (1, 13)
    assert feeds["position_ids"].tolist() == [[12]]
    assert feeds["past_key_values.0.key"].shape == (1, 2, 12, 16)
    out = open_session(KV).run(None, feeds)
    assert out[0].shape == (1, 1, 256)


def test_prefill_feeds_for_full_export():
    feeds = decode_feeds(FULL, new_tokens=5, past=0, vocab=256)
    assert feeds["input_ids"].shape == (1, 5) and feeds["position_ids"].tolist() == [[0, 1, 2, 3, 4]]


def test_weight_bytes_count_linear_weights_and_keep_ratio():
    model = onnx.load(str(KV))
    dense_bytes = speed.weight_bytes_per_token(model)
    inits = {i.name: i for i in model.graph.initializer}
    expected = sum(int(np.prod(inits[n.input[1]].dims)) * 4 for n in model.graph.node
                   if n.op_type == "MatMul" and n.input[1] in inits)
    assert dense_bytes == expected
    config = RewriteConfig(techniques={"kwta": TechniqueChoice(KwtaSettings(k_frac=0.5), enabled=True, target="mlp")})
    rewritten, report = rewrite_model(model, config)
    gated = {r.name for r in report.rewritten}
    nodes = [n for n in rewritten.graph.node if n.op_type == "KwtaBlockMatMul"]
    assert len(nodes) == len(gated) > 0
    half = speed.weight_bytes_per_token(rewritten, {n.name: 0.5 for n in nodes})
    gated_bytes = sum(int(np.prod({i.name: i for i in rewritten.graph.initializer}[n.input[1]].dims)) * 4 for n in nodes)
    assert half == pytest.approx(dense_bytes - gated_bytes / 2)


def test_bench_rows_cover_every_model_phase_and_context():
    model = onnx.load(str(KV))
    rewritten, _ = rewrite_model(model, RewriteConfig(techniques={"kwta": TechniqueChoice(KwtaSettings(k_frac=0.5), enabled=True, target="mlp")}))
    payload = speed.bench({"dense": model, "ortsparse": rewritten}, {"dense": onnx.load(str(FULL))},
                          contexts=(4, 9), prompt_len=6, threads=(1,), repeats=2, log=lambda *_: None)
    decode = [r for r in payload["rows"] if r["phase"] == "decode"]
    assert {(r["context"], r["model"]) for r in decode} == {(4, "dense"), (4, "ortsparse"), (9, "dense"), (9, "ortsparse")}
    assert all(r["tokens_per_s"] > 0 and r["bound_tokens_per_s"] > 0 for r in decode)
    assert [r["speedup"] for r in decode if r["model"] == "dense"] == [1.0, 1.0]
    ours = [r for r in decode if r["model"] == "ortsparse"]
    dense = [r for r in decode if r["model"] == "dense"]
    assert ours[0]["weight_mb_per_token"] < dense[0]["weight_mb_per_token"]  # measured keep ratio used
    assert [r["model"] for r in payload["rows"] if r["phase"] == "prefill"] == ["dense"]
    text = speed.markdown(payload, "cmd", "title")
    assert text.count("\n| decode") == 4
