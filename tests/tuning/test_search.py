"""The path tune measures (ortsparse.tuning.search.walk) on synthetic units whose real loss is far
below their predicted loss (as on SmolLM2): the walk extends until it finds the cliff, stops once a
point is clearly over, and refines the gap at the choice."""
import math

import numpy as np

from ortsparse.calibration import allocation
from ortsparse.tuning import search, selection


class Layer:
    def __init__(self, name):
        self.name = name


def synthetic(units_count=12, windows=10, cliff=0.45, seed=0):
    rng = np.random.default_rng(seed)
    layers, units = [], []
    for i in range(units_count):
        layer = Layer(f"layer{i}")
        unit = allocation.Unit(f"x{i}", [layer])
        grid = np.asarray(unit.grid)
        unit.thresholds = {layer.name: grid.copy()}  # the threshold encodes the sparsity
        unit.error = grid ** 2 * (1 + i / units_count)
        unit.scale = 0.05  # predicted loss ~10x the real one below
        layer.weight_bytes = 1000 * (1 + i % 3)
        layers.append(layer)
        units.append(unit)
    prepared = allocation.Prepared(None, "l2", layers, units, None, {})
    window_effect = rng.normal(0, 1, windows)
    calls = []

    def window_loss(thresholds):
        total = sum(layer.weight_bytes for layer in layers)
        skipped = sum(layers[i].weight_bytes * s for i, s in thresholds.items()) / total
        calls.append(skipped)
        true = 0.002 * skipped / cliff + (0.05 * (skipped - cliff) / 0.05 if skipped > cliff else 0.0)
        return true + 0.004 * (0.3 + skipped) * (window_effect + 0.5 * rng.normal(0, 1, windows))

    return prepared, window_loss, calls


def test_the_walk_finds_the_cliff_past_a_pessimistic_prediction_and_refines_there():
    prepared, window_loss, calls = synthetic()
    points = search.walk(prepared, window_loss, 0.02, np.zeros(10), check_windows=6, log=lambda s: None)
    skipped = [p.skipped for p in points]
    assert skipped == sorted(skipped) and points[0].label == "dense"
    assert max(skipped) > 0.45  # extended beyond the predicted path until over the cliff
    chosen = selection.choose(np.stack([p.losses for p in points]), 0.02, check_windows=6)
    assert chosen.index is not None and 0.3 < points[chosen.index].skipped <= 0.45
    after = points[chosen.index + 1].skipped - points[chosen.index].skipped
    assert after < 0.1  # a point close above the choice: the refinement measured the gap
    assert len(calls) == len(points) - 1  # every point measured once (the dense one was given)
    assert all(u.grid[c] == 0 or u.grid[c] >= search.MIN_PAYING_SPARSITY
               for p in points for u, c in zip(prepared.units, p.choice.values()))


def test_the_walk_stops_once_clearly_over():
    prepared, window_loss, _ = synthetic(cliff=0.12)
    points = search.walk(prepared, window_loss, 0.02, np.zeros(10), check_windows=6, log=lambda s: None)
    over = [p for p in points if math.expm1(p.losses.mean()) > 0.05]
    assert len(over) <= 2


def test_the_forecast_is_the_allocation_the_probes_place_at_the_budget():
    prepared, _, _ = synthetic()
    units = prepared.units
    forecasts = [search.forecast(units, budget) for budget in (0.005, 0.02, 0.1)]
    assert 0.0 < forecasts[0] < forecasts[1] < forecasts[2] <= 0.9
    mu = allocation.price_for(units, math.log1p(0.02), floor=search.MIN_PAYING_SPARSITY)
    choice = allocation.allocate(units, mu, floor=search.MIN_PAYING_SPARSITY)
    assert allocation.predicted_loss(units, choice) <= math.log1p(0.02)
    assert forecasts[1] == allocation.skipped_fraction(units, choice)
