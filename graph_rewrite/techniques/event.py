"""Event-driven: per row stream, refresh only the input blocks that changed most since
they were last used and reuse the rest -> ``EventDrivenMatMul``.

With KWTA chosen for the same layer, KWTA becomes the event gate's candidate prior (``kwta_k``:
candidates are the top blocks by ||x_b||, the event ordering runs inside them) in the same op —
one ordering, never a second op.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar

from ... import flag_types
from .. import op_schema
from ..errors import ConfigError
from ..targets import TARGETS
from .base import (
    BIAS,
    GATE,
    TARGET,
    WEIGHT,
    Flag,
    LayerWeights,
    OpBuild,
    Switch,
    Technique,
    TechniqueSettings,
)

EVENT_AXES = ("sequence", "call")
_OP = op_schema.defaults("EventDrivenMatMul")  # the op's defaults (graph_rewrite/op_schema.json, read by C++ too)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclasses.dataclass(frozen=True)
class EventSettings(TechniqueSettings):
    """Attributes of ``EventDrivenMatMul`` (docs/ops.md#eventdrivenmatmul)."""

    label: ClassVar[str] = "event"
    float_fields: ClassVar[tuple[str, ...]] = ("topk", "delta_theta", "stale_beta", "stale_lambda", "budget_ms",
                                               "quorum", "gap_tol", "kwta_k")
    always_shown: ClassVar[tuple[str, ...]] = ("axis", "block")

    axis: str = _OP["axis"]
    topk: float = _OP["topk"]
    delta_theta: float = _OP["delta_theta"]
    stale_beta: float = _OP["stale_beta"]
    stale_lambda: float = _OP["stale_lambda"]
    age_max: int = _OP["age_max"]
    budget_ms: float = _OP["budget_ms"]
    quorum: float = _OP["quorum"]
    gap_every: int = _OP["gap_every"]
    gap_tol: float = _OP["gap_tol"]
    kwta_k: float = _OP["kwta_k"]
    block: int = _OP["block"]
    max_gated_rows: int = _OP["max_gated_rows"]  # > 0: calls with more rows (prefill) run dense and resync the streams

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


_D = EventSettings()


class Event(Technique):
    name = "event"
    kind = GATE
    op_type = "EventDrivenMatMul"
    settings_type = EventSettings
    title = "Event-driven (EventDrivenMatMul) global settings; --config entries override per layer"
    switch = Switch("--event-driven", choices=("on", "off"), default="off",
                    help="rewrite with the event gate (default off); with --kwta=on on the same layers, KWTA becomes "
                         "its candidate prior in the same op")
    flags = (
        Flag("--event-target", field=TARGET, choices=TARGETS, default="mlp",
             help="layers: mlp, attn (q/k/v/out projections), both, down, all (default mlp)"),
        Flag("--event-axis", field="axis", choices=EVENT_AXES, default=_D.axis,
             help="sequence: a row continues the previous token of its stream (decode); call: row t continues row "
                  "t of the previous call (re-encoding a slowly changing input)"),
        Flag("--event-topk", field="topk", type=flag_types.fraction, default=_D.topk, metavar="FRAC",
             help=f"fraction of blocks refreshed per row, (0, 1] (default {_D.topk})"),
        Flag("--event-delta-theta", field="delta_theta", type=flag_types.non_negative_float,
             default=_D.delta_theta, metavar="REL",
             help=f"refresh only blocks with ||dx_b|| > REL * ||x_b|| (default {_D.delta_theta})"),
        Flag("--event-budget-ms", field="budget_ms", type=flag_types.non_negative_float,
             default=_D.budget_ms, metavar="MS",
             help="per-row deadline of one op (0 = none, default)"),
        Flag("--event-quorum", field="quorum", type=flag_types.unit_interval, default=_D.quorum, metavar="FRAC",
             help=f"fraction of the selected blocks computed past the deadline (default {_D.quorum})"),
        Flag("--event-gap-tol", field="gap_tol", type=flag_types.non_negative_float, default=_D.gap_tol, metavar="REL",
             help=f"dense check gap above which an op switches itself to dense (default {_D.gap_tol})"),
        Flag("--event-gap-every", field="gap_every", type=flag_types.non_negative_int,
             default=_D.gap_every, metavar="ROWS",
             help=f"rows between dense gap checks, 0 = never (default {_D.gap_every})"),
        Flag("--event-stale-beta", field="stale_beta", type=flag_types.unit_interval,
             default=_D.stale_beta, metavar="B",
             help="weight of a reused block: B * exp(-lambda * age) (default 1)"),
        Flag("--event-stale-lambda", field="stale_lambda", type=flag_types.non_negative_float,
             default=_D.stale_lambda, metavar="L",
             help="(default 0)"),
        Flag("--event-age-max", field="age_max", type=flag_types.non_negative_int, default=_D.age_max, metavar="ROWS",
             help="a block reused this many rows is refreshed regardless (0 = no limit, default)"),
        Flag("--event-block", field="block", type=flag_types.positive_int, default=_D.block, metavar="ROWS",
             help=f"rows of W per block (default {_D.block})"),
        Flag("--event-max-gated-rows", field="max_gated_rows", type=flag_types.non_negative_int,
             default=_D.max_gated_rows,
             metavar="M", help="calls with more than M rows of X (prefill) run dense and resync the streams; 0 = gate "
                               "every call (default)"),
    )

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
