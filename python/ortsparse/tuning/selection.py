"""Which point of a calibration path to write: the one skipping the most weight bytes whose loss on
windows the search never saw is expected within the budget.

Input: points along a path of allocations, ordered by the weight bytes they skip, each measured on
the same ``n`` calibration windows: ``losses[i, w]`` = NLL of point i on window w minus the
reference's NLL there (nats; the dppl over windows of equal length is ``exp(mean) - 1``).

1. **Trend**: the mean loss per point, fitted non-decreasing in skipped bytes (pool adjacent
   violators). Skipping more never helps in expectation, so a point that measured below the one
   before it is noise — a dip at a cliff's edge is pooled with its neighbours instead of chosen.
2. **Spread**: the window-to-window standard deviation per point, also fitted non-decreasing.
3. **Bound**: the final check measures the written model's mean loss on ``m`` other windows. Its
   expectation is the trend, known from ``n`` windows; its own noise has the same spread. So the
   check lands below ``trend + z * spread * sqrt(1/n + 1/m)`` with probability ~Phi(z) (z = 1.645:
   95%): the safety margin comes from the measured spread and the window counts, not a constant.
4. **Choice**: the point with the most skipped bytes whose bound is within ``log(1 + budget)``.

:func:`bootstrap_band`: the fitted trend over resampled windows (whole windows, so the points keep
their correlation), for the report's uncertainty band.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

Z_ONE_SIDED_95 = 1.645


def non_decreasing(values: Sequence[float], weights: Sequence[float] | None = None) -> np.ndarray:
    """The least-squares non-decreasing fit of ``values`` (pool adjacent violators)."""
    y = np.asarray(values, dtype=np.float64)
    w = np.ones_like(y) if weights is None else np.asarray(weights, dtype=np.float64)
    blocks: list[list[float]] = []  # [weighted mean, weight, count]
    for value, weight in zip(y, w):
        blocks.append([float(value), float(weight), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            mean_b, weight_b, count_b = blocks.pop()
            mean_a, weight_a, count_a = blocks.pop()
            total = weight_a + weight_b
            blocks.append([(mean_a * weight_a + mean_b * weight_b) / total, total, count_a + count_b])
    return np.concatenate([np.full(count, mean) for mean, _, count in blocks]) if blocks else y


@dataclasses.dataclass
class Selection:
    """The fitted curve along the path and the chosen point (``index`` None: no point fits)."""

    index: int | None
    mean: np.ndarray  # measured mean loss per point (nats)
    trend: np.ndarray  # non-decreasing fit of mean
    spread: np.ndarray  # window-to-window sd per point, fitted non-decreasing
    bound: np.ndarray  # trend + z * spread * sqrt(1/n + 1/m)
    limit: float  # log(1 + budget)
    z: float
    calibration_windows: int
    check_windows: int

    @property
    def margin_factor(self) -> float:
        """sqrt(1/n + 1/m): how the spread turns into the safety margin."""
        return math.sqrt(1.0 / self.calibration_windows + 1.0 / self.check_windows)


def choose(losses: np.ndarray, budget: float, check_windows: int, z: float = Z_ONE_SIDED_95) -> Selection:
    """The selection for ``losses`` ``[points, windows]`` (points ordered by skipped bytes) and a
    dppl ``budget``; ``check_windows``: how many windows the final check will measure."""
    losses = np.atleast_2d(np.asarray(losses, dtype=np.float64))
    n = losses.shape[1]
    mean = losses.mean(axis=1)
    spread = losses.std(axis=1, ddof=1) if n > 1 else np.zeros_like(mean)
    trend = non_decreasing(mean)
    spread = non_decreasing(spread)
    factor = math.sqrt(1.0 / n + 1.0 / max(1, check_windows))
    bound = trend + z * spread * factor
    limit = math.log1p(budget)
    within = np.flatnonzero(bound <= limit)
    # Points are ordered by skipped bytes and the bound is non-decreasing, so the last one within wins.
    return Selection(int(within[-1]) if within.size else None, mean, trend, spread, bound, limit, z, n,
                     max(1, check_windows))


def clearly_over(losses: np.ndarray, budget: float, z: float = Z_ONE_SIDED_95) -> bool:
    """Whether the last point of ``losses`` is over the budget beyond its noise (its fitted trend
    minus z standard errors): points further along the path need not be measured."""
    losses = np.atleast_2d(np.asarray(losses, dtype=np.float64))
    trend = non_decreasing(losses.mean(axis=1))
    n = losses.shape[1]
    error = losses[-1].std(ddof=1) / math.sqrt(n) if n > 1 else 0.0
    return bool(trend[-1] - z * error > math.log1p(budget))


def bootstrap_band(losses: np.ndarray, draws: int = 400, quantiles: tuple[float, float] = (0.05, 0.95),
                   seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(low, high) of the non-decreasing mean-loss fit per point over ``draws`` resamples of the
    windows (with replacement, whole windows)."""
    losses = np.atleast_2d(np.asarray(losses, dtype=np.float64))
    rng = np.random.default_rng(seed)
    n = losses.shape[1]
    fits = np.empty((draws, losses.shape[0]))
    for d in range(draws):
        fits[d] = non_decreasing(losses[:, rng.integers(0, n, n)].mean(axis=1))
    return np.quantile(fits, quantiles[0], axis=0), np.quantile(fits, quantiles[1], axis=0)


def interval(window_losses: np.ndarray, z: float = Z_ONE_SIDED_95) -> tuple[float, float, float]:
    """(mean, low, high) of a mean loss over windows, mean -/+ z standard errors (nats)."""
    values = np.asarray(window_losses, dtype=np.float64).reshape(-1)
    mean = float(values.mean())
    error = float(values.std(ddof=1) / math.sqrt(values.size)) if values.size > 1 else 0.0
    return mean, mean - z * error, mean + z * error


def as_dppl(nats: float | np.ndarray) -> float | np.ndarray:
    """A mean log ppl ratio as dppl (ppl ratio - 1)."""
    return np.expm1(nats)
