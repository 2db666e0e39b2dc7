"""How ``tune`` cuts the user's text: windows, their roles, and how many the time budget allows.

A window holds ``min(512, the model's positions)`` positions: a BOS when the model's tokenizer adds
one, then ``text_len`` tokens of the text; the text is cut into chunks of ``text_len``. When a long context is
checked, its piece (``context`` contiguous tokens) is taken from the end of the text first. Of the
other windows, every third is a **check** window (the final check of the written model, and the
held-out loss curve) and the rest **calibrate** (capture, probes, the loss along the path the
choice is made from): no window serves both.

How many: every window the text gives, unless measuring them would exceed :data:`TIME_BUDGET_S`
at the speed of one forward pass measured on this machine; then an evenly spread subset (never
fewer than the minimum). A text too short to tell the loss's trend from window-to-window noise is
refused before anything is measured, saying how long it has to be.
"""
from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

import numpy as np

from ..graph_rewrite.errors import ModelFileError

WINDOW_LEN = 512
MIN_WINDOW = 64
MIN_CALIBRATION = 10  # the spread estimate and the monotone fit need this many at least
MIN_CHECK = 6
RECOMMENDED_TOKENS = 20_000  # ~40 windows of 512: the margin from the spread is then ~0.35 sd
TIME_BUDGET_S = 900.0  # forward passes of tune's loss measurements, at the measured speed
# Forward passes per window: calibration = capture + dense probe + reference + the path's points
# (~10, on the probe graph, ~1.3x a plain pass); check = reference + written model + curve points.
PATH_POINTS = 10
CURVE_POINTS = 3
PROBE_COST = 1.3


@dataclasses.dataclass(frozen=True)
class WindowPlan:
    """The windows of one text and what each is for."""

    text_len: int  # text tokens per window (a BOS, when there is one, comes on top)
    calibration: np.ndarray  # [n, text_len] token ids
    check: np.ndarray  # [m, text_len]
    long_piece: np.ndarray | None  # [context] contiguous tokens for the long-context check
    available: tuple[int, int]  # calibration and check windows the text offered
    note: str  # how the counts were decided

    @property
    def probe(self) -> np.ndarray:
        """The window the per-unit probes run on (a calibration window)."""
        return self.calibration[:1]


def minimum_tokens(text_len: int, long_context: int | None = None) -> int:
    return (MIN_CALIBRATION + MIN_CHECK) * text_len + (long_context or 0)


def window_length(positions: int | None) -> int:
    return min(WINDOW_LEN, positions or WINDOW_LEN)


def check_length(tokens: int, text_len: int, long_context: int | None = None) -> None:
    """Refuses (ModelFileError) a text too short to calibrate on in windows of ``text_len`` text
    tokens, naming the length it needs."""
    needed = minimum_tokens(text_len, long_context)
    if text_len < MIN_WINDOW or tokens < needed:
        recommended = max(needed, RECOMMENDED_TOKENS)
        raise ModelFileError(
            f"the text has {tokens} tokens; tune needs at least {needed} ({MIN_CALIBRATION} calibration + "
            f"{MIN_CHECK} check windows of {text_len}" + (f" + a {long_context}-token piece" if long_context else "")
            + f") to tell the loss's trend from window-to-window noise, and writes reliably from ~{recommended} "
            f"tokens: give a longer text like the model's real inputs")


def spread_indices(count: int, wanted: int) -> np.ndarray:
    """``wanted`` indices spread evenly over ``range(count)``."""
    return np.unique(np.linspace(0, count - 1, wanted).round().astype(int))


def loss_pass_seconds(seconds_per_window: float, calibration: int, check: int) -> float:
    """The forward passes of tune's loss measurements over ``calibration`` and ``check`` windows at
    ``seconds_per_window`` (the path at :data:`PATH_POINTS` points: it may take a few more)."""
    return seconds_per_window * (calibration * (3 + PATH_POINTS * PROBE_COST) + check * (2 + CURVE_POINTS * PROBE_COST))


def plan_windows(tokens: np.ndarray, text_len: int, *, seconds_per_window: float | None = None,
                 windows: int | None = None, long_context: int | None = None,
                 budget_s: float = TIME_BUDGET_S) -> WindowPlan:
    """The text chunks of ``text_len`` tokens of ``tokens`` (see the module docstring). ``windows``:
    the user's count (that many calibration windows and as many check windows at most; no time
    cap). ``seconds_per_window``: one forward pass over a window, measured (None: no time cap)."""
    tokens = np.asarray(tokens).reshape(-1)
    check_length(tokens.size, text_len, long_context)
    long_piece = None
    if long_context:
        long_piece = tokens[tokens.size - long_context:]
        tokens = tokens[:tokens.size - long_context]
    count = tokens.size // text_len
    cut = tokens[:count * text_len].reshape(count, text_len)
    is_check = np.arange(count) % 3 == 1
    calibration, check = cut[~is_check], cut[is_check]
    available = (len(calibration), len(check))
    if windows is not None:
        n, m = min(windows, len(calibration)), min(windows, len(check))
        note = f"--windows {windows}"
    else:
        n, m = available
        note = "every window the text gives"
        if seconds_per_window:
            cost = loss_pass_seconds(seconds_per_window, n, m)
            if cost > budget_s:
                scale = budget_s / cost
                n = max(MIN_CALIBRATION, math.floor(n * scale))
                m = max(MIN_CHECK, math.floor(m * scale))
                note = (f"{n} of {available[0]} calibration and {m} of {available[1]} check windows: the loss passes "
                        f"of the path and the check fit ~{budget_s / 60:.0f} min at {seconds_per_window:.2f} s per "
                        f"window here; one probe pass per layer group comes on top")
    return WindowPlan(text_len, calibration[spread_indices(len(calibration), n)], check[spread_indices(len(check), m)],
                      long_piece, available, note)


class Progress:
    """Forward passes done of about ``planned``: the time so far and, at the pace measured so far,
    the time left (``clock``: seconds, monotonic)."""

    def __init__(self, what: str, planned: int, clock: Callable[[], float] = time.perf_counter) -> None:
        self.what, self.planned, self.done = what, planned, 0
        self.clock = clock
        self.start = clock()

    def advance(self, passes: int) -> str:
        """Counts ``passes`` more; the line saying where the work stands."""
        self.done += passes
        elapsed = self.clock() - self.start
        line = f"{self.what}: {self.done} window passes of ~{self.planned} in {elapsed:.0f} s"
        if self.done >= self.planned:
            return line + " (extending or refining the path: a point at a time)"
        return line + f", ~{(self.planned - self.done) * elapsed / self.done:.0f} s left at this pace"
