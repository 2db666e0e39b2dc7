"""Quality at the point of use: the tokens a model decodes after a long prompt (docs/measure.md).

A technique that acts only past some context (attention selection past ``min_keys`` keys) must be
judged on the steps where it acts, through the model as deployed: each window of the user's text is
read as an app reads a prompt — ``prefix`` tokens in one call — and then ``answer`` tokens are
decoded one step at a time, teacher-forced with the text's own continuation. The reference model (the
input, or fp32) does the same on the same tokens. Only the answer steps are scored; no position of
the prompt is averaged in.

Per window: dppl = exp(mean NLL of the candidate − mean NLL of the reference over the answer steps) − 1
and top-1 agreement (argmax equal to the reference's). Over the windows: the pooled dppl (all answer
steps alike), a 95% t-interval over the per-window NLL differences, the mean and worst top-1.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .decode import LoopPlan, Stepper, decode_loop

CONFIDENCE = 0.95


@dataclasses.dataclass(frozen=True)
class AnswerWindows:
    """Where the windows read the text: ``tokens[offset : offset + prefix]`` is the prompt, the next
    ``answer`` tokens are teacher-forced answer steps (each scored against the token after it)."""

    offsets: tuple[int, ...]
    prefix: int
    answer: int
    overlapping: bool  # the text was too short for disjoint windows

    @property
    def span(self) -> int:
        return self.prefix + self.answer + 1


def plan_answer_windows(tokens_available: int, *, prefix: int, answer: int, windows: int,
                        max_positions: int | None = None, source: str = "the text") -> AnswerWindows:
    """``windows`` windows spread evenly over the text (first at 0, last ending at its end), so they
    come from far-apart parts of it; disjoint whenever the text holds them all. Raises ValueError
    (one line) when one window does not fit the text or the model's positions."""
    if prefix < 1 or answer < 1 or windows < 1:
        raise ValueError(f"need --prefix >= 1, --answer >= 1 and --windows >= 1 (got {prefix}, {answer}, {windows})")
    if max_positions is not None and prefix + answer > max_positions:
        raise ValueError(f"--prefix {prefix} + --answer {answer} = {prefix + answer} positions: the model holds "
                         f"{max_positions}")
    span = prefix + answer + 1
    if span > tokens_available:
        raise ValueError(f"{source} has {tokens_available} tokens; one window of --prefix {prefix} + --answer {answer} "
                         f"needs {span}")
    last = tokens_available - span
    offsets = (0,) if windows == 1 else tuple(int(round(i * last / (windows - 1))) for i in range(windows))
    return AnswerWindows(offsets, prefix, answer, overlapping=windows * span > tokens_available)


def _t_quantile(confidence: float, degrees: int) -> float:
    from scipy import stats  # a core dependency; imported here to keep module import light

    return float(stats.t.ppf(0.5 + confidence / 2, degrees))


def summarize(per_window: Sequence[dict[str, float]]) -> dict[str, Any]:
    """Pooled dppl with its t-interval over windows, top-1 mean and worst, from per-window rows
    holding ``nll_reference``, ``nll_candidate`` (mean over the answer steps) and ``top1``."""
    diffs = np.asarray([w["nll_candidate"] - w["nll_reference"] for w in per_window], dtype=np.float64)
    top1 = np.asarray([w["top1"] for w in per_window], dtype=np.float64)
    mean = float(diffs.mean())
    out: dict[str, Any] = {"dppl": math.expm1(mean), "top1_agreement": float(top1.mean()),
                           "top1_worst_window": float(top1.min()), "windows": len(per_window),
                           "confidence": CONFIDENCE}
    if len(per_window) > 1:
        half = _t_quantile(CONFIDENCE, len(per_window) - 1) * float(diffs.std(ddof=1)) / math.sqrt(len(per_window))
        out["dppl_low"], out["dppl_high"] = math.expm1(mean - half), math.expm1(mean + half)
    else:  # one window has no spread to read
        out["dppl_low"] = out["dppl_high"] = None
    return out


SELECTION_OP = "total/PopcountGroupQueryAttention"


def decode_selection(counters: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """What the attention selector did over a window's answer steps, from the op library's counters
    (empty when no PopcountGroupQueryAttention ran): ``keys_read`` — keys scored exactly (the K rows
    a head reads; the kept keys' V rows are among them) / keys in the cache, the cost proxy —
    ``pages_visited`` and ``pages_certified`` (rows whose choice no left-out page could change), and
    the event-driven reuse counts per query head and step."""
    total = counters.get(SELECTION_OP)
    if not total or not total.get("keys_total"):
        return {}
    return {"keys_read": float(total["pack.keys_exact_ratio"]), "pages_visited": float(total["pages.visited_ratio"]),
            "pages_certified": float(total["pages.certified_ratio"]),
            "event_ranked": float(total["event.heads_ranked"]),
            "event_reused_certified": float(total["event.reused_certified"]),
            "event_reused_budget": float(total["event.reused_budget"])}


def answer_quality_of(reference: Stepper, candidates: Mapping[str, Stepper], tokens: np.ndarray | Sequence[int],
                      windows: AnswerWindows, *, log: Callable[[str], None] | None = None) -> dict[str, dict[str, Any]]:
    """Every candidate against one reference, window by window: each model reads the window's
    prompt in one call and decodes its answer teacher-forced
    (:func:`ortsparse.measure.decode.decode_loop`, the models taking turns step by step, so the
    reference runs once for all candidates). Per candidate name: :func:`summarize`'s figures plus
    ``per_window`` rows and the plan."""
    if "reference" in candidates:
        raise ValueError("a candidate may not be named 'reference'")
    say = log or (lambda text: None)
    tokens = np.asarray(tokens).reshape(-1)
    per_window: dict[str, list[dict[str, float]]] = {name: [] for name in candidates}
    for number, offset in enumerate(windows.offsets, 1):
        loop = LoopPlan(offset=offset, prompt=windows.prefix, warmup=0, steps=windows.answer)
        # The op's counters of the answer steps (reset after the prompt) are read only with one
        # candidate: several rewrites of one model share node names, so their counts would mix.
        result = decode_loop({"reference": reference, **candidates}, tokens, loop, prefill_chunk=windows.prefix,
                             reference="reference", measure_metrics=len(candidates) == 1)
        for name in candidates:
            row = {"offset": offset, "nll_reference": result["reference"]["mean_nll"],
                   "nll_candidate": result[name]["mean_nll"],
                   "dppl": result[name]["dppl_vs_reference"], "top1": result[name]["top1_agreement"]}
            if len(candidates) == 1:
                row.update(decode_selection(result["_metrics"]))
                prompt = result["_prompt_metrics"].get(SELECTION_OP) or {}
                if prompt.get("prefill.tiles"):
                    row["prefill_skipped"] = float(prompt["prefill.skipped_ratio"])
            per_window[name].append(row)
        say(f"  window {number}/{len(windows.offsets)} (tokens {offset}..{offset + windows.span - 1}): " + "; ".join(
            f"{name} dppl {rows[-1]['dppl']:+.2%}, top-1 {rows[-1]['top1']:.3f}"
            + (f", keys read {rows[-1]['keys_read']:.1%}" if "keys_read" in rows[-1] else "")
            for name, rows in per_window.items()))
    plan = {"prefix": windows.prefix, "answer": windows.answer, "offsets": list(windows.offsets),
            "overlapping": windows.overlapping,
            "scored": f"the {windows.answer} answer steps after each {windows.prefix}-token prompt (positions "
                      f"{windows.prefix}..{windows.prefix + windows.answer - 1}); no prompt position is averaged in"}
    return {name: {**summarize(rows), **_mean_selection(rows), "per_window": rows, **plan}
            for name, rows in per_window.items()}


def _mean_selection(rows: Sequence[dict[str, float]]) -> dict[str, float]:
    """The windows' mean of each :func:`decode_selection` figure (every window has as many steps) and
    of ``prefill_skipped``, the key tiles selective prefill skipped in the prompt."""
    names = [key for key in ("keys_read", "pages_visited", "pages_certified", "event_ranked",
                             "event_reused_certified", "event_reused_budget", "prefill_skipped")
             if all(key in row for row in rows)]
    return {f"selection_{key}": float(np.mean([row[key] for row in rows])) for key in names}


def answer_quality(reference: Stepper, candidate: Stepper, tokens: np.ndarray | Sequence[int], windows: AnswerWindows,
                   *, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """:func:`answer_quality_of` for one candidate."""
    return answer_quality_of(reference, {"candidate": candidate}, tokens, windows, log=log)["candidate"]


def describe(result: dict[str, Any]) -> str:
    """One line: pooled dppl with its interval, top-1 mean and worst, windows."""
    interval = ("" if result["dppl_low"] is None else
                f" ({result['dppl_low']:+.2%} .. {result['dppl_high']:+.2%}, {result['confidence']:.0%} over windows)")
    selection = ("" if "selection_keys_read" not in result else
                 f"; the selector read {result['selection_keys_read']:.1%} of the cached keys per head and step, "
                 f"{result['selection_pages_certified']:.1%} of its page choices certified")
    return (f"answer quality after {result['prefix']}-token prompts: dppl {result['dppl']:+.2%}{interval}, "
            f"top-1 agreement {result['top1_agreement']:.3f} (worst window {result['top1_worst_window']:.3f}) "
            f"on {result['windows']} x {result['answer']} answer tokens{selection}")
