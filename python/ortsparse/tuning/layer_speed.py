"""What gating a layer saves on this machine, measured: the speed side of tune's allocation.

The allocation (:mod:`ortsparse.calibration.allocation`) trades each unit's loss against what skipping
its inputs is worth. Counting skipped *bytes* assumes every layer turns a skipped byte into the
same time; measured, it does not: a narrow layer pays the gate and a node's fixed cost for few
bytes, a quantized layer's unpacking is arithmetic that skipping rows does not remove in the same
proportion, and at two threads a small layer's work splits worse than a wide one's (issue 25). So
tune measures, per **speed class** (units whose layers have the same op, shapes and storage: the
same kernels, hence the same time — SmolLM2 has four: q/k/v, o, gate/up, down):

- a graph of up to :data:`UNITS_PER_CLASS` units of the class with their real weights (enough that
  one run is not all fixed cost; more would only multiply the sessions' memory), each reading its own copy of
  one decode row ``[1, 1, K]`` (units apart, as in the model: the rewrite fuses a unit's layers only),
  once as the input model has them and once on our op at each keep of :data:`KEEPS` (a
  threshold on a fixed row putting exactly that fraction of the inputs through);
- every class's sessions run in **one rotation** (:func:`ortsparse.benchmarking.time_from_memory`,
  the protocol and its measured reasons): between two runs of a session the other sessions'
  weights (five forms of every class's units) pass through the caches, as in a decode step; a
  rotation that fits in the last-level cache (a small model) is flushed before each run after all;
  the same threads as the speed check;
- per class and keep: ours' time as the median of the paired ratios to the input (run back to
  back: the same load on both) times the input's median, made non-decreasing in the keep (fewer
  rows never cost more: a pool-adjacent-violators pass irons out what the noise inverts), and a
  sign test on the pairs: is ours faster than the input in more pairs than chance explains.

A unit's value at sparsity ``s`` is then the time it saves, ``t_input - t(1 - s)`` per unit
(linear between the measured keeps, flat below the lowest); the allocation gates a unit only at
sparsities that save time, and only when at some measured keep ours was *shown* faster (sign test,
p < :data:`SIGNIFICANCE`) — under noise that shows nothing the class stays dense, as the input has
it — and, with its price, buys loss with measured time instead of bytes. A class that cannot be measured (a layer whose weight is not a plain initializer
of its node) keeps the byte model. Cost: a few seconds per class (12-25 s for SmolLM2's four); memory:
every class's five sessions at once (8 units each).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..benchmarking import sign_test, time_from_memory
from ..calibration.allocation import Unit, gated_layers, units_of
from ..graph_rewrite.config import NodePlan
from ..graph_rewrite.layer_settings import rewritten_with
from ..graph_rewrite.node_models import layers_alone
from ..measure.source import ModelSource
from ..runtime import open_session, thread_options
from .selection import non_decreasing

KEEPS = (1.0, 0.75, 0.5, 0.25)  # our op's keep fractions measured per class
SIGNIFICANCE = 0.05  # one-sided sign test: ours faster than the input in this many pairs by chance
UNITS_PER_CLASS = 8
SECONDS_PER_CLASS = 3.0  # rotation time per class (~1000 rounds in all for SmolLM2's four here)


@dataclasses.dataclass
class ClassSpeed:
    """One speed class's measurement, per unit (the class graph's times / its units): microseconds
    per decode row for the input form and for ours at each keep, and the fit through them."""

    signature: str
    units: int
    input_us: float | None
    ours_us: dict[float, float]
    rounds: int
    note: str
    monotone_us: dict[float, float] = dataclasses.field(default_factory=dict)  # ours, non-decreasing in keep
    p_values: dict[float, float] = dataclasses.field(default_factory=dict)  # sign test per keep

    @property
    def measured(self) -> bool:
        return self.input_us is not None and bool(self.ours_us)

    @property
    def shown_faster(self) -> bool:
        """Ours faster than the input in more pairs than chance explains at some measured keep."""
        return any(p < SIGNIFICANCE for p in self.p_values.values())

    def ours_at(self, keep: np.ndarray | float) -> np.ndarray:
        keeps = sorted(self.monotone_us)
        return np.interp(np.asarray(keep, dtype=np.float64), keeps, [self.monotone_us[k] for k in keeps])

    def saving(self, sparsity: np.ndarray) -> np.ndarray:
        """Microseconds per unit saved against the input form at each sparsity; where gating was
        not shown to pay, zero or less everywhere (the allocation leaves those sparsities out)."""
        saved = self.input_us - self.ours_at(1.0 - np.asarray(sparsity, dtype=np.float64))
        return saved if self.shown_faster else np.minimum(saved, 0.0)

    @property
    def break_even(self) -> float | None:
        """The smallest sparsity (1% steps) from which gating saves time; None: at none."""
        if not self.measured:
            return None
        grid = np.linspace(0.0, 1.0, 101)
        paying = np.flatnonzero(self.saving(grid) > 0.0)
        return float(grid[paying[0]]) if paying.size else None

    def to_dict(self) -> dict[str, Any]:
        return {"signature": self.signature, "units": self.units, "input_us": self.input_us,
                "ours_us": {f"{k:g}": v for k, v in self.ours_us.items()}, "rounds": self.rounds,
                "monotone_us": {f"{k:g}": v for k, v in self.monotone_us.items()},
                "sign_test_p": {f"{k:g}": v for k, v in self.p_values.items()}, "break_even": self.break_even,
                "note": self.note}

    def describe(self) -> str:
        if not self.measured:
            return f"{self.signature}: not measured ({self.note})"
        ours = ", ".join(f"keep {k:g} {v:.1f}" for k, v in self.ours_us.items())
        even = self.break_even
        pays = ("gating never pays here" if even is None else
                f"gating pays from {even:.0%} sparsity" if even > 0 else "gating pays at every sparsity")
        return (f"{self.signature} x {self.units}: input {self.input_us:.1f} us, ours {ours} us per unit and decode "
                f"row ({self.rounds} rounds, weights from memory): {pays}")


def _signature(model: onnx.ModelProto, unit: Unit) -> tuple[str, ...] | None:
    """What decides a unit's kernels: per layer op, K x N and storage attributes (None: a layer's
    node is not found)."""
    nodes = {node.name: node for node in model.graph.node}
    parts = []
    for layer in unit.layers:
        node = nodes.get(layer.name)
        if node is None:
            return None
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute
                 if a.name in ("bits", "block_size", "accuracy_level", "transA", "transB")}
        storage = ",".join(f"{k}={v}" for k, v in sorted(attrs.items()))
        k, n = layer.weight.shape
        parts.append(f"{node.op_type} {k}x{n}" + (f" [{storage}]" if storage else ""))
    return tuple(parts)


def speed_classes(model: onnx.ModelProto, units: Sequence[Unit]) -> dict[tuple[str, ...], list[Unit]]:
    """Units grouped by :func:`_signature` (graph order inside a class); units without one are left out."""
    classes: dict[tuple[str, ...], list[Unit]] = {}
    for unit in units:
        signature = _signature(model, unit)
        if signature is not None:
            classes.setdefault(signature, []).append(unit)
    return classes


def class_model(model: onnx.ModelProto, units: Sequence[Unit]) -> onnx.ModelProto:
    """A graph of the ``units``' layer nodes with their weights, each unit reading its own input (its
    X, [1, 1, K]) (:func:`~ortsparse.graph_rewrite.node_models.layers_alone`); raises ValueError when
    a node reads a non-constant beyond its first input."""
    k = units[0].layers[0].weight.shape[0]
    return layers_alone(model, [layer.name for unit in units for layer in unit.layers],
                        {unit.input_name: [1, 1, k] for unit in units})


def keep_threshold(row: np.ndarray, keep: float) -> float:
    """A threshold on |x| through which ``keep`` of ``row``'s entries pass (score l2 at block 1)."""
    magnitudes = np.sort(np.abs(row.reshape(-1)))[::-1]
    kept = int(round(keep * magnitudes.size))
    if kept >= magnitudes.size:
        return 0.0
    return float((magnitudes[kept - 1] + magnitudes[kept]) / 2.0) if kept > 0 else float(magnitudes[0]) * 2.0 + 1.0


@dataclasses.dataclass
class _ClassRun:
    """One class ready to time: its sessions ("input" and each keep) and what to feed them."""

    name: str
    class_size: int
    units: int
    sessions: dict[Any, Any]
    feed: dict[str, np.ndarray]
    weight_bytes: int  # the class graph's constants, once per session


def _prepare_class(model: onnx.ModelProto, signature: Sequence[str], units: Sequence[Unit], threads: int,
                   keeps: Iterable[float]) -> _ClassRun | ClassSpeed:
    """The class graph of up to :data:`UNITS_PER_CLASS` ``units`` as the input has it and on our op
    at each keep, sessions open; a ClassSpeed saying why when it cannot be measured."""
    name = " + ".join(signature)
    class_size, units = len(units), units[:UNITS_PER_CLASS]
    try:
        graph = class_model(model, units)
    except (ValueError, KeyError) as error:
        return ClassSpeed(name, class_size, None, {}, 0, f"not measurable: {error}")
    k = units[0].layers[0].weight.shape[0]
    row = np.random.default_rng(0).standard_normal((1, 1, k)).astype(np.float32)
    layer_names = [layer.name for unit in units for layer in unit.layers]
    options = thread_options(threads)
    sessions: dict[Any, Any] = {"input": open_session(graph, options)}
    for keep in keeps:
        gate = {"threshold": keep_threshold(row, keep), "k_frac": 1.0, "block": 1}
        ours = rewritten_with(graph, NodePlan("kwta", {n: gate for n in layer_names}, rest=None))
        if {node.op_type for node in ours.graph.node} & {node.op_type for node in graph.graph.node}:
            return ClassSpeed(name, class_size, None, {}, 0, "our rewrite does not take every layer of the class")
        sessions[float(keep)] = open_session(ours, options)
    weight_bytes = sum(numpy_helper.to_array(t).nbytes for t in graph.graph.initializer)
    return _ClassRun(name, class_size, len(units), sessions, {unit.input_name: row for unit in units}, weight_bytes)


def _class_speed(run: _ClassRun, times: dict[Any, list[float]]) -> ClassSpeed:
    """A class's record from its sessions' times (paired by index with the input's)."""
    base = np.asarray(times["input"])
    input_us = 1e6 * float(np.median(base)) / run.units
    measured = sorted(key for key in times if key != "input")
    ours_us = {keep: input_us * float(np.median(np.asarray(times[keep]) / base)) for keep in measured}
    monotone = dict(zip(measured, non_decreasing([ours_us[k] for k in measured]).tolist()))
    p_values = {keep: sign_test(int(np.sum(np.asarray(times[keep]) < base)), base.size) for keep in measured}
    return ClassSpeed(run.name, run.class_size, input_us, ours_us, len(base),
                      f"{run.units} units timed in one rotation with the other classes; paired ratios to the input "
                      "form, medians", monotone, p_values)


def measure_classes(model: onnx.ModelProto, classes: Sequence[tuple[Sequence[str], Sequence[Unit]]], *,
                    threads: int = 1, seconds: float | None = None, min_rounds: int = 5,
                    keeps: Iterable[float] = KEEPS, flush: bool | None = None) -> list[ClassSpeed]:
    """Each (signature, units) class: the input form and our op at each of ``keeps`` on its class
    graph (real weights), every class's sessions in one rotation for about ``seconds`` per class
    (default :data:`SECONDS_PER_CLASS`; at least ``min_rounds`` rotations), one warm-up run each
    (allocations, packing), by :func:`ortsparse.benchmarking.time_from_memory` (``flush``: True /
    False forces a flush before each run either way)."""
    keeps = tuple(keeps)
    prepared = [_prepare_class(model, signature, units, threads, keeps) for signature, units in classes]
    runs = [run for run in prepared if isinstance(run, _ClassRun)]
    times: dict[Any, list[float]] = {}
    if runs:
        runners = {(index, key): (lambda s=session, f=run.feed: s.run(None, f))
                   for index, run in enumerate(runs) for key, session in run.sessions.items()}
        rotation_bytes = sum(run.weight_bytes * len(run.sessions) for run in runs)
        per_class = SECONDS_PER_CLASS if seconds is None else seconds
        times = time_from_memory(runners, rotation_bytes=rotation_bytes, flush=flush, repeats=min_rounds,
                                 warmup=1, min_seconds=per_class * len(runs))
    records, timed = [], iter(range(len(runs)))
    for item in prepared:
        if isinstance(item, ClassSpeed):
            records.append(item)
            continue
        index = next(timed)
        records.append(_class_speed(item, {key: values for (i, key), values in times.items() if i == index}))
    return records


def measure_units(model: onnx.ModelProto, units: Sequence[Unit], *, threads: int = 1, seconds: float | None = None,
                  log: Callable[[str], None] = print) -> list[ClassSpeed]:
    """Every speed class of ``units`` measured; sets each measured unit's ``saving`` (microseconds
    saved per decode row at each grid sparsity). Returns the classes' records."""
    classes = list(speed_classes(model, units).items())
    records = measure_classes(model, classes, threads=threads, seconds=seconds)
    for (_, members), speed in zip(classes, records):
        log(f"layer speed: {speed.describe()}")
        if speed.measured:
            for unit in members:
                unit.saving = speed.saving(np.asarray(unit.grid))
    return records


@dataclasses.dataclass
class Measured:
    """The classes' records and what tune's allocation gets from them: ``savings`` {unit input name:
    saving per grid sparsity} when every class was measured (else None: the byte model for all),
    and whether any unit saves time at some sparsity."""

    records: list[ClassSpeed]
    savings: dict[str, np.ndarray] | None

    @property
    def nothing_pays(self) -> bool:
        return self.savings is not None and not any(np.any(s > 0.0) for s in self.savings.values())


def measure_model(model: onnx.ModelProto | ModelSource, target: str = "both", *, threads: int = 1,
                  seconds: float | None = None, log: Callable[[str], None] = print) -> Measured:
    """The gated units of ``model`` (KWTA's ``target``) measured, class by class."""
    units = units_of(gated_layers(model, target))
    records = measure_units(model.weights if isinstance(model, ModelSource) else model, units, threads=threads,
                            seconds=seconds, log=log)
    if not records or any(not record.measured for record in records):
        return Measured(records, None)
    return Measured(records, {unit.input_name: unit.saving for unit in units})


def nothing_pays_note(records: Sequence[ClassSpeed], threads: int) -> str:
    """Why nothing is gated when every class was measured and none paid (the advice tune prints)."""
    return (f"gating pays for no layer on this machine at {threads} thread(s): in each of the {len(records)} speed "
            "classes our op was not shown faster than the input's own at any measured keep (see the layer speed "
            "lines; a busy machine hides the gain: rerun when it is quieter, or --no-speed-aware values skipped "
            "bytes alike)")
