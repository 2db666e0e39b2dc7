"""tune's layer speed measurement (ortsparse.tuning.layer_speed) and the allocation that values time:
the class graphs hold the model's own layers, the thresholds keep what they say, the curve is
monotone, a class not shown faster is never gated, and a measured unit is valued by its saving.
Times themselves are not asserted (shared, noisy machine): only their structure."""
from pathlib import Path

import numpy as np
import onnx
import pytest

from ortsparse import benchmarking
from ortsparse.calibration import allocation
from ortsparse.runtime import open_session
from ortsparse.tuning import layer_speed, selection

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny"
LLAMA = TINY / "llama_tiny.torchscript.onnx"


@pytest.fixture(scope="module")
def model_units():
    model = onnx.load(str(LLAMA))
    return model, allocation.units_of(allocation.gated_layers(model, "both"))


@pytest.mark.parametrize("keep", layer_speed.KEEPS)
def test_the_threshold_keeps_that_fraction(keep):
    row = np.random.default_rng(3).standard_normal((1, 1, 576)).astype(np.float32)
    kept = np.abs(row) >= layer_speed.keep_threshold(row, keep)
    assert kept.sum() == round(keep * row.size)


def test_classes_group_units_by_ops_and_shapes(model_units):
    model, units = model_units
    classes = layer_speed.speed_classes(model, units)
    # tiny llama: qkv, o, gate+up, down, twice each -> four classes of two units
    assert sorted(len(members) for members in classes.values()) == [2, 2, 2, 2]
    assert all(len(signature) == len(members[0].layers) for signature, members in classes.items())


def test_the_class_graph_is_the_units_own_layers_and_computes_them(model_units):
    model, units = model_units
    signature, members = next((s, m) for s, m in layer_speed.speed_classes(model, units).items() if len(s) == 3)
    graph = layer_speed.class_model(model, members)
    assert [node.name for node in graph.graph.node] == [layer.name for unit in members for layer in unit.layers]
    assert [i.name for i in graph.graph.input] == [unit.input_name for unit in members]  # each unit its own X
    row = np.random.default_rng(0).standard_normal((1, 1, members[0].layers[0].weight.shape[0])).astype(np.float32)
    outputs = open_session(graph).run(None, {unit.input_name: row for unit in members})
    expected = [row[0] @ layer.weight for unit in members for layer in unit.layers]
    for got, want in zip(outputs, expected):
        np.testing.assert_allclose(got.reshape(want.shape), want, rtol=1e-4, atol=1e-5)


def test_a_node_reading_a_computed_weight_is_not_measured(model_units):
    model, units = model_units
    broken = onnx.ModelProto()
    broken.CopyFrom(model)
    target = units[0].layers[0].name
    node = next(n for n in broken.graph.node if n.name == target)
    node.input[1] = "computed_weight"  # no initializer of that name
    (speed,) = layer_speed.measure_classes(broken, [(("x",), units[:1])], seconds=0.0)
    assert not speed.measured and "not a constant initializer" in speed.note
    assert speed.break_even is None


def test_a_class_gets_a_monotone_curve_and_a_test_per_keep(model_units):
    model, units = model_units
    signature, members = next(iter(layer_speed.speed_classes(model, units).items()))
    (speed,) = layer_speed.measure_classes(model, [(signature, members)], seconds=0.0, min_rounds=7)
    assert speed.measured and speed.rounds >= 7 and speed.units == len(members)
    assert set(speed.ours_us) == set(speed.monotone_us) == set(speed.p_values) == set(layer_speed.KEEPS)
    curve = [speed.monotone_us[k] for k in sorted(speed.monotone_us)]
    assert curve == sorted(curve) and all(0.0 < p <= 1.0 for p in speed.p_values.values())
    record = speed.to_dict()
    assert record["input_us"] > 0 and set(record["sign_test_p"]) == {f"{k:g}" for k in layer_speed.KEEPS}


def test_every_class_is_timed_in_one_rotation(model_units, monkeypatch):
    # A decode step's weights come from memory because the other layers' pass between two uses of a
    # layer's: the classes' sessions rotate together, each class's input paired with its own keeps.
    model, units = model_units
    classes = list(layer_speed.speed_classes(model, units).items())
    calls = []
    real_alternate = benchmarking.alternate

    def spy(runners, **kwargs):
        calls.append((set(runners), kwargs.get("before")))
        return real_alternate(runners, **kwargs)

    monkeypatch.setattr(benchmarking, "alternate", spy)
    flushes = []
    monkeypatch.setattr(benchmarking, "cache_flusher", lambda: lambda: flushes.append(1))
    records = layer_speed.measure_classes(model, classes, seconds=0.0, min_rounds=3)
    assert len(calls) == 1  # one rotation, not one per class
    runners, before = calls[0]
    assert runners == {(i, key) for i in range(len(classes)) for key in ("input", *layer_speed.KEEPS)}
    assert [r.signature for r in records] == [" + ".join(signature) for signature, _ in classes]
    assert all(r.measured and r.rounds >= 3 for r in records)
    # The tiny model's rotation fits in the cache: every run is preceded by a flush after all.
    assert before is not None and len(flushes) == len(runners) * records[0].rounds


def test_a_large_rotation_runs_without_a_flush(model_units, monkeypatch):
    model, units = model_units
    classes = list(layer_speed.speed_classes(model, units).items())[:1]
    monkeypatch.setattr(benchmarking, "cache_flush_bytes", lambda: 0)  # as if the weights dwarfed the cache
    monkeypatch.setattr(benchmarking, "cache_flusher", lambda: pytest.fail("flushed a rotation larger than the cache"))
    (record,) = layer_speed.measure_classes(model, classes, seconds=0.0, min_rounds=3)
    assert record.measured


def test_an_unmeasurable_class_keeps_its_place_among_the_records(model_units):
    model, units = model_units
    broken = onnx.ModelProto()
    broken.CopyFrom(model)
    classes = list(layer_speed.speed_classes(model, units).items())
    node = next(n for n in broken.graph.node if n.name == classes[1][1][0].layers[0].name)
    node.input[1] = "computed_weight"
    records = layer_speed.measure_classes(broken, classes, seconds=0.0, min_rounds=3)
    assert [r.measured for r in records] == [True, False] + [True] * (len(classes) - 2)


def _speed(input_us, ours, p):
    keeps = sorted(ours)
    monotone = dict(zip(keeps, selection.non_decreasing([ours[k] for k in keeps]).tolist()))
    return layer_speed.ClassSpeed("c", 2, input_us, dict(ours), 20, "", monotone, {k: p for k in keeps})


def test_saving_break_even_and_the_evidence_rule():
    shown = _speed(100.0, {0.25: 40.0, 0.5: 60.0, 0.75: 90.0, 1.0: 110.0}, p=0.001)
    grid = np.asarray(allocation.GRID)
    saving = shown.saving(grid)
    assert saving[0] == pytest.approx(-10.0)  # keep 1: ours slower dense
    assert shown.break_even == pytest.approx(0.13)  # 100 us at keep 0.875; the first 1% step past it
    assert saving[grid.tolist().index(0.5)] == pytest.approx(40.0)
    assert saving[-1] == pytest.approx(60.0)  # below the lowest keep measured: held flat
    unproven = _speed(100.0, {0.25: 40.0, 0.5: 60.0, 0.75: 90.0, 1.0: 110.0}, p=0.2)
    assert np.all(unproven.saving(grid) <= 0.0) and unproven.break_even is None


def _units(savings, scale=1.0):
    units = []
    for i, saving in enumerate(savings):
        layer = allocation.GatedLayer(f"l{i}", "q", "attn", 0, f"x{i}", np.zeros((4, 4), np.float32), 1000)
        unit = allocation.Unit(f"x{i}", [layer])
        unit.error = np.asarray(unit.grid) ** 2
        unit.scale = scale
        unit.saving = saving
        units.append(unit)
    return units


def test_the_allocation_values_measured_time_and_never_gates_where_it_does_not_pay():
    grid = np.asarray(allocation.GRID)
    pays = 50.0 * grid + 5.0  # our dense kernel is faster: every sparsity saves
    never = -10.0 + 0.0 * grid  # slower at every sparsity
    late = 100.0 * (grid - 0.3)  # pays from 30%
    units = _units([pays, never, late])
    for mu in (0.01, 0.1, 1.0, 10.0, 1000.0):
        choice = allocation.allocate(units, mu, floor=0.5)  # the byte model's floor does not apply
        assert choice["x1"] == 0
        assert choice["x2"] == 0 or grid[choice["x2"]] > 0.3
    rich = allocation.allocate(units, 1000.0)
    assert grid[rich["x0"]] > 0.0 and grid[rich["x2"]] > 0.3
    small = allocation.allocate(units, 0.05)
    assert 0.0 < grid[small["x0"]] < 0.1  # gated a little: the measured time says even that pays here


def test_the_byte_model_stays_when_a_unit_is_unmeasured():
    units = _units([np.ones(len(allocation.GRID)), None])
    choice = allocation.allocate(units, 0.5, floor=0.2)
    grid = np.asarray(allocation.GRID)
    assert all(grid[j] == 0 or grid[j] >= 0.2 for j in choice.values())
