"""Whole requests (docs/measure.md "Whole requests"): what a user waits for is the prompt and then
the answer, so a setting that speeds decode and slows the prompt can make requests slower.

A request PROMPT:ANSWER is: reset the model (a KV buffer of PROMPT + ANSWER positions), feed the
prompt's PROMPT corpus tokens **in one call** (as an app hands its prompt to
``Generator.append_tokens``; time to first token = that call, whose last logits give the first
answer token), then ANSWER - 1 decode steps, teacher-forced with the corpus continuation (every
model sees the same tokens; greedy agreement with the reference model is read along the way).
Total request time = time to first token + the decode steps.

Models run one whole request after another (the order reversed every other round, so that neither
always goes first), every request shape in every round, ``rounds`` rounds spread over the run; each
ratio (the reference's time / the model's) is reported as its minimum and median over the rounds.
"""
from __future__ import annotations

import gc
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..benchmarking import SPINNING_SETTLE_S, machine_info, neighbour_line, ratio_summary, report_header, threads_policy
from ..benchmarking import neighbour as neighbour_process
from .decode import Stepper, open_stepper


@dataclass(frozen=True)
class RequestShape:
    """A request: ``prompt`` tokens in, ``answer`` tokens out."""

    prompt: int
    answer: int

    @property
    def label(self) -> str:
        return f"{self.prompt}+{self.answer}"


def parse_requests(text: str) -> list[RequestShape]:
    """``"512:64,4096:256"`` -> request shapes. Raises ValueError naming the bad entry."""
    shapes = []
    for entry in (e.strip() for e in text.split(",")):
        prompt, sep, answer = entry.partition(":")
        try:
            shape = RequestShape(int(prompt), int(answer))
        except ValueError:
            shape = None
        if not sep or shape is None or shape.prompt < 1 or shape.answer < 1:
            raise ValueError(f"request {entry!r}: give PROMPT:ANSWER with two positive token counts, e.g. 4096:256")
        shapes.append(shape)
    if not shapes:
        raise ValueError("no request given")
    return shapes


def run_request(stepper: Stepper, tokens: np.ndarray, shape: RequestShape, offset: int = 0) -> dict[str, Any]:
    """One whole request on one model: time to first token, the decode steps' times, the predictions."""
    prompt = tokens[offset:offset + shape.prompt].astype(np.int64)
    forced = tokens[offset + shape.prompt:offset + shape.prompt + shape.answer - 1].astype(np.int64)
    stepper.reset(shape.prompt + shape.answer)
    t0 = time.perf_counter()
    logits = stepper.advance(prompt)
    first = time.perf_counter() - t0
    predictions = [int(np.argmax(logits))]
    steps = []
    for token in forced:
        t0 = time.perf_counter()
        logits = stepper.advance(token.reshape(1))
        steps.append(time.perf_counter() - t0)
        predictions.append(int(np.argmax(logits)))
    decode = float(sum(steps))
    return {"ttft_s": first, "decode_s": decode, "total_s": first + decode,
            "prompt_tokens_per_s": shape.prompt / first,
            "decode_tokens_per_s": len(steps) / decode if steps else float("nan"), "predictions": predictions}


def request_bench(candidates: Sequence[Any], tokens: np.ndarray, requests: Sequence[RequestShape], *,
                  threads: Sequence[int] = (1,), rounds: int = 3, offset: int = 0, reference: str | None = None,
                  neighbour: str | None = None, spinning: bool = False, log: Callable[[str], None] = print) -> dict:
    """Every request shape on every candidate (``speed.Candidate``: name, source, runners) and thread
    count, in ``rounds`` rounds. Returns the report payload: ``rows`` (one per round, model, runner,
    request, threads) and ``ratios`` (minimum / median over the rounds of total time, time to first
    token and decode speed relative to the reference)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1 (got {rounds})")
    tokens = np.asarray(tokens).reshape(-1)
    needed = offset + max(r.prompt + r.answer for r in requests)
    if tokens.size < needed:
        raise ValueError(f"the requests need {needed} corpus tokens from offset {offset}; the corpus has {tokens.size}")
    keys = [(c.name, runner) for c in candidates for runner in c.runners]
    reference_key = next((k for k in keys if k[0] == (reference or candidates[0].name)), None)
    if reference_key is None:
        raise ValueError(f"reference {reference!r} is not one of the models")
    sources = {c.name: c.source for c in candidates}
    rows: list[dict] = []
    with neighbour_process(neighbour) as beside:
        for n_threads in threads:
            log(f"threads {n_threads}: opening {len(keys)} sessions ...")
            steppers = {key: open_stepper(sources[key[0]], key[1], n_threads, spinning=spinning) for key in keys}
            limits = [s.max_positions for s in steppers.values() if s.max_positions]
            for shape in requests:
                if limits and shape.prompt + shape.answer > min(limits):
                    raise ValueError(f"request {shape.label} does not fit in the models' {min(limits)} positions")
            for round_index in range(rounds):
                order = keys if round_index % 2 == 0 else keys[::-1]
                for shape in requests:
                    gc.collect()
                    results = {}
                    for key in order:
                        if spinning and n_threads > 1:
                            time.sleep(SPINNING_SETTLE_S)
                        results[key] = run_request(steppers[key], tokens, shape, offset)
                    base = results[reference_key]
                    for key in keys:
                        r = results[key]
                        agreement = float(np.mean(np.asarray(r["predictions"]) == np.asarray(base["predictions"])))
                        rows.append(dict(threads=n_threads, round=round_index, request=shape.label,
                                         prompt=shape.prompt, answer=shape.answer, model=key[0], runner=key[1],
                                         ttft_s=r["ttft_s"], decode_s=r["decode_s"], total_s=r["total_s"],
                                         prompt_tokens_per_s=r["prompt_tokens_per_s"],
                                         decode_tokens_per_s=r["decode_tokens_per_s"],
                                         total_speedup=base["total_s"] / r["total_s"],
                                         ttft_speedup=base["ttft_s"] / r["ttft_s"],
                                         decode_speedup=r["decode_tokens_per_s"] / base["decode_tokens_per_s"]
                                         if shape.answer > 1 else float("nan"),
                                         answer_agreement=agreement))
                        log(f"  round {round_index + 1}/{rounds} {shape.label} {key[0]} [{key[1]}]: first token "
                            f"{r['ttft_s']:.2f} s, decode {r['decode_tokens_per_s']:.1f} tok/s, total {r['total_s']:.2f} s "
                            f"(x{base['total_s'] / r['total_s']:.2f})")
            del steppers
            gc.collect()
    return dict(machine=machine_info(), reference=reference_key[0], rows=rows, ratios=request_ratios(rows),
                neighbour=(beside.result if beside is not None else None) or {"kind": "none"},
                requests=[s.label for s in requests], rounds=rounds, offset=offset, spinning=spinning)


def request_ratios(rows: Sequence[Mapping]) -> list[dict]:
    """Per (threads, request, model, runner): medians of the times and min / median / max of the ratios."""
    groups: dict[tuple, list[Mapping]] = {}
    for r in rows:
        groups.setdefault((r["threads"], r["request"], r["model"], r["runner"]), []).append(r)
    out = []
    for (threads, request, model, runner), group in groups.items():
        out.append(dict(threads=threads, request=request, model=model, runner=runner,
                        ttft_s=float(np.median([r["ttft_s"] for r in group])),
                        total_s=float(np.median([r["total_s"] for r in group])),
                        decode_tokens_per_s=float(np.median([r["decode_tokens_per_s"] for r in group])),
                        prompt_tokens_per_s=float(np.median([r["prompt_tokens_per_s"] for r in group])),
                        answer_agreement=float(np.min([r["answer_agreement"] for r in group])),
                        **{name: ratio_summary([r[name] for r in group])
                           for name in ("total_speedup", "ttft_speedup", "decode_speedup")}))
    return out


def request_markdown(payload: dict, command: str, title: str = "Whole requests: prompt + answer") -> str:
    lines = report_header(title, command, payload["machine"])
    lines += [f"Each request: the prompt's corpus tokens in one call (time to first token), then answer - 1 "
              f"teacher-forced decode steps; total = both. Models one whole request after another, the order "
              f"reversed every other round; {payload['rounds']} round(s). Ratios are the reference "
              f"(`{payload['reference']}`) time over the model's: **minimum** (the claim) / median over the rounds. "
              "Answer agreement: greedy tokens equal to the reference's (worst round). "
              f"{threads_policy(payload.get('spinning', False))}", "",
              neighbour_line(payload.get("neighbour")), "",
              "| threads | prompt+answer | model | runner | first token (s) | prompt tok/s | decode tok/s | "
              "total (s) | total speedup min / median | first-token speedup min / median | "
              "decode speedup min / median | answer agr. |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in payload["ratios"]:
        total, first, decode = r["total_speedup"], r["ttft_speedup"], r["decode_speedup"]
        lines.append(f"| {r['threads']} | {r['request']} | {r['model']} | {r['runner']} | {r['ttft_s']:.2f} | "
                     f"{r['prompt_tokens_per_s']:.0f} | {r['decode_tokens_per_s']:.1f} | {r['total_s']:.2f} | "
                     f"**{total['min']:.2f}** / {total['median']:.2f} | {first['min']:.2f} / {first['median']:.2f} | "
                     f"{decode['min']:.2f} / {decode['median']:.2f} | {r['answer_agreement']:.2f} |")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class _Model:
    name: str
    source: Any
    runners: tuple[str, ...]


def request_speed(models: Mapping[str, Any], tokens: np.ndarray, *, prompt: int, answer: int, threads: int = 1,
                  rounds: int = 3, log: Callable[[str], None] | None = None) -> dict[str, dict]:
    """Whole-request time of a few models (name -> a KV graph, or a genai folder run through the
    Generator) for one PROMPT:ANSWER shape, the first model the reference: name -> ``total_s``,
    ``ttft_s``, ``decode_tokens_per_s`` (medians over ``rounds``), ``speedup`` (reference total time /
    this model's: the **minimum** over the rounds) and ``speedup_median``."""
    from pathlib import Path

    candidates = [_Model(name, source, ("og",) if Path(str(source)).is_dir() else ("ort",))
                  for name, source in models.items()]
    payload = request_bench(candidates, tokens, [RequestShape(prompt, answer)], threads=(threads,), rounds=rounds,
                            log=log or (lambda text: None))
    return {r["model"]: {"total_s": r["total_s"], "ttft_s": r["ttft_s"], "decode_tokens_per_s": r["decode_tokens_per_s"],
                         "speedup": r["total_speedup"]["min"], "speedup_median": r["total_speedup"]["median"],
                         "request": r["request"], "rounds": rounds}
            for r in payload["ratios"]}
