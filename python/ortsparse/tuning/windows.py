"""How ``tune`` cuts the user's text: windows, their roles, and how many the time budget allows.

A window holds ``min(512, the model's positions)`` positions: a BOS when the model's tokenizer adds
one, then ``text_len`` tokens of the text; the text is cut into chunks of ``text_len``.

**Parts.** The chunks are grouped into :data:`PARTS` contiguous parts; :data:`HELD_OUT_PARTS` of them,
spread over the text (parts 1, 5 and 8 of 8: its beginning, middle and end), are **held out**. The
**check** windows (the final check of the written model, the held-out loss curve, and the answer
windows of a long ``--context``) come only from held-out parts, the **calibration** windows
(capture, probes, the loss along the path the choice is made from) only from the others, and a
calibration window never touches a held-out part: the chunk of a calibration part next to a
held-out one is left out (a window's length apart). So the check reads pages, sections and
vocabulary the calibration never saw, as the user's other text will be; a check interleaved with
the calibration (every third window, as tune once did) shares them and read half the loss an
audit measured on the last 30% of a manual. How much the loss moves from part to part is what
the choice's margin and the held-out interval are made of (:mod:`.selection`), so each window
keeps the part it came from.

Sizes are in whole chunks and never shrink as the text grows: the chunks are dealt to the parts
evenly (the remainder to the first parts); with a long ``--context``, each held-out part holds at
least one answer window (a prompt of ``answer_prefix`` tokens and :data:`ANSWER_STEPS` answer
tokens, contiguous) and the calibration parts share what is left.

How many: every window the text gives, unless measuring them would exceed :data:`TIME_BUDGET_S`
at the speed of one forward pass measured on this machine; then an evenly spread subset of each
role (never fewer than the minimum). A text too short for :data:`MIN_CALIBRATION` calibration and
:data:`MIN_CHECK` check windows (and, with a long context, an answer window in each held-out part)
is refused before anything is measured, saying how long it has to be.
"""
from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

import numpy as np

from ..graph_rewrite.errors import ModelFileError
from ..measure.answer_quality import AnswerWindows, plan_answer_windows

WINDOW_LEN = 512
MIN_WINDOW = 64
MIN_CALIBRATION = 10  # the spread estimate and the monotone fit need this many at least
MIN_CHECK = 6
PARTS = 8  # contiguous parts of the text
HELD_OUT_PARTS = 3  # of them held out: the beginning, the middle and the end (held_out_parts())
ANSWER_STEPS = 256  # teacher-forced answer tokens after each long prompt (the long --context check)
RECOMMENDED_TOKENS = 20_000  # ~40 windows of 512: the margin from the spread is then ~0.35 sd
TIME_BUDGET_S = 900.0  # forward passes of tune's loss measurements, at the measured speed
# Forward passes per window: calibration = capture + dense probe + reference + the path's points
# (~10, on the probe graph, ~1.3x a plain pass); check = reference + written model + curve points.
PATH_POINTS = 10
CURVE_POINTS = 3
PROBE_COST = 1.3


def held_out_parts() -> tuple[int, ...]:
    """The held-out parts' indices, spread over the text: (0, 4, 7) of 8."""
    return tuple(int(i) for i in spread_indices(PARTS, HELD_OUT_PARTS))


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each role reads the text (token offsets): the parts, the windows and the part each
    window comes from, and the long-context answer windows."""

    parts: tuple[tuple[int, int], ...]  # [start, end) tokens of each part
    held_out: tuple[int, ...]
    calibration_starts: np.ndarray
    calibration_parts: np.ndarray
    check_starts: np.ndarray
    check_parts: np.ndarray
    answers: AnswerWindows | None

    def enough(self) -> bool:
        return (self.calibration_starts.size >= MIN_CALIBRATION and self.check_starts.size >= MIN_CHECK
                and (self.answers is None or len(self.answers.offsets) >= len(self.held_out)))


def part_chunks(chunks: int, held_out: tuple[int, ...], answer_chunks: int = 0) -> list[int] | None:
    """Chunks per part (None: the text is too short for the held-out parts). Each count is
    non-decreasing in ``chunks``, so a longer text never gives fewer windows of any role."""
    base, extra = divmod(chunks, PARTS)
    held = {i: max(answer_chunks, base + (i < extra)) for i in held_out}
    rest = chunks - sum(held.values())
    if rest < 0:
        return None
    calibration = [i for i in range(PARTS) if i not in held]
    base, extra = divmod(rest, len(calibration))
    share = {i: base + (j < extra) for j, i in enumerate(calibration)}
    return [held.get(i, share.get(i, 0)) for i in range(PARTS)]


def lay_out(tokens: int, text_len: int, answer_prefix: int | None = None) -> Layout:
    """The layout of a text of ``tokens`` tokens in chunks of ``text_len`` (see the module
    docstring); ``answer_prefix``: the long-context answer windows' prompt length (None: none)."""
    held_out = held_out_parts()
    span = None if answer_prefix is None else answer_prefix + ANSWER_STEPS + 1
    sizes = part_chunks(tokens // text_len, held_out, 0 if span is None else -(-span // text_len))
    if sizes is None:  # too short for the held-out parts: no window of any role
        sizes = [0] * PARTS
    edges = np.concatenate([[0], np.cumsum(sizes)])
    parts = tuple((int(a) * text_len, int(b) * text_len) for a, b in zip(edges[:-1], edges[1:]))
    roles: dict[bool, tuple[list[int], list[int]]] = {True: ([], []), False: ([], [])}
    answers: list[int] = []
    for i, (first, end) in enumerate(zip(edges[:-1], edges[1:])):
        held = i in held_out
        if not held:  # the chunk next to a held-out part is left out: a window's length between the roles
            first, end = first + (i - 1 in held_out), end - (i + 1 in held_out)
        for chunk in range(first, end):
            roles[held][0].append(chunk * text_len)
            roles[held][1].append(i)
        if held and span is not None:
            start, stop = parts[i]
            fit = (stop - start) // span
            if fit:
                plan = plan_answer_windows(stop - start, prefix=answer_prefix, answer=ANSWER_STEPS, windows=fit)
                answers.extend(start + offset for offset in plan.offsets)
    as_array = lambda values: np.asarray(values, dtype=np.int64)  # noqa: E731
    return Layout(parts, held_out, as_array(roles[False][0]), as_array(roles[False][1]), as_array(roles[True][0]),
                  as_array(roles[True][1]),
                  None if span is None else AnswerWindows(tuple(answers), answer_prefix, ANSWER_STEPS, False))


@dataclasses.dataclass(frozen=True)
class WindowPlan:
    """The windows of one text, what each is for, and the part of the text each comes from."""

    text_len: int  # text tokens per window (a BOS, when there is one, comes on top)
    calibration: np.ndarray  # [n, text_len] token ids
    check: np.ndarray  # [m, text_len]
    calibration_parts: np.ndarray  # [n] the part each calibration window comes from
    check_parts: np.ndarray  # [m]
    parts: tuple[tuple[int, int], ...]  # [start, end) tokens of each part
    held_out: tuple[int, ...]  # the parts the check windows come from
    answers: AnswerWindows | None  # the long-context answer windows (in held-out parts), or None
    available: tuple[int, int]  # calibration and check windows the text offered
    note: str  # how the counts were decided

    @property
    def probe(self) -> np.ndarray:
        """The window the per-unit probes run on (a calibration window)."""
        return self.calibration[:1]

    @property
    def split(self) -> str:
        """How the text was split, in words (the report's ``split``)."""
        held = ", ".join(str(i + 1) for i in self.held_out)
        return (f"{len(self.parts)} contiguous parts of the text; parts {held} (its beginning, middle and end) held "
                f"out: the check windows come only from them, the calibration windows only from the other "
                f"{len(self.parts) - len(self.held_out)}, at least one window ({self.text_len} tokens) apart")

    def parts_report(self) -> list[dict[str, object]]:
        """Per part: its tokens, role, and the windows measured in it."""
        return [{"tokens": list(span), "held_out": i in self.held_out,
                 "calibration_windows": int(np.sum(self.calibration_parts == i)),
                 "check_windows": int(np.sum(self.check_parts == i))}
                for i, span in enumerate(self.parts)]


def minimum_tokens(text_len: int, answer_prefix: int | None = None) -> int:
    """The shortest text :func:`lay_out` gives enough windows of every role (every count is
    non-decreasing in the text's chunks, so every longer text does too)."""
    chunks = MIN_CALIBRATION + MIN_CHECK
    while not lay_out(chunks * text_len, text_len, answer_prefix).enough():
        chunks += 1
    return chunks * text_len


def window_length(positions: int | None) -> int:
    return min(WINDOW_LEN, positions or WINDOW_LEN)


def check_length(tokens: int, text_len: int, answer_prefix: int | None = None) -> None:
    """Refuses (ModelFileError) a text too short to calibrate on in windows of ``text_len`` text
    tokens (and, with ``answer_prefix``, to hold an answer window in each held-out part), naming
    the length it needs."""
    needed = minimum_tokens(text_len, answer_prefix)
    if text_len < MIN_WINDOW or tokens < needed:
        recommended = max(needed, RECOMMENDED_TOKENS)
        answers = ("" if answer_prefix is None else
                   f"; {HELD_OUT_PARTS} answer windows of a {answer_prefix}-token prompt + {ANSWER_STEPS} answer "
                   "tokens, one in each held-out part")
        raise ModelFileError(
            f"the text has {tokens} tokens; tune needs at least {needed} ({MIN_CALIBRATION} calibration + "
            f"{MIN_CHECK} check windows of {text_len} in {PARTS} parts, {HELD_OUT_PARTS} held out and a window "
            f"apart{answers}) to tell the loss's trend from window-to-window noise on text it did not calibrate "
            f"on, and writes reliably from ~{recommended} tokens: give a longer text like the model's real inputs")


def spread_indices(count: int, wanted: int) -> np.ndarray:
    """``wanted`` indices spread evenly over ``range(count)``."""
    return np.unique(np.linspace(0, count - 1, wanted).round().astype(int))


def loss_pass_seconds(seconds_per_window: float, calibration: int, check: int) -> float:
    """The forward passes of tune's loss measurements over ``calibration`` and ``check`` windows at
    ``seconds_per_window`` (the path at :data:`PATH_POINTS` points: it may take a few more)."""
    return seconds_per_window * (calibration * (3 + PATH_POINTS * PROBE_COST) + check * (2 + CURVE_POINTS * PROBE_COST))


def plan_windows(tokens: np.ndarray, text_len: int, *, seconds_per_window: float | None = None,
                 windows: int | None = None, answer_prefix: int | None = None,
                 budget_s: float = TIME_BUDGET_S) -> WindowPlan:
    """The text chunks of ``text_len`` tokens of ``tokens`` (see the module docstring). ``windows``:
    the user's count (that many calibration windows and as many check windows at most; no time
    cap). ``seconds_per_window``: one forward pass over a window, measured (None: no time cap).
    ``answer_prefix``: plan the long-context answer windows with prompts of this many tokens."""
    tokens = np.asarray(tokens).reshape(-1)
    check_length(tokens.size, text_len, answer_prefix)
    layout = lay_out(tokens.size, text_len, answer_prefix)
    available = (layout.calibration_starts.size, layout.check_starts.size)
    if windows is not None:
        n, m = min(windows, available[0]), min(windows, available[1])
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
    calibration = spread_indices(available[0], n)
    check = spread_indices(available[1], m)
    cut = lambda starts: tokens[starts[:, None] + np.arange(text_len)]  # noqa: E731
    return WindowPlan(text_len, cut(layout.calibration_starts[calibration]), cut(layout.check_starts[check]),
                      layout.calibration_parts[calibration], layout.check_parts[check], layout.parts,
                      layout.held_out, layout.answers, available, note)


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
