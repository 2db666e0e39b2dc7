"""calibrate and sweep machinery on the tiny Llama export (fast, no cache, nothing timed)."""
from pathlib import Path

import numpy as np
import onnx
import pytest

from ortsparse.harness import calibrate, sweep

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny"
FULL = TINY / "llama_tiny.torchscript.onnx"
KV = TINY / "llama_tiny_kv.torchscript.onnx"


@pytest.fixture(scope="module")
def model():
    return onnx.load(str(FULL))


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, 256, size=4096).astype(np.int64)


def test_target_layers_and_groups(model):
    layers = calibrate.target_layers(model, "both")
    assert len(layers) == 14  # 2 decoder layers x (q k v o gate up down)
    groups = [layer.role for layer in layers]
    assert sum(g.endswith("@first") for g in groups) == len({g.split("@")[0] for g in groups})
    assert all(layer.weight_bytes > 0 for layer in layers)


def test_quantiles_are_monotone_and_thresholds_reach_the_op(model, tokens):
    layers = calibrate.target_layers(model, "mlp")
    windows = [tokens[i * 32:(i + 1) * 32] for i in range(2)]
    calibrate.capture_quantiles(model, layers, windows, log=lambda *_: None)
    for layer in layers:
        values = [layer.quantiles[s] for s in calibrate.SPARSITY_GRID]
        assert values == sorted(values) and values[0] >= 0
    sparsity = {layer.name: 0.25 for layer in layers[:3]}
    entries = calibrate.overrides_for(layers, sparsity)
    rewritten = calibrate.rewritten_with(model, entries)
    gated = [n for n in rewritten.graph.node if n.op_type == "KwtaBlockMatMul"]
    assert len(gated) == 3
    thresholds = sorted(a.f for n in gated for a in n.attribute if a.name == "threshold")
    assert thresholds == pytest.approx(sorted(layer.quantiles[0.25] for layer in layers[:3]))


def test_glob_escape_matches_only_the_literal_name():
    import fnmatch
    name = "/model/layers.0/mlp[x]/down*?"
    assert fnmatch.fnmatchcase(name, calibrate.glob_escape(name))
    assert not fnmatch.fnmatchcase("/model/layers.0/mlpx/downab", calibrate.glob_escape(name))


def _fake_layers():
    return [calibrate.TargetLayer(f"l{i}", role, "mlp", "x", 100, {}) for i, role in
            enumerate(["up@first", "down@first", "up", "down", "up", "down"])]


def test_uniform_search_stops_at_the_budget():
    layers = _fake_layers()
    loss = lambda sparsity: sum(sparsity.values()) / len(sparsity)  # mean sparsity
    best, history = calibrate.search(layers, loss, budget=0.2, greedy=False, log=lambda *_: None)
    assert set(best.values()) == {0.2}
    assert history[-1]["loss"] > 0.2


def test_greedy_raises_the_cheapest_groups_within_budget():
    layers = _fake_layers()
    # "down" layers are free, "up" layers cost: greedy should push down, not up.
    loss = lambda sp: sum(v for k, v in sp.items() if int(k[1:]) % 2 == 0)
    best, _ = calibrate.search(layers, loss, budget=0.3, greedy=True, log=lambda *_: None, max_rounds=100)
    downs = [best[f"l{i}"] for i in (1, 3, 5)]
    ups = [best[f"l{i}"] for i in (0, 2, 4)]
    assert min(downs) == max(calibrate.SPARSITY_GRID) and loss(best) <= 0.3 and max(ups) <= 0.3


def test_sweep_points_and_report(tmp_path, model, tokens):
    points = sweep.grid(["mlp"], [1.0, 0.5], [1], ["l2"])
    assert len(points) == 2
    results = sweep.run_sweep(model, onnx.load(str(KV)), tokens, points, windows=1, window_len=32, context=8,
                              steps=2, log=lambda *_: None)
    exact, gated = results
    assert exact["dppl"] == pytest.approx(0.0, abs=1e-6) and exact["top1_agreement"] == 1.0
    assert gated["mean_keep_ratio"] == pytest.approx(0.5, abs=0.02) and gated["top1_agreement"] < 1.0
    png = tmp_path / "s.png"
    sweep.plot(results, str(png), "tiny")
    assert png.stat().st_size > 10_000
    assert sweep.markdown(results, "cmd", str(png)).count("\n| mlp |") == 2
