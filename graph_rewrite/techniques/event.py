"""Event-driven (seed 001): per row stream, refresh only the input blocks that changed most since
they were last used and reuse the rest -> ``EventDrivenMatMul``.

With KWTA chosen for the same layer, KWTA becomes the event gate's candidate prior (``kwta_k``:
candidates are the top blocks by ||x_b||, the event ordering runs inside them) in the same op —
one ordering, never a second op.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar

from ..errors import ConfigError
from ..targets import TARGETS
from .base import BIAS, GATE, WEIGHT, LayerWeights, OpBuild, Technique, TechniqueChoice, TechniqueSettings
from .kwta import non_negative_int

EVENT_AXES = ("sequence", "call")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclasses.dataclass(frozen=True)
class EventSettings(TechniqueSettings):
    """Attributes of ``EventDrivenMatMul`` (docs/ops.md#eventdrivenmatmul)."""

    label: ClassVar[str] = "event"
    float_fields: ClassVar[tuple[str, ...]] = ("topk", "delta_theta", "stale_beta", "stale_lambda", "budget_ms",
                                               "quorum", "gap_tol", "kwta_k")
    always_shown: ClassVar[tuple[str, ...]] = ("axis", "block")

    axis: str = "sequence"
    topk: float = 0.4
    delta_theta: float = 0.01
    stale_beta: float = 1.0
    stale_lambda: float = 0.0
    age_max: int = 0
    budget_ms: float = 0.0
    quorum: float = 0.6
    gap_every: int = 64
    gap_tol: float = 0.03
    kwta_k: float = 0.0
    block: int = 1
    max_gated_rows: int = 0  # > 0: calls with more rows (prefill) run dense and resync the streams

    def __post_init__(self) -> None:
        problems = []
        if self.axis not in EVENT_AXES:
            problems.append(f"axis={self.axis!r} must be one of {', '.join(EVENT_AXES)}")
        for name, lo, hi, lo_open in (("topk", 0.0, 1.0, True), ("stale_beta", 0.0, 1.0, False),
                                      ("quorum", 0.0, 1.0, False), ("kwta_k", 0.0, 1.0, False)):
            value = getattr(self, name)
            if not (_number(value) and (value > lo if lo_open else value >= lo) and value <= hi):
                problems.append(f"{name}={value!r} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}]")
        for name in ("delta_theta", "stale_lambda", "budget_ms", "gap_tol"):
            value = getattr(self, name)
            if not (_number(value) and value >= 0.0):
                problems.append(f"{name}={value!r} must be a finite number >= 0")
        for name, least in (("age_max", 0), ("gap_every", 0), ("block", 1), ("max_gated_rows", 0)):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= least):
                problems.append(f"{name}={value!r} must be an integer >= {least}")
        if problems:
            raise ConfigError("invalid event settings: " + "; ".join(problems))

    def for_layer(self, k: int | None) -> EventSettings:
        return dataclasses.replace(self, block=min(self.block, k)) if k else self

    def is_exact(self, k: int) -> bool:
        """Exact delta coding: every changed block refreshed, reused blocks at weight 1."""
        return (self.topk >= 1.0 and self.delta_theta == 0.0 and self.stale_beta == 1.0 and self.stale_lambda == 0.0
                and (self.kwta_k == 0.0 or self.kwta_k >= 1.0) and (self.budget_ms == 0.0 or self.quorum >= 1.0))

    def attributes(self) -> dict[str, Any]:
        # Every attribute written, defaults included, so a rewritten file keeps its meaning.
        return {
            "axis": self.axis, "topk": float(self.topk), "delta_theta": float(self.delta_theta),
            "stale_beta": float(self.stale_beta), "stale_lambda": float(self.stale_lambda),
            "age_max": int(self.age_max), "budget_ms": float(self.budget_ms), "quorum": float(self.quorum),
            "gap_every": int(self.gap_every), "gap_tol": float(self.gap_tol), "kwta_k": float(self.kwta_k),
            "block": int(self.block), "max_gated_rows": int(self.max_gated_rows),
        }


def kwta_prior_fraction(kwta: Any, k: int) -> float:
    """KWTA settings as the event gate's candidate fraction (k_abs columns -> a fraction of K)."""
    if kwta.k_abs > 0:
        return min(1.0, kwta.k_abs / k)
    return float(kwta.k_frac)


class Event(Technique):
    name = "event"
    kind = GATE
    op_type = "EventDrivenMatMul"
    settings_type = EventSettings
    title = "Event-driven (EventDrivenMatMul) global settings; --config entries override per layer"

    def flag_summary(self, choice: TechniqueChoice) -> str:
        return f"--event-driven={'on' if choice.enabled else 'off'}"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        d = EventSettings()
        g = parser.add_argument_group(self.title)
        g.add_argument("--event-driven", choices=("on", "off"), default="off",
                       help="rewrite with the event gate (default off); with --kwta=on on the same layers, KWTA "
                            "becomes its candidate prior in the same op")
        g.add_argument("--event-target", choices=TARGETS, default="mlp",
                       help="layers: mlp, attn (q/k/v/out projections), both, down, all (default mlp)")
        g.add_argument("--event-axis", choices=EVENT_AXES, default=d.axis,
                       help="sequence: a row continues the previous token of its stream (decode); call: row t "
                            "continues row t of the previous call (re-encoding a slowly changing input)")
        g.add_argument("--event-topk", type=float, default=d.topk, metavar="FRAC",
                       help=f"fraction of blocks refreshed per row, (0, 1] (default {d.topk})")
        g.add_argument("--event-delta-theta", type=float, default=d.delta_theta, metavar="REL",
                       help=f"refresh only blocks with ||dx_b|| > REL * ||x_b|| (default {d.delta_theta})")
        g.add_argument("--event-budget-ms", type=float, default=d.budget_ms, metavar="MS",
                       help="per-row deadline of one op (0 = none, default)")
        g.add_argument("--event-quorum", type=float, default=d.quorum, metavar="FRAC",
                       help=f"fraction of the selected blocks computed past the deadline (default {d.quorum})")
        g.add_argument("--event-gap-tol", type=float, default=d.gap_tol, metavar="REL",
                       help=f"dense check gap above which an op switches itself to dense (default {d.gap_tol})")
        g.add_argument("--event-gap-every", type=non_negative_int, default=d.gap_every, metavar="ROWS",
                       help=f"rows between dense gap checks, 0 = never (default {d.gap_every})")
        g.add_argument("--event-stale-beta", type=float, default=d.stale_beta, metavar="B",
                       help="weight of a reused block: B * exp(-lambda * age) (default 1)")
        g.add_argument("--event-stale-lambda", type=float, default=d.stale_lambda, metavar="L", help="(default 0)")
        g.add_argument("--event-age-max", type=non_negative_int, default=d.age_max, metavar="ROWS",
                       help="a block reused this many rows is refreshed regardless (0 = no limit, default)")
        g.add_argument("--event-block", type=int, default=d.block, metavar="ROWS",
                       help=f"rows of W per block (default {d.block})")
        g.add_argument("--event-max-gated-rows", type=non_negative_int, default=d.max_gated_rows, metavar="M",
                       help="calls with more than M rows of X (prefill) run dense and resync the streams; 0 = gate "
                            "every call (default)")

    def choice_from_args(self, args: argparse.Namespace) -> TechniqueChoice:
        settings = EventSettings(axis=args.event_axis, topk=args.event_topk, delta_theta=args.event_delta_theta,
                                 stale_beta=args.event_stale_beta, stale_lambda=args.event_stale_lambda,
                                 age_max=args.event_age_max, budget_ms=args.event_budget_ms,
                                 quorum=args.event_quorum, gap_every=args.event_gap_every,
                                 gap_tol=args.event_gap_tol, block=args.event_block,
                                 max_gated_rows=args.event_max_gated_rows)
        return TechniqueChoice(settings=settings, enabled=args.event_driven == "on", target=args.event_target)

    def build(self, layer: LayerWeights, settings: EventSettings, partners: Mapping[str, Any]) -> OpBuild:
        emitted = settings.for_layer(layer.k)
        notes = [f"block {settings.block} > K={layer.k}: block set to K"] if emitted.block != settings.block else []
        kwta = partners.get("kwta")
        if kwta is not None:
            fraction = kwta_prior_fraction(kwta, layer.k)
            emitted = dataclasses.replace(emitted, kwta_k=fraction)
            notes.append(f"KWTA is the event gate's candidate prior: kwta_k={fraction:g} (energy ||x_b||; KWTA's "
                         "score, threshold, duty and renorm do not apply inside the event gate)")
        unknown = set(partners) - {"kwta"}
        if unknown:
            raise ConfigError(f"layer '{layer.name}': EventDrivenMatMul cannot absorb {', '.join(sorted(unknown))}")
        return OpBuild(self.op_type, [WEIGHT, BIAS], emitted.attributes(), notes=notes,
                       exact=emitted.is_exact(layer.k))


EVENT = Event()
