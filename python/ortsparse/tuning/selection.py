"""Which point of a calibration path to write: the one skipping the most weight bytes whose loss on
parts of the text the search never saw is expected within the budget.

Input: points along a path of allocations, ordered by the weight bytes they skip, each measured on
the same ``n`` calibration windows: ``losses[i, w]`` = NLL of point i on window w minus the
reference's NLL there (nats; the dppl over windows of equal length is ``exp(mean) - 1``). The
windows come from contiguous parts of the text (:mod:`.windows`): ``parts[w]`` is window w's part,
and the check windows come from other, held-out parts.

1. **Trend**: the mean loss per point, fitted non-decreasing in skipped bytes (pool adjacent
   violators). Skipping more never helps in expectation, so a point that measured below the one
   before it is noise — a dip at a cliff's edge is pooled with its neighbours instead of chosen.
2. **Spread**, in two parts (:func:`variance_components`, one-way random effects by the method of
   moments, parts as clusters): how much a part's loss moves from the text's (``tau^2``, between
   parts: one section of a manual is hit harder than another) and how much a window's moves from
   its part's (``sigma^2``, within parts). One window per part (or no parts given) cannot tell them
   apart: then all of it counts as between parts (the larger margin).
3. **Bound**: the final check measures the written model's mean loss on ``m`` windows of other
   parts. Its expectation is the trend, known from ``n`` windows in ``c`` parts; the difference of
   the two means varies by ``tau^2 (1/c + 1/h) + sigma^2 (1/n + 1/m)`` (``c``, ``h``: the effective
   numbers of calibration and check parts, ``n^2 / sum n_j^2``). So the check lands below
   ``trend + z * sqrt(that)`` with probability ~Phi(z) (z = 1.645: 95%): a text whose sections
   differ gets a wider margin than one that reads alike throughout, and the margin comes from the
   measured spreads and counts, not a constant. (Without parts: ``trend + z * sd * sqrt(1/n + 1/m)``.)
   The error is fitted non-decreasing along the path, as the trend is.
4. **Choice**: the point with the most skipped bytes whose bound is within ``log(1 + budget)``.

:func:`interval`: the held-out loss with the range one more part of the same text is expected in
(``mean -/+ z sqrt(tau^2 (1 + 1/h) + sigma^2 / m)``, ``tau^2`` from the calibration parts): the
check's mean predicts another part of the document, and the interval says how far that part may
land from it. :func:`bootstrap_band`: the fitted trend over resampled windows (whole windows, so the
points keep their correlation), for the report's uncertainty band.
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


def effective_parts(parts: np.ndarray) -> float:
    """How many independent parts the windows' mean is worth: ``n^2 / sum n_j^2`` (``n`` windows,
    ``n_j`` in part j); the number of parts when they hold as many windows each."""
    _, counts = np.unique(np.asarray(parts), return_counts=True)
    return float(counts.sum() ** 2 / np.sum(counts.astype(np.float64) ** 2))


def variance_components(values: np.ndarray, parts: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(between parts ``tau^2``, within parts ``sigma^2``) of ``values`` ``[points, windows]`` whose
    windows come from ``parts`` (None: every window its own part), per point: one-way random
    effects by the method of moments (unbalanced: ``n0 = (n - sum n_j^2 / n) / (c - 1)``),
    ``tau^2`` clipped at 0. Where no part holds two windows the two cannot be told apart: all the
    variance counts as between parts. One window: no spread (zeros)."""
    values = np.atleast_2d(np.asarray(values, dtype=np.float64))
    n = values.shape[1]
    zeros = np.zeros(values.shape[0])
    if n < 2:
        return zeros, zeros
    labels = np.arange(n) if parts is None else np.asarray(parts)
    if labels.shape != (n,):
        raise ValueError(f"{labels.size} part labels for {n} windows")
    names, index, counts = np.unique(labels, return_inverse=True, return_counts=True)
    c = names.size
    if c == n:  # one window per part
        return values.var(axis=1, ddof=1), zeros
    sums = np.zeros((values.shape[0], c))
    np.add.at(sums.T, index, values.T)
    part_means = sums / counts
    within = ((values - part_means[:, index]) ** 2).sum(axis=1) / (n - c)
    if c == 1:  # one part: its windows say nothing about other parts
        return zeros, within
    grand = values.mean(axis=1, keepdims=True)
    between_square = (counts * (part_means - grand) ** 2).sum(axis=1) / (c - 1)
    n0 = (n - np.sum(counts.astype(np.float64) ** 2) / n) / (c - 1)
    return np.maximum(0.0, (between_square - within) / n0), within


@dataclasses.dataclass
class Selection:
    """The fitted curve along the path and the chosen point (``index`` None: no point fits)."""

    index: int | None
    mean: np.ndarray  # measured mean loss per point (nats)
    trend: np.ndarray  # non-decreasing fit of mean
    spread: np.ndarray  # window-to-window sd per point, fitted non-decreasing
    part_sd: np.ndarray  # between-part sd per point (tau), fitted non-decreasing
    error: np.ndarray  # sd of (check mean - calibration mean) per point, fitted non-decreasing
    bound: np.ndarray  # trend + z * error
    limit: float  # log(1 + budget)
    z: float
    calibration_windows: int
    check_windows: int
    calibration_parts: float  # c: the effective number of parts the calibration windows come from
    check_parts: float  # h: the check windows'

    @property
    def margin_factor(self) -> float:
        """sqrt(1/n + 1/m): how the within-part spread turns into the safety margin."""
        return math.sqrt(1.0 / self.calibration_windows + 1.0 / self.check_windows)

    @property
    def part_factor(self) -> float:
        """sqrt(1/c + 1/h): how the between-part spread turns into the safety margin."""
        return math.sqrt(1.0 / self.calibration_parts + 1.0 / self.check_parts)


def choose(losses: np.ndarray, budget: float, check_windows: int, z: float = Z_ONE_SIDED_95, *,
           parts: np.ndarray | None = None, check_parts: np.ndarray | None = None) -> Selection:
    """The selection for ``losses`` ``[points, windows]`` (points ordered by skipped bytes) and a
    dppl ``budget``; ``check_windows``: how many windows the final check will measure. ``parts``,
    ``check_parts``: the part of the text each calibration and each check window comes from (None:
    every window its own part, the windows independent)."""
    losses = np.atleast_2d(np.asarray(losses, dtype=np.float64))
    n, m = losses.shape[1], max(1, check_windows)
    if check_parts is not None and len(check_parts) != check_windows:
        raise ValueError(f"{len(check_parts)} check part labels for {check_windows} check windows")
    mean = losses.mean(axis=1)
    spread = losses.std(axis=1, ddof=1) if n > 1 else np.zeros_like(mean)
    between, within = variance_components(losses, parts)
    c = float(n) if parts is None else effective_parts(parts)
    h = float(m) if check_parts is None else effective_parts(check_parts)
    error = non_decreasing(np.sqrt(between * (1.0 / c + 1.0 / h) + within * (1.0 / n + 1.0 / m)))
    trend = non_decreasing(mean)
    bound = trend + z * error
    limit = math.log1p(budget)
    within_budget = np.flatnonzero(bound <= limit)
    # Points are ordered by skipped bytes and the bound is non-decreasing, so the last one within wins.
    return Selection(int(within_budget[-1]) if within_budget.size else None, mean, trend, non_decreasing(spread),
                     non_decreasing(np.sqrt(between)), error, bound, limit, z, n, m, c, h)


def clearly_over(losses: np.ndarray, budget: float, z: float = Z_ONE_SIDED_95, parts: np.ndarray | None = None
                 ) -> bool:
    """Whether the last point of ``losses`` is over the budget beyond its noise (its fitted trend
    minus z standard errors of its mean, ``parts`` as clusters): points further along the path need
    not be measured."""
    losses = np.atleast_2d(np.asarray(losses, dtype=np.float64))
    trend = non_decreasing(losses.mean(axis=1))
    n = losses.shape[1]
    between, within = variance_components(losses[-1:], parts)
    c = float(n) if parts is None else effective_parts(parts)
    error = math.sqrt(float(between[0]) / c + float(within[0]) / n)
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


def interval(window_losses: np.ndarray, z: float = Z_ONE_SIDED_95, *, parts: np.ndarray | None = None,
             part_variance: float | None = None) -> tuple[float, float, float]:
    """(mean, low, high) of a mean loss over windows (nats). Without parts: mean -/+ z standard
    errors. With ``parts`` (each window's part) and ``part_variance`` (``tau^2``, how much a part's
    loss moves from the text's, from the calibration parts): the range one more part of the text
    is expected in, mean -/+ z sqrt(tau^2 (1 + 1/h) + sigma^2 / m), ``sigma^2`` the windows'
    within-part variance (all of their variance where no part holds two), ``h`` the effective parts."""
    values = np.asarray(window_losses, dtype=np.float64).reshape(-1)
    mean = float(values.mean())
    if values.size < 2:
        return mean, mean, mean
    if parts is None or part_variance is None:
        error = float(values.std(ddof=1) / math.sqrt(values.size))
        return mean, mean - z * error, mean + z * error
    between, within = variance_components(values[None, :], parts)
    sigma2 = float(within[0]) if np.unique(parts).size < values.size else float(between[0])
    error = math.sqrt(part_variance * (1.0 + 1.0 / effective_parts(parts)) + sigma2 / values.size)
    return mean, mean - z * error, mean + z * error


def as_dppl(nats: float | np.ndarray) -> float | np.ndarray:
    """A mean log ppl ratio as dppl (ppl ratio - 1)."""
    return np.expm1(nats)
