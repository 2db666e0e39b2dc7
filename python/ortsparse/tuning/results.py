"""What each stage of ``tune`` hands the next (:mod:`.tune`), and the whole run's result, which the
reports are rendered from (:mod:`.report`; :meth:`TuneResult.to_dict` is the JSON report, its keys
as scripts/results_table.py and the reports under reports/ read them)."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..calibration.allocation import LmLoss, Prepared
from ..graph_rewrite.config import NodePlan
from ..measure.source import ModelSource
from ..measure.text import BosChoice
from .layer_speed import Measured
from .search import PathPoint, history
from .selection import Selection
from .windows import WindowPlan

EXIT_WRITTEN = 0
EXIT_NOT_WRITTEN = 1  # the check missed the budget, or nothing could be gated within it
EXIT_WRITTEN_SLOWER = 3  # written, but it decoded slower than MODEL here (the last line says so)
NOT_SPEED_AWARE = "not measured (--no-speed-aware): skipped bytes valued alike, gating from 10% sparsity"


@dataclasses.dataclass(frozen=True)
class TuneInputs:
    """Stage 1: what tune was asked, resolved and checked before anything is measured."""

    source: ModelSource
    reference: ModelSource | None
    tokens: np.ndarray
    output: Path
    max_dppl: float
    margin: float | None
    context: int | None
    long_context: int | None  # ``context`` when attention selection is tuned for it, else None
    answer_prefix: int | None  # with a long context: the prompt of each answer window (the context, or as
    # much of it as leaves the answer room in the models' positions)
    window_len: int
    bos: BosChoice
    threads: int
    speed_steps: int
    method: str
    windows: int | None
    speed_aware: bool
    command: str | None
    # The LM head a candidate unit like the others (gated where its probes say it is cheap and,
    # speed-aware, where gating it pays here): Gemma-3's 262k-vocabulary head is 63% of its int8
    # linear bytes; left out, the budget has a third of the bytes to spend on (docs/results.md).
    # Off by default: on SmolLM2 it is not measured yet, and on the tiny test model it costs more
    # than its probe predicts.
    gate_head: bool = False

    @property
    def target(self) -> str:
        """KWTA's target of the units tune may gate: ``all`` (attention, MLP and the head) or ``both``."""
        return "all" if self.gate_head else "both"

    @property
    def baseline(self) -> ModelSource:
        """The model dppl is measured against: the reference, else the input itself."""
        return self.reference or self.source

    @property
    def limit(self) -> float:
        """The dppl the choice's calibration bound must stay within."""
        return self.max_dppl if self.margin is None else self.max_dppl * self.margin

    @property
    def limit_text(self) -> str:
        return (f"the budget {self.max_dppl:.2%}" if self.margin is None else
                f"--margin {self.margin:g} x the budget {self.max_dppl:.2%} = {100 * self.limit:.3g}%")

    @property
    def selection_rule(self) -> str:
        return ("most skipped bytes whose monotone-fitted calibration loss + z x sqrt(between-part variance x "
                "(1/calibration + 1/check parts) + within-part variance x (1/calibration + 1/check windows)) is "
                f"within {self.limit_text}")


@dataclasses.dataclass(frozen=True)
class Windows:
    """Stage 2: the text's windows, and the speed of one forward pass that sized them."""

    plan: WindowPlan
    window_len: int  # positions of a window: the BOS, when there is one, and ``plan.text_len`` text tokens
    seconds_per_window: float
    bos: BosChoice

    @property
    def calibration(self) -> int:
        return len(self.plan.calibration)

    @property
    def check(self) -> int:
        return len(self.plan.check)

    @property
    def held_out_parts(self) -> int:
        """The held-out parts the check windows come from."""
        return int(np.unique(self.plan.check_parts).size)

    @property
    def construction(self) -> str:
        return (f"{self.calibration} calibration + {self.check} check windows x {self.window_len} positions "
                f"({self.bos.describe()}); the first text token of a window is context only"
                + ("" if self.bos.id is None else ", nor is the BOS scored"))


@dataclasses.dataclass
class CalibrationPath:
    """Stage 4: the probe graph's units (curves, probes, measured savings) and the path of
    allocations measured window by window on the calibration windows."""

    prepared: Prepared
    loss: LmLoss  # on the calibration windows, against the baseline
    points: list[PathPoint]


@dataclasses.dataclass
class Choice:
    """Stage 5: the fitted curve along the path and the chosen point; when it gates anything, the
    per-layer decision (``plan``: node -> KWTA settings, what the rewrite applies) with its planned
    ``sparsity`` per layer and the allocation's record."""

    selection: Selection
    band: tuple[np.ndarray, np.ndarray]  # 5-95% bootstrap of the fitted trend per point
    points: list[PathPoint]
    method: str
    plan: NodePlan | None = None
    sparsity: dict[str, float] = dataclasses.field(default_factory=dict)
    allocation: dict[str, Any] = dataclasses.field(default_factory=dict)  # Allocation.report() + head placement

    @property
    def index(self) -> int | None:
        return self.selection.index

    @property
    def point(self) -> PathPoint | None:
        return None if self.index is None else self.points[self.index]

    @property
    def gates_anything(self) -> bool:
        return self.point is not None and self.point.skipped > 0.0

    def curve(self) -> list[dict[str, Any]]:
        s = self.selection
        return [{"skipped_fraction": p.skipped, "point": p.label, "dppl": float(math.expm1(mean)),
                 "trend": float(math.expm1(trend)), "band": [float(math.expm1(lo)), float(math.expm1(hi))],
                 "bound": float(math.expm1(bound)), "window_sd": float(sd), "part_sd": float(part_sd)}
                for p, mean, trend, lo, hi, bound, sd, part_sd in zip(self.points, s.mean, s.trend, self.band[0],
                                                                      self.band[1], s.bound, s.spread, s.part_sd)]

    @property
    def calibration_dppl(self) -> float:
        return float(math.expm1(self.selection.mean[self.index]))

    @property
    def bound(self) -> float:
        return float(math.expm1(self.selection.bound[self.index]))

    def gating(self) -> dict[str, Any]:
        return {"method": self.method, "skipped_fraction": self.point.skipped, "sparsity": self.sparsity,
                "calibration_dppl": self.calibration_dppl, "bound": self.bound, "history": history(self.points),
                "allocation": self.allocation}


@dataclasses.dataclass(frozen=True)
class ProbeCheck:
    """Stage 6: the reference's run on the check windows, and the held-out loss curve around the
    choice on the probe graph (check windows: never used to choose)."""

    reference_run: Mapping[str, Any]  # perplexity() of the baseline on the check windows
    curve: list[dict[str, Any]]


@dataclasses.dataclass(frozen=True)
class StagedModel:
    """Stage 7: the tuned model written once, into staging: what runs (folder or file) and its decoder."""

    path: Path
    decoder: Path
    attention_note: str
    max_gated_rows: int


@dataclasses.dataclass(frozen=True)
class HeldOut:
    """Stage 8: the written decoder (every row gated) against the reference on the check windows
    (held-out parts of the text); the interval is the range one more part of the text is expected
    in (:func:`.selection.interval`, the between-part sd ``part_sd`` from the calibration parts)."""

    dppl: float
    dppl_low: float
    dppl_high: float
    top1_agreement: float
    windows: int
    window_len: int
    window_losses: list[float]
    ppl_reference: float
    ppl_tuned: float
    measured_on: str
    metrics: Mapping[str, Any]
    rewrite: Mapping[str, int]  # ai.ortsparse nodes of the written decoder, by op
    parts: int  # the held-out parts the windows come from
    part_sd: float  # between-part sd of the loss at the chosen point (nats; calibration parts)
    interval: str  # what dppl_low .. dppl_high is

    def to_dict(self) -> dict[str, Any]:
        fields = dataclasses.asdict(self)
        del fields["rewrite"]
        return fields


@dataclasses.dataclass(frozen=True)
class AnswerCheck:
    """Stage 9, with a long ``--context``: attention selection judged where it acts. Windows of the
    held-out parts (text tune never calibrated on), each a ``prefix``-token prompt read in one call
    and then ``answer`` tokens teacher-forced, only those scored
    (:mod:`ortsparse.measure.answer_quality`); the written model against the baseline, a genai
    folder through the Generator. ``summary``: :func:`~ortsparse.measure.answer_quality.summarize`
    (dppl, its 95% t-interval over windows, top-1 mean and worst) and ``per_window``."""

    summary: Mapping[str, Any]
    per_window: list[dict[str, float]]
    prefix: int
    answer: int
    windows_available: int
    note: str  # how many windows, and why
    runners: Mapping[str, str]  # "reference" / "tuned": og (the Generator) or ort

    @property
    def dppl(self) -> float:
        return float(self.summary["dppl"])

    def to_dict(self) -> dict[str, Any]:
        return {**self.summary, "prefix": self.prefix, "answer": self.answer,
                "windows_available": self.windows_available,
                "note": self.note, "runners": dict(self.runners), "per_window": list(self.per_window),
                "scored": f"the {self.answer} answer steps after each {self.prefix}-token prompt; no prompt position "
                          "is averaged in"}


@dataclasses.dataclass(frozen=True)
class SpeedCheck:
    """Stage 9: the staged model against MODEL in the real decode loop (``decode``: ``decode_speed``'s
    result, or ``{"error": why}``), and the whole request at a long context (``request``)."""

    context: int
    runner: str
    decode: Mapping[str, Any]
    request: Mapping[str, Any] | None = None

    @property
    def error(self) -> str | None:
        return self.decode.get("error")

    def tokens_per_s(self) -> tuple[float, float] | None:
        """(input, tuned) decode tokens/s, medians; None when not measured."""
        if "input" in self.decode and "tuned" in self.decode:
            return self.decode["input"]["tokens_per_s"], self.decode["tuned"]["tokens_per_s"]
        return None

    def ratio(self) -> tuple[float, str] | None:
        """The speed the verdict reads, the worst round's: the whole request (prompt + answer) when a
        long --context was measured, else the decode step; with what it is."""
        if self.request is not None and "tuned" in self.request:
            tuned = self.request["tuned"]
            return tuned["speedup"], f"request time ({tuned['request']} tokens, prompt + answer)"
        rates = self.tokens_per_s()
        if rates is not None:
            return (self.decode["tuned"].get("speedup", rates[1] / rates[0]),
                    f"decode at context {self.context}")
        return None


@dataclasses.dataclass
class TuneResult:
    """The run: each stage's result as far as it got, the verdict (``exit_status``, ``last_line``)
    and the seconds each stage took."""

    inputs: TuneInputs
    written: bool = False
    exit_status: int = EXIT_NOT_WRITTEN
    last_line: str = ""
    advice: str | None = None
    windows: Windows | None = None
    layer_speed: Measured | None = None
    choice: Choice | None = None
    probe_check: ProbeCheck | None = None
    staged: StagedModel | None = None
    held_out: HeldOut | None = None
    answers: AnswerCheck | None = None
    speed: SpeedCheck | None = None
    plot: str | None = None
    machine: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    versions: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    stage_seconds: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return round(sum(self.stage_seconds.values()), 1)

    def finish(self, status: int, last_line: str, advice: str | None = None) -> TuneResult:
        self.exit_status, self.last_line = status, last_line
        if advice is not None:
            self.advice = advice
        return self

    def layer_speed_report(self) -> list[dict[str, Any]] | str:
        if self.layer_speed is None:
            return NOT_SPEED_AWARE
        return [speed.to_dict() for speed in self.layer_speed.records]

    def to_dict(self) -> dict[str, Any]:
        """The JSON report."""
        inputs = self.inputs
        report: dict[str, Any] = {"command": inputs.command, "model": str(inputs.source.path)}
        if self.choice is None:  # stopped before calibrating (nothing pays)
            report.update(output=str(inputs.output), written=self.written, advice=self.advice,
                          layer_speed=self.layer_speed_report())
        else:
            windows, choice = self.windows, self.choice
            report.update({
                "reference": None if inputs.reference is None else str(inputs.reference.path),
                "output": str(inputs.output), "max_dppl": inputs.max_dppl, "margin": inputs.margin,
                "context": inputs.context, "method": inputs.method, "gated_target": inputs.target,
                "tokens": int(inputs.tokens.size),
                "window_len": inputs.window_len, "calibration_windows": windows.calibration,
                "check_windows": windows.check, "bos": inputs.bos.to_dict(),
                "window_construction": windows.construction, "windows_available": list(windows.plan.available),
                "windows_note": windows.plan.note, "seconds_per_window": windows.seconds_per_window,
                "split": windows.plan.split, "parts": windows.plan.parts_report(),
                "layer_speed": self.layer_speed_report(),
                "selection": {"z": choice.selection.z, "margin_factor": choice.selection.margin_factor,
                              "part_factor": choice.selection.part_factor,
                              "calibration_parts": choice.selection.calibration_parts,
                              "check_parts": choice.selection.check_parts,
                              "index": choice.index, "limit": inputs.limit, "rule": inputs.selection_rule},
                "calibration_curve": choice.curve(), "machine": dict(self.machine), "versions": dict(self.versions),
            })
            if choice.gates_anything:
                report["gating"] = choice.gating()
            if self.probe_check is not None:
                report["held_out_curve"] = self.probe_check.curve
            if self.staged is not None:
                report["attention_note"] = self.staged.attention_note
                report["max_gated_rows"] = self.staged.max_gated_rows
            if self.held_out is not None:
                report["rewrite"] = dict(self.held_out.rewrite)
                report["held_out"] = self.held_out.to_dict()
            if self.answers is not None:
                report["held_out_answers"] = self.answers.to_dict()
            report["written"] = self.written
            if self.advice is not None:
                report["advice"] = self.advice
            if self.speed is not None:
                report["speed_context"] = self.speed.context
                report["speed_runner"] = self.speed.runner
                report["speed"] = dict(self.speed.decode)
                if self.speed.request is not None:
                    report["speed_request"] = dict(self.speed.request)
            if self.written:
                report["plot"] = self.plot
        report.update(exit_status=self.exit_status, last_line=self.last_line, seconds=self.seconds,
                      stage_seconds={stage: round(s, 2) for stage, s in self.stage_seconds.items()})
        return report
