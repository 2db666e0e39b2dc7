"""The set-up and the measured allocation the Gemma-3 allocation experiments share
(bench/allocation_probe_strategies.py, allocation_low_probes.py, allocation_write_checked.py; docs/results.md
"Where the budget goes on Gemma-3-270M"): tune's window plan of a text, cut to windows of 256 positions
(the experiments ran on a loaded machine), the allocation's curves on 8 calibration windows, the loss
on the first WINDOWS calibration windows against the reference, and an allocation hitting a target
share of a pool's bytes measured on them."""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ortsparse.calibration import allocation
from ortsparse.measure.corpus import first_scored
from ortsparse.measure.perplexity import perplexity
from ortsparse.measure.source import open_model
from ortsparse.measure.text import resolve_bos, tokenize_file
from ortsparse.runtime import open_session
from ortsparse.tuning.tune import plan_text, resolve_inputs, with_bos

WINDOW_LEN = 256  # shorter than tune's 512: the experiments' cost on a loaded machine
CURVE_WINDOWS = 8
FLOOR = 0.1  # no unit gated below 10%, as tune


def log(line: str) -> None:
    print(time.strftime("%H:%M:%S"), line, flush=True)


def is_head(unit: allocation.Unit) -> bool:
    return any(layer.layer_class == "head" for layer in unit.layers)


@dataclass
class Experiment:
    """The models, the window plan and the prepared allocation (units with curves, probe session)."""
    source: Any
    reference: Any
    bos: Any
    plan: Any
    prepared: Any
    loss: allocation.LmLoss  # window losses against the reference on the first `windows` calibration windows
    probe_loss: Callable[[Mapping[int, float]], float]  # KL on the probe window, as tune probes

    @property
    def units(self) -> list:
        return self.prepared.units

    @property
    def body(self) -> list:
        return [unit for unit in self.units if not is_head(unit)]

    def windows(self, rows: np.ndarray) -> np.ndarray:
        """Rows of the plan cut to WINDOW_LEN positions, with the BOS where the model has one."""
        return with_bos(rows[:, :WINDOW_LEN - (self.bos.id is not None)], self.bos.id)


def set_up(model: str, reference_path: str, text: str, out: Path, windows: int, *, probe: bool = True,
           scored: str = "calibration") -> Experiment:
    """Opens both models, plans the text as tune does, and prepares the allocation (target all: the
    head a candidate). ``probe=False`` skips the per-unit probes (loaded from a file afterwards);
    ``scored``: the plan's rows the loss is measured on ("calibration", or "check": tune's held-out parts)."""
    source, reference = open_model(model), open_model(reference_path)
    bos = resolve_bos("auto", model, None, source.vocabulary)
    inputs = resolve_inputs(source, tokenize_file(text, source.tokenizer), out / "inputs", reference=reference,
                            windows=10, bos=bos)
    session = open_session(reference.decoder)
    plan = plan_text(inputs, session, log).plan
    experiment = Experiment(source, reference, bos, plan, None, None, None)
    rows = getattr(plan, scored)[:windows]
    base = perplexity(reference, rows[:, :WINDOW_LEN - (bos.id is not None)].reshape(-1), windows, WINDOW_LEN,
                      session=session, bos=bos)["window_nll"]
    del session
    prepare = allocation.prepare_lm if probe else _prepare_without_probes
    experiment.prepared = prepare(source, experiment.windows(plan.calibration[:CURVE_WINDOWS]),
                                  experiment.windows(plan.probe), target="all", log=log)
    experiment.loss = allocation.LmLoss(experiment.prepared.session, experiment.windows(rows),
                                        keep_logprobs=False, baseline_nll=base, first=first_scored(bos.id))
    experiment.probe_loss = allocation.LmLoss(experiment.prepared.session, experiment.windows(plan.probe),
                                              keep_logprobs=True, first=first_scored(bos.id)).kl
    dense = math.expm1(float((experiment.loss.dense_window_nll - base).mean()))
    log(f"the input alone vs the reference: {dense:+.4f} dppl")
    (out / f"dense_{scored}.json").write_text(json.dumps({"dense_dppl": dense, "windows": windows,
                                                          "window_len": WINDOW_LEN}))
    return experiment


def _prepare_without_probes(*args, **kwargs):
    probe_units = allocation.probe_units
    allocation.probe_units = lambda *a, **k: None  # the caller loads the probes of an earlier run
    try:
        return allocation.prepare_lm(*args, **kwargs)
    finally:
        allocation.probe_units = probe_units


def load_probes(units: Sequence, path: Path) -> list[dict]:
    """The probes an earlier run saved (checked against this run's curves)."""
    rows = json.loads(path.read_text())
    for unit, row in zip(units, rows, strict=True):
        assert row["name"] == unit.name and np.allclose(row["error"], unit.error, rtol=1e-4, atol=1e-7), unit.name
        unit.probe, unit.scale = row["probe"], row["scale"]
    return rows


def choice_at(pool: Sequence, fraction: float, curves: Mapping[int, np.ndarray]) -> dict[str, int]:
    """The allocation (price bisected) that skips ~``fraction`` of the pool's bytes with the loss
    curves ``curves`` (by id of unit; the units' own probe line is put back afterwards)."""
    saved = {id(unit): (unit.scale, unit.error) for unit in pool}
    for unit in pool:
        unit.scale, unit.error = 1.0, curves[id(unit)]
    try:
        low, high = 1e-8, 1e3
        for _ in range(60):
            middle = math.sqrt(low * high)
            if allocation.skipped_fraction(pool, allocation.allocate(pool, middle, floor=FLOOR)) < fraction:
                low = middle
            else:
                high = middle
        return allocation.allocate(pool, high, floor=FLOOR)
    finally:
        for unit in pool:
            unit.scale, unit.error = saved[id(unit)]


def measure_at(experiment: Experiment, strategy: str, pool: Sequence, fraction: float,
               curves: Mapping[int, np.ndarray], points: Path) -> dict:
    """An allocation at ``fraction`` of the pool's bytes, measured (dppl vs the reference), appended to
    ``points`` (JSON lines)."""
    choice = choice_at(pool, fraction, curves)
    units, layers = experiment.units, experiment.prepared.layers
    window = experiment.loss.window_loss(allocation.thresholds_for(units, layers, choice))
    total = sum(unit.weight_bytes for unit in units)
    row = {"strategy": strategy, "target": fraction, "skipped_pool": allocation.skipped_fraction(pool, choice),
           "skipped_all": sum(u.weight_bytes * u.grid[choice.get(u.input_name, 0)] for u in pool) / total,
           "dppl": math.expm1(float(window.mean())), "window": window.tolist(),
           "predicted": sum(float(curves[id(u)][choice.get(u.input_name, 0)]) for u in pool),
           "sparsity": {u.name: float(u.grid[choice.get(u.input_name, 0)]) for u in pool}}
    log(f"{strategy} @ {fraction:.2f}: skipped {row['skipped_pool']:.1%} of the pool ({row['skipped_all']:.1%} of all), "
        f"dppl {row['dppl']:+.2%} (predicted loss {row['predicted']:.4f})")
    with open(points, "a") as out:
        out.write(json.dumps(row) + "\n")
    return row


def power_curve(unit, exponent: float, probe: Mapping[str, float] | None = None) -> np.ndarray:
    """loss ~ error^p through the unit's 2% probe (or ``probe``)."""
    far = probe or unit.probe
    return far["loss"] * (np.maximum(unit.error, 0) / max(far["error"], 1e-12)) ** exponent
