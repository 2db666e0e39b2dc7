"""Per-layer sparsity allocation (ortsparse.calibration.allocation) on the tiny exports: the probe graph
computes what KwtaBlockMatMul computes, the curves and the Lagrangian behave, and the library
function and the `calibrate --method allocated` hook run end to end (fast, no cache, nothing timed)."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from ortsparse.graph_rewrite.fuse import FUSED_NAME_SEPARATOR
from ortsparse.calibration import allocation
from ortsparse.runtime import lm_feeds, open_session

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny"
LLAMA = TINY / "llama_tiny.torchscript.onnx"
BERT = TINY / "bert_tiny.torchscript.onnx"


@pytest.fixture(scope="module")
def model():
    return onnx.load(str(LLAMA))


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, 256, size=4096).astype(np.int64)


@pytest.fixture(scope="module")
def units(model, tokens):
    layers = allocation.gated_layers(model, "both")
    units = allocation.units_of(layers)
    inputs = allocation.capture_inputs(model, units, [tokens[i * 64:(i + 1) * 64] for i in range(4)], max_rows=256)
    for score in allocation.SCORES:
        copies = allocation.units_of(layers)
        allocation.measure_curves(copies, inputs, score)
        if score == "l2":
            units = copies
        else:
            weighted = copies
    return layers, units, weighted


def test_layers_and_units(model):
    layers = allocation.gated_layers(model, "both")
    assert len(layers) == 14  # 2 decoder layers x (q k v o gate up down)
    assert [len(u.layers) for u in allocation.units_of(layers)] == [3, 1, 2, 1] * 2  # qkv, o, gate+up, down
    assert {layer.block_index for layer in layers} == {0, 1}
    head = [layer for layer in allocation.gated_layers(model, "all") if layer.role == "head"]
    assert len(head) == 1 and head[0].weight.shape[0] == layers[0].weight.shape[0]


@pytest.mark.parametrize("score", allocation.SCORES)
def test_probe_graph_computes_what_the_op_computes(model, tokens, units, score):
    layers, plain, weighted = units
    curves = plain if score == "l2" else weighted
    choice = {unit.input_name: 12 for unit in curves[::2]}  # every other unit at 30%
    thresholds = allocation.thresholds_for(curves, layers, choice)
    probe = allocation.ProbeSession(model, layers, score)
    window = tokens[:64]
    dense = open_session(model).run(["logits"], lm_feeds(open_session(model), window))[0]
    assert np.array_equal(probe.run({}, window), dense)  # all thresholds 0: the dense model
    found = allocation.Allocation(score, layers, curves, choice, 0.0, 0.0, [], {})
    rewritten = allocation.rewritten_with(model, found.plan())
    gated = [n for n in rewritten.graph.node if n.op_type == "KwtaBlockMatMul"]
    assert len(gated) == sum(len(unit.layers) for unit in curves[::2])
    session = open_session(rewritten)
    op = session.run(["logits"], lm_feeds(session, window))[0]
    mine = probe.run(thresholds, window)
    assert not np.allclose(mine, dense, atol=1e-3)
    assert np.abs(mine - op).max() <= 1e-4 * np.abs(dense).max()


def test_curves_are_monotone(units):
    _, plain, weighted = units
    for unit in plain + weighted:
        assert unit.error[0] == 0.0 and np.all(np.diff(unit.error) >= -1e-9) and unit.error[-1] > 0
        for thresholds in unit.thresholds.values():
            assert thresholds[0] == 0.0 and np.all(np.diff(thresholds) >= 0)


def _fake_units(scales):
    grid = allocation.GRID
    result = []
    for i, scale in enumerate(scales):
        layer = allocation.GatedLayer(f"l{i}", "up", "mlp", 0, f"x{i}", np.zeros((2, 2), np.float32), 100)
        unit = allocation.Unit(f"x{i}", [layer], grid)
        unit.error = np.asarray(grid) ** 2
        unit.thresholds = {layer.name: np.asarray(grid, np.float32)}
        unit.scale = scale
        result.append(unit)
    return result


def test_lagrangian_spares_sensitive_units_and_grows_with_the_price():
    units = _fake_units([1.0, 10.0, 1.0])
    choice = allocation.allocate(units, 0.5)
    assert choice["x1"] < choice["x0"] == choice["x2"]
    skipped = [allocation.skipped_fraction(units, allocation.allocate(units, mu)) for mu in (0.05, 0.5, 5.0)]
    assert skipped == sorted(skipped) and skipped[0] < skipped[-1]
    assert allocation.allocate(units, 5.0, cap=0.3)["x0"] == allocation.GRID.index(0.3)


def test_two_probes_fit_the_curve_a_straight_line_misses():
    units = _fake_units([0.0, 0.0])  # error = s^2; the scales come from the probes
    layers = [unit.layers[0] for unit in units]
    # True loss: unit 0 linear in its error, unit 1 grows with the error cubed (steep past the probe).
    powers = {0: 1.0, 1: 3.0}

    def probe_loss(thresholds):  # the fake thresholds are the grid sparsities
        return sum(0.5 * (t ** 2) ** powers[i] for i, t in thresholds.items() if t > 0)

    allocation.probe_units(units, layers, probe_loss, level=0.02, second_level=0.08)
    assert [round(u.exponent, 2) for u in units] == [1.0, 3.0]
    assert all(u.second_probe["sparsity"] > u.probe["sparsity"] for u in units)
    below = _fake_units([0.0, 0.0])
    allocation.probe_units(below, layers, probe_loss, level=0.02, second_level=0.005)  # a probe below the first
    assert all(u.second_probe["sparsity"] < u.probe["sparsity"] for u in below)
    assert [round(u.exponent, 2) for u in below] == [1.0, 3.0]
    for unit in units:  # the fitted curve passes through both probes
        for probe in (unit.probe, unit.second_probe):
            j = allocation.GRID.index(probe["sparsity"])
            assert unit.loss()[j] == pytest.approx(probe["loss"], rel=1e-6)
    truth = [0.5 * np.asarray(u.error) ** powers[i] for i, u in enumerate(units)]
    assert np.allclose(units[1].loss(), truth[1], rtol=1e-6)
    straight = allocation.Unit("x", units[1].layers, units[1].grid, error=units[1].error, scale=units[1].scale,
                               probe=units[1].probe)
    assert straight.loss()[-1] < 0.1 * truth[1][-1]  # one probe, a line: far under where the curve steepens


def test_the_exponent_is_one_where_two_probes_cannot_tell():
    near = {"error": 0.02, "loss": 0.01}
    assert allocation.loss_exponent(near, {"error": 0.0201, "loss": 0.05}) == 1.0  # errors too close
    assert allocation.loss_exponent(near, {"error": 0.08, "loss": 0.0}) == 1.0  # no loss measured
    assert allocation.loss_exponent(near, {"error": 0.08, "loss": 0.04}) == pytest.approx(1.0)
    assert allocation.loss_exponent(near, {"error": 0.08, "loss": 100.0}) == allocation.EXPONENT_RANGE[1]


def test_bisection_meets_the_budget_with_the_true_loss():
    units = _fake_units([1.0, 3.0, 0.5, 2.0])
    layers = [unit.layers[0] for unit in units]
    # The true loss is twice the prediction: the search must follow the measurement.
    by_name = {layer.name: unit for unit, layer in zip(units, layers)}

    def true_loss(thresholds):
        return 2 * sum(by_name[layers[i].name].scale * t ** 2 for i, t in thresholds.items())

    choice, history = allocation.bisect_price(units, layers, true_loss, budget=0.1, steps=10, log=lambda *_: None)
    assert true_loss(allocation.thresholds_for(units, layers, choice)) <= 0.1
    # Best uniform sparsity under the true loss: 2 * 6.5 * s^2 <= 0.1 -> 0.075 on the grid; the optimum ~0.109.
    assert allocation.skipped_fraction(units, choice) > 0.075 and len(history) == 10
    assert any(h["loss"] > 0.1 for h in history)  # it looked beyond the budget


def test_allocate_lm_end_to_end(model, tokens):
    result = allocation.allocate_lm(model, tokens, max_dppl=0.05, windows=2, window_len=64, steps=4,
                                    log=lambda *_: None)
    assert result.calibration_loss <= result.budget == pytest.approx(0.75 * 0.05)
    assert 0.0 < result.skipped_fraction() < 0.9
    plan = result.plan()
    assert plan.rest == "off" and plan.entries()[0] == {"match": "*", "kwta": "off"}
    rewritten = allocation.rewritten_with(model, plan)
    assert sum(n.op_type == "KwtaBlockMatMul" for n in rewritten.graph.node) == len(plan.nodes)
    report = result.report()
    assert len(report["units"]) == 8 and all(u["probe"] for u in report["units"])
    json.dumps(report, default=float)


def test_allocate_encoder_end_to_end():
    model = onnx.load(str(BERT))
    rng = np.random.default_rng(1)
    ids = rng.integers(1, 100, size=(8, 12)).astype(np.int64)
    mask = np.ones_like(ids)
    mask[::2, 9:] = 0
    batches = [{"input_ids": ids[:4], "attention_mask": mask[:4]}, {"input_ids": ids[4:], "attention_mask": mask[4:]}]
    result = allocation.allocate_encoder(model, batches, min_cosine=0.99, steps=3, log=lambda *_: None)
    assert result.calibration_loss <= result.budget
    assert all(unit.probe for unit in result.units)


def test_bytes_summary_weights_by_layer_size(model):
    layers = allocation.gated_layers(model, "both")
    metrics = {"nodes": {layers[0].name: 0.5, layers[-1].name: 1.0}}
    summary = allocation.bytes_summary(model, metrics)
    gated = layers[0].weight_bytes + layers[-1].weight_bytes
    assert summary["gated_weight_bytes"] == gated
    assert summary["skipped_fraction_of_gated"] == pytest.approx(0.5 * layers[0].weight_bytes / gated)
    assert summary["skipped_fraction_of_all"] < summary["skipped_fraction_of_gated"]


def test_calibrate_allocated_command(tmp_path, tokens):
    token_file = tmp_path / "tokens.npy"
    np.save(token_file, tokens)
    out = tmp_path / "cfg.json"
    command = [sys.executable, "-m", "ortsparse.cli", "calibrate", str(LLAMA), "-o", str(out), "--tokens",
               str(token_file), "--method", "allocated", "--calib-windows", "2", "--eval-windows", "2",
               "--window-len", "64", "--max-dppl", "0.05"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode in (0, 1), done.stderr
    entries = json.loads(out.read_text())["layers"]
    assert entries[0] == {"match": "*", "kwta": "off"} and len(entries) > 1
    report = json.loads(out.with_suffix(".report.json").read_text())
    assert report["method"] == "allocated" and "dppl" in report["held_out"]
    assert 0.0 < report["bytes"]["skipped_fraction_of_gated"] < 1.0
    assert (done.returncode == 0) == (report["held_out"]["dppl"] <= 0.05)


def test_allocation_on_matmulnbits_weights(model, tokens, tmp_path):
    """A quantized model (ORT's MatMulNBits, as onnxruntime-genai's int8/int4 graphs) is allocated
    on the weights its gate will see: the dequantized MatMulNBits tensors, bytes as stored."""
    from ortsparse.zoo.baselines import quantize_matmul_nbits

    quantized_path = tmp_path / "llama_tiny.int8.onnx"
    quantize_matmul_nbits(LLAMA, quantized_path, bits=8, block_size=32, accuracy_level=4)
    quantized = onnx.load(str(quantized_path))
    assert sum(node.op_type == "MatMulNBits" for node in quantized.graph.node) >= 14
    fp32 = {layer.name: layer for layer in allocation.gated_layers(model, "both")}
    layers = allocation.gated_layers(quantized, "both")
    assert len(layers) == 14
    for layer in layers:
        dense = fp32[layer.name.removesuffix("_Q8")]  # ORT's quantizer renames MatMul -> MatMul_Q8
        k, n = dense.weight.shape
        assert layer.weight.shape == (k, n)
        scale = np.abs(dense.weight).max()
        assert np.abs(layer.weight - dense.weight).max() <= scale / 127 + 1e-6  # int8 block quantization error
        assert k * n <= layer.weight_bytes < 2 * k * n  # one byte per weight + scales
    result = allocation.allocate_lm(quantized, tokens, max_dppl=0.05, windows=2, window_len=64, steps=4,
                                    reference=model, log=lambda *_: None)
    assert result.calibration_loss <= result.budget
    rewritten = allocation.rewritten_with(quantized, result.plan())
    gated = [n for n in rewritten.graph.node if n.op_type == "KwtaBlockMatMul"]
    assert all(len(n.input) >= 3 for n in gated)  # quantized form
    # Every entry's layer is gated (gate_proj + up_proj and q/k/v fused into one node each).
    assert sum(len(n.name.split(FUSED_NAME_SEPARATOR)) for n in gated) == len(result.plan().nodes)
    # The quantized head is not gated but runs dense on our kernel; an fp32 head stays where it is.
    heads = [n.name for n in quantized.graph.node if n.op_type == "MatMulNBits" and "lm_head" in n.name]
    assert heads and result.dense_on_ours == heads
    head = next(n for n in rewritten.graph.node if n.name == heads[0])
    assert head.op_type == "KwtaBlockMatMul"
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in head.attribute}
    assert attributes["k_frac"] == 1.0 and attributes.get("threshold", 0.0) == 0.0
    assert allocation.dense_quantized_heads(model) == []
