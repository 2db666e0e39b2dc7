"""The path tune chooses from: allocations of increasing skipped bytes, each measured window by
window on the calibration windows (probe graph: every threshold set without a rebuild).

``allocated``: the Lagrangian allocations (:mod:`ortsparse.calibration.allocation`) whose *predicted*
loss is a range of fractions of the budget (the prediction only places the points; every point is
measured). ``uniform``: one sparsity of the grid for every layer. Points are measured from the
fewest skipped bytes up and the walk stops once a point is over the budget beyond its noise;
while the last point is still within, the path is extended (the prediction can be several times
off). Then the gap between the point the selection would choose and the next one is halved
:data:`REFINEMENTS` times, so the choice does not sit far below the cliff for want of a point.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ..calibration import allocation
from .selection import choose, clearly_over

# Predicted loss of the allocated path's points, as fractions of log(1 + budget).
PATH_FRACTIONS = (0.15, 0.3, 0.45, 0.6, 0.8, 1.0, 1.25, 1.6, 2.0, 2.6)
EXTENSION = 2.0  # the next fraction when the last point is still within the budget
MAX_EXTENSIONS = 6
REFINEMENTS = 2
# Without a speed measurement (units without ``saving``): a unit gated below this sparsity skips too
# few bytes to pay for its gate, so it is left dense. Measured units use their own break-even.
MIN_PAYING_SPARSITY = 0.1
UNIFORM_SPARSITIES = (0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5, 0.6)


@dataclasses.dataclass
class PathPoint:
    choice: dict[str, int]  # unit input name -> grid index
    skipped: float  # planned fraction of the gated layers' weight bytes
    losses: np.ndarray  # per calibration window, nats vs the reference
    label: str  # how the point was placed (mu or sparsity)
    fraction: float = 0.0  # the predicted loss (fraction of the budget) or the sparsity it was placed at


def _candidates(units: Sequence[allocation.Unit], method: str, fractions: Sequence[float], limit: float
                ) -> list[tuple[dict[str, int], str, float]]:
    if method == "uniform":
        return [(allocation.uniform_choice(units, s), f"uniform {s:.2f}", s) for s in fractions]
    out = []
    for fraction in fractions:
        mu = allocation.price_for(units, fraction * limit, floor=MIN_PAYING_SPARSITY)
        out.append((allocation.allocate(units, mu, floor=MIN_PAYING_SPARSITY), f"mu {mu:.3g}", fraction))
    return out


def forecast(units: Sequence[allocation.Unit], budget: float) -> float:
    """The skipped fraction of gated bytes the probes predict within a dppl ``budget`` (the
    allocation whose predicted loss is ``log(1 + budget)``): said before the path is measured, so a
    model that gates little is known in the first minutes, not the last."""
    mu = allocation.price_for(units, math.log1p(budget), floor=MIN_PAYING_SPARSITY)
    return allocation.skipped_fraction(units, allocation.allocate(units, mu, floor=MIN_PAYING_SPARSITY))


def walk(prepared: allocation.Prepared, window_loss: Callable[[Mapping[int, float]], np.ndarray], budget: float,
         dense_losses: np.ndarray, *, method: str = "allocated", check_windows: int = 1,
         parts: np.ndarray | None = None, check_parts: np.ndarray | None = None,
         log: Callable[[str], None] = print) -> list[PathPoint]:
    """The measured path, the dense point (nothing gated: ``dense_losses``) first, ordered by
    skipped bytes. ``check_windows``: the final check's window count; ``parts``, ``check_parts``:
    the part of the text each calibration and check window comes from (the walk's stop and the
    refinement ask the selection, :mod:`.selection`)."""
    units, layers = prepared.units, prepared.layers
    limit = math.log1p(budget)
    points = [PathPoint({u.input_name: 0 for u in units}, 0.0, np.asarray(dense_losses, dtype=np.float64), "dense")]
    seen = {tuple(sorted(points[0].choice.items()))}

    def measure(fractions: Sequence[float]) -> bool:
        """Measures the new points of ``fractions`` in skipped order; True once one is clearly over."""
        candidates = sorted(_candidates(units, method, fractions, limit),
                            key=lambda c: allocation.skipped_fraction(units, c[0]))
        for choice, label, fraction in candidates:
            key = tuple(sorted(choice.items()))
            if key in seen:
                continue
            seen.add(key)
            losses = window_loss(allocation.thresholds_for(units, layers, choice))
            point = PathPoint(choice, allocation.skipped_fraction(units, choice), losses, label, fraction)
            points.append(point)
            spread = f" (window sd {float(np.std(losses, ddof=1)):.4f})" if losses.size > 1 else ""  # 1 window: none
            log(f"tune: {label}: {point.skipped:.1%} of gated bytes skipped, calibration dppl "
                f"{math.expm1(float(losses.mean())):+.2%}{spread}")
            if clearly_over(np.stack([p.losses for p in points]), budget, parts=parts):
                return True
        return False

    over = measure(UNIFORM_SPARSITIES if method == "uniform" else PATH_FRACTIONS)
    fraction = PATH_FRACTIONS[-1]
    for _ in range(MAX_EXTENSIONS if method != "uniform" else 0):
        if over or points[-1].skipped >= 0.9:
            break
        fraction *= EXTENSION
        over = measure([fraction])
    points.sort(key=lambda p: p.skipped)
    for _ in range(REFINEMENTS if method != "uniform" else 0):
        index = choose(np.stack([p.losses for p in points]), budget, check_windows, parts=parts,
                       check_parts=check_parts).index
        if index is None or index + 1 >= len(points) or points[index + 1].skipped - points[index].skipped < 0.01:
            break
        low, high = points[index].fraction or points[index + 1].fraction / 2, points[index + 1].fraction
        before = len(points)
        measure([math.sqrt(low * high)])
        points.sort(key=lambda p: p.skipped)
        if len(points) == before:
            break
    return points


def history(points: Sequence[PathPoint]) -> list[dict[str, Any]]:
    """The path as the report lists it (dppl of the mean window loss)."""
    return [{"stage": "path", "point": p.label, "skipped_fraction": p.skipped, "loss": math.expm1(float(p.losses.mean())),
             "window_sd": float(np.std(p.losses, ddof=1)) if p.losses.size > 1 else 0.0} for p in points]
