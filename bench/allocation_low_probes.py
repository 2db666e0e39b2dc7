"""Second probes below the 2% one (output error ~0.4%, a third of each class and the head) and the
allocation with loss ~ error^p through both probes (the class's median p for units not probed
twice), measured at equal skipped bytes as bench/allocation_probe_strategies.py does (its OUT,
whose probe1.json it reads; writes OUT/probe_low.json, OUT/exponents.json, appends OUT/points.jsonl).

    python bench/allocation_low_probes.py INT8 FP32 first60.txt OUT [WINDOWS=4] [ERROR=0.004]
"""
import json
import sys
from pathlib import Path

import numpy as np

from allocation_experiment import load_probes, log, measure_at, power_curve, set_up
from ortsparse.calibration import allocation

CLASSES = ("qkv", "o_proj", "gate", "down", "lm_head")


def layer_class(unit) -> str:
    return next((c for c in CLASSES if c in unit.name), "other")


def low_probes(experiment, rows: list[dict], error: float) -> dict[str, dict]:
    """A second probe where the unit's output error first reaches ``error``, for every third unit of
    each class: {unit name: {sparsity, error, loss}}."""
    units, layers, grid = experiment.units, experiment.prepared.layers, np.asarray(allocation.GRID)
    seen, probes = {}, {}
    for unit, row in zip(units, rows):
        seen[layer_class(unit)] = seen.get(layer_class(unit), -1) + 1
        if seen[layer_class(unit)] % 3:
            continue  # the class's median exponent for the rest
        j1 = int(np.argmin(np.abs(grid - unit.probe["sparsity"])))
        below = [j for j in range(1, j1) if unit.error[j] >= error]
        j2 = int(below[0]) if below else max(1, j1 - 4)
        loss = experiment.probe_loss(allocation.thresholds_for(units, layers, {unit.input_name: j2}))
        probes[unit.name] = row["probe_low"] = {"sparsity": float(grid[j2]), "error": float(unit.error[j2]),
                                                "loss": float(loss)}
        log(f"low probe {unit.name}: sparsity {grid[j2]} error {unit.error[j2]:.5f} KL {loss:.5f} "
            f"(2% probe: sparsity {unit.probe['sparsity']} KL {unit.probe['loss']:.5f})")
    return probes


def exponents(units, probes: dict[str, dict]) -> dict[str, float]:
    """p of loss ~ error^p per unit: through both probes, else the median of its class's."""
    fitted = {u.name: allocation.loss_exponent(probes[u.name], u.probe) for u in units if u.name in probes}
    by_class = {}
    for unit in units:
        if unit.name in fitted:
            by_class.setdefault(layer_class(unit), []).append(fitted[unit.name])
    return {u.name: fitted.get(u.name, float(np.median(by_class.get(layer_class(u), [1.0])))) for u in units}


def main(argv: list[str]) -> int:
    model, reference, text, out = argv[0], argv[1], argv[2], Path(argv[3])
    windows = int(argv[4]) if len(argv) > 4 else 4
    error = float(argv[5]) if len(argv) > 5 else 0.004
    experiment = set_up(model, reference, text, out, windows, probe=False)
    units = experiment.units
    rows = load_probes(units, out / "probe1.json")
    log(f"second probes at output error {error}")
    probes = low_probes(experiment, rows, error)
    (out / "probe_low.json").write_text(json.dumps(rows))
    p = exponents(units, probes)
    log("exponents: " + " ".join(f"{layer_class(u)}:{p[u.name]:.2f}" for u in units))
    (out / "exponents.json").write_text(json.dumps([{"name": u.name, "p": p[u.name], "low": probes.get(u.name)}
                                                    for u in units]))
    power = {id(u): power_curve(u, p[u.name]) for u in units}
    for strategy, pool, fraction in (("power-all", units, 0.2), ("power-body", experiment.body, 0.15),
                                     ("power-all", units, 0.15), ("power-all", units, 0.25)):
        measure_at(experiment, strategy, pool, fraction, power, out / "points.jsonl")
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
