"""``tune``: from "my model + my text" to a tuned model that was measured as written.

1. **Windows** (:mod:`.windows`): the text cut into calibration and check windows; too short a text
   is refused before anything is measured.
2. **Calibrate** (:mod:`ortsparse.harness.allocation`): each gated layer's cost curve and probe on
   the calibration windows; what gating each layer saves in time on this machine
   (:mod:`.layer_speed`: a layer stays dense where gating does not pay); then a **path** of
   allocations of increasing skipped bytes, each measured window by window (:mod:`.search`).
3. **Choose** (:mod:`.selection`): the point skipping the most bytes whose monotone-fitted loss plus
   a margin from the measured window-to-window spread is within the budget.
4. **Write once, into staging**: the model (a genai folder or an .onnx file) is rewritten once,
   into a staging place beside OUT.
5. **Check what is written**: the staged decoder (its gated calls lifted to every row, as decode
   runs them) against the reference on the check windows — never used to calibrate or choose;
   the held-out loss curve around the choice on the probe graph; the long-context check.
   Over the budget: nothing is moved into place.
6. **Speed**: the staged model against MODEL in the real decode loop.
7. **Commit**: model and reports moved into place in one step.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from .._library import reset_metrics
from ..benchmarking import machine_info, versions
from ..graph_rewrite import KwtaSettings, RewriteConfig, TechniqueChoice
from ..graph_rewrite.as_decoded import as_decoded
from ..graph_rewrite.config import parse_overrides
from ..graph_rewrite.errors import ModelFileError
from ..graph_rewrite.files import rewrite_file
from ..graph_rewrite.genai import model_input, rewrite_genai_folder, source_entries, written_by_ortsparse
from ..graph_rewrite.output_paths import Inputs, OutputFiles, resolve_report_stem
from ..graph_rewrite.rules import DOMAIN
from ..graph_rewrite.techniques.popcount import AttentionSettings
from ..harness import allocation, head_placement
from ..harness.corpus import first_scored, text_per_window
from ..harness.op_metrics import snapshot
from ..harness.perplexity import compare_lm, perplexity
from ..harness.request import request_speed
from ..harness.speed import decode_speed
from ..harness.text import BosChoice, as_bos
from ..runtime import context_length, genai_folder, load_proto, open_session, uses_ortsparse
from . import report as reports
from . import layer_speed, search, selection
from .windows import check_length, plan_windows, window_length

LONG_CONTEXT = 2048  # below this, attention selection does not pay (measured; docs/measure.md)
# The written model gates calls of up to this many rows (decode, small batches); longer calls (a
# prompt) run dense. The check lifts this (every row gated), so its dppl is what generated tokens
# see and an upper bound for prompt tokens, which the written model computes exactly.
DEPLOY_MAX_GATED_ROWS = 8
REQUEST_ANSWER = 256  # the answer of the request --context measures: prompt + 256 generated tokens
HELD_OUT_NEIGHBOURS = (-1, 1, 2)  # path points around the choice measured on the check windows

EXIT_WRITTEN = 0
EXIT_NOT_WRITTEN = 1  # the check missed the budget, or nothing could be gated within it
EXIT_WRITTEN_SLOWER = 3  # written, but it decoded slower than MODEL here (the last line says so)
REPORT_FILES = ((".json", "JSON report"), (".md", "markdown report"), (".png", "plot"))


def tune_outputs(model: str | Path, output: str | Path, report_stem: str | Path | None = None,
                 protected: Mapping[str | os.PathLike, str] | None = None, reference: str | Path | None = None
                 ) -> tuple[OutputFiles, dict[str, Path]]:
    """What tune reads (``model`` and its data or folder, ``reference``, ``protected``: the text and
    tokenizer) and writes (``output``, a file or, for a genai folder, a folder; the report files
    ``<stem>.json/.md/.png``), declared and checked (graph_rewrite/output_paths.py): the
    OutputFiles to stage them in, and the destinations (``"model"`` and the report suffixes).
    Nothing is written."""
    source = Path(model)
    folder = genai_folder(source) if source.is_dir() else None
    reads = Inputs(dict(protected or {})).add_model(folder or source,
                                                    "the source folder" if folder else "the input model")
    reads.add_model(reference, "the reference model")
    outputs = OutputFiles(reads)
    destination = (outputs.add(output, "output") if folder is None  # as given: "out/" names a folder
                   else outputs.add_folder(output, "output", replaceable=written_by_ortsparse))
    if folder is not None:
        source_entries(folder)  # a link the copy refuses (outside, dangling, a loop): now, not after calibrating
    out = Path(os.path.abspath(output))
    stem = resolve_report_stem(report_stem, f"{out.name}.tune") if report_stem is not None \
        else out.with_name(out.name + ".tune")
    targets = {suffix: outputs.add(f"{stem}{suffix}", what) for suffix, what in REPORT_FILES}
    return outputs, {"model": destination, **targets}


def _with_bos(chunks: np.ndarray, bos: int | None) -> np.ndarray:
    """Model windows from text chunks: ``[bos] + chunk`` each (the chunks as they are without a BOS)."""
    chunks = np.asarray(chunks, dtype=np.int64)
    if bos is None:
        return chunks
    return np.concatenate([np.full((chunks.shape[0], 1), bos, dtype=np.int64), chunks], axis=1)


def _gating_config(entries: list[dict[str, Any]], attention=None, max_gated_rows: int = 0) -> RewriteConfig:
    # The entries update the base settings, so max_gated_rows reaches every gated layer.
    base = KwtaSettings(max_gated_rows=max_gated_rows)
    return RewriteConfig(techniques={"kwta": TechniqueChoice(base, enabled=False, target="all")},
                         overrides=parse_overrides({"layers": entries}), attention=attention)


def every_row_gated(path: Path) -> onnx.ModelProto:
    """The written decoder at ``path`` computing every row as a decode step does
    (:func:`ortsparse.graph_rewrite.as_decoded.as_decoded`: gated layers gate a window's prefill,
    attention selects keys in it), the weights, thresholds and every other byte as written."""
    return as_decoded(onnx.load(str(path)))


def _seconds_per_window(session: Any, model: Any, tokens: np.ndarray, window_len: int, bos: BosChoice) -> float:
    """One forward pass over a window, timed after a warm-up pass (the first run of a session
    allocates and is slower)."""
    perplexity(model, tokens[:window_len], 1, window_len, session=session, bos=bos)
    clock = time.perf_counter()
    perplexity(model, tokens[window_len:2 * window_len], 1, window_len, session=session, bos=bos)
    return time.perf_counter() - clock


@contextlib.contextmanager
def _staged_model(folder: Path | None, decoder: Path, out: Path, config: RewriteConfig, outputs: OutputFiles,
                  destination: Path) -> Iterator[tuple[Path, Path, Callable[[], None]]]:
    """The tuned model written once into ``outputs``' staging (committed with the reports): (staged
    model to run — folder or file —, its decoder file, the commit of the model part: nothing apart)."""
    if folder is not None:
        written = rewrite_genai_folder(folder, out, config, outputs=outputs)
        staged = outputs.staged(destination)
        yield staged, staged / written.model_file.relative_to(out), lambda: None
    else:
        rewrite_file(decoder, out, config, progress=False, outputs=outputs)
        staged = outputs.staged(destination)
        yield staged, staged, lambda: None


def _commit(commit_model: Callable[[], None], outputs: OutputFiles) -> None:
    """Model, then reports, with SIGINT/SIGTERM/SIGHUP held back so the step is not split."""
    stops = {signal.SIGINT, *(getattr(signal, n) for n in ("SIGTERM", "SIGHUP") if hasattr(signal, n))}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, stops) if hasattr(signal, "pthread_sigmask") else None
    try:
        commit_model()
        outputs.commit()
    finally:
        if previous is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _held_out(written: onnx.ModelProto, check: np.ndarray, window_len: int, bos: BosChoice,
              reference_nll: Mapping[str, Any]) -> dict[str, Any]:
    """The written model on the check windows (text chunks, a BOS first when ``bos``) against the
    reference's run there."""
    flat, windows = check.reshape(-1), check.shape[0]
    reset_metrics()
    session = open_session(written)  # open until the metrics are read
    run = perplexity(written, flat, windows, window_len, session=session, bos=bos)
    metrics = snapshot(written) if uses_ortsparse(written) else {}
    losses = run["window_nll"] - reference_nll["window_nll"]
    mean, low, high = selection.interval(losses)
    return {"dppl": float(math.expm1(mean)), "dppl_low": float(math.expm1(low)), "dppl_high": float(math.expm1(high)),
            "top1_agreement": float(np.mean(run["predictions"] == reference_nll["predictions"])),
            "windows": int(windows), "window_len": int(window_len), "window_losses": losses.tolist(),
            "ppl_reference": float(math.exp(reference_nll["nll"])), "ppl_tuned": float(run["ppl"]),
            "measured_on": "the written decoder, every row gated", "metrics": metrics}


def tune(model: str | Path, tokens: np.ndarray, output: str | Path, *, max_dppl: float = 0.02,
         margin: float | None = None, context: int | None = None, threads: int = 1, speed_steps: int = 32,
         report_stem: str | Path | None = None, protected: Mapping[str | os.PathLike, str] | None = None,
         reference: str | Path | None = None, method: str = "allocated", log: Callable[[str], None] = print,
         windows: int | None = None, command: str | None = None, bos: BosChoice | int | None = None,
         speed_aware: bool = True) -> dict[str, Any]:
    """Tune ``model`` (an ONNX decoder or a genai folder) on ``tokens`` within ``max_dppl`` on check
    windows; write ``output`` and the report ``<report_stem>.{json,md,png}`` together, or nothing.
    Returns the report: ``written``, ``exit_status`` (:data:`EXIT_WRITTEN`, :data:`EXIT_NOT_WRITTEN`,
    :data:`EXIT_WRITTEN_SLOWER`), ``last_line``. ``reference``: measure dppl against this model
    (the fp32 model of a quantized ``model``: the budget is then the total loss). ``margin``: the
    calibration bound must also stay within margin x budget (default: the bound's own margin
    only). ``windows``: calibration windows and at most as many check windows (default: what the
    text gives within the time budget). ``command``: the command line the report quotes. ``bos``: the
    token every window starts with (the command asks the model's tokenizer: harness.text.resolve_bos).
    ``speed_aware``: value each layer's sparsity by the time it measurably saves here, at ``threads``
    (:mod:`.layer_speed`); False: by the bytes it skips, every layer gated from 10% sparsity."""
    started = time.perf_counter()
    source = Path(model)
    folder = genai_folder(source) if source.is_dir() else None
    decoder = model_input(source)
    out = Path(output)
    outputs, targets = tune_outputs(source, out, report_stem, protected, reference)  # before the long part
    bos = as_bos(bos)
    # The longest sequence each model takes (its genai config: a folder, or the decoder file in one):
    # every window runs on MODEL and on the reference, the speed check on MODEL.
    positions = context_length(source)
    limits = {"the model": positions, "the reference model": context_length(reference) if reference else None}
    for what, limit in limits.items():
        if context is not None and limit is not None and context > limit:
            raise ModelFileError(f"--context {context} is longer than {what}'s {limit} positions")
    long_context = context if context is not None and context >= LONG_CONTEXT else None
    window_len = window_length(min(filter(None, limits.values()), default=None))
    text_len = text_per_window(window_len, bos.id)  # a BOS takes a window's first position
    check_length(int(tokens.size), text_len, long_context)  # before anything is measured

    baseline: Any = str(decoder) if reference is None else str(model_input(reference))
    reference_session = open_session(baseline)
    seconds_per_window = (_seconds_per_window(reference_session, baseline, tokens, window_len, bos)
                          if windows is None else None)
    plan = plan_windows(tokens, text_len, seconds_per_window=seconds_per_window, windows=windows,
                        long_context=long_context)
    n, m = len(plan.calibration), len(plan.check)
    construction = (f"{n} calibration + {m} check windows x {window_len} positions ({bos.describe()}); the first "
                    f"text token of a window is context only" + ("" if bos.id is None else ", nor is the BOS scored"))
    log(f"tune: {tokens.size} tokens -> {n} calibration and {m} check windows of {window_len} ({plan.note}); "
        f"{bos.describe()}")
    first = first_scored(bos.id)

    # 2. Calibrate: curves and probes, then the path, window by window.
    graph = load_proto(decoder, load_weights=True)  # external data under ONNX Runtime's rule
    measured = layer_speed.measure_model(graph, threads=threads, log=log) if speed_aware else None
    if measured is not None and measured.nothing_pays:  # before minutes of calibration are spent
        note = layer_speed.nothing_pays_note(measured.records, threads)
        line = f"tune: {note}: nothing written"
        log(line)
        return {"command": command, "model": str(source), "output": str(out), "written": False, "advice": note,
                "layer_speed": [speed.to_dict() for speed in measured.records], "exit_status": EXIT_NOT_WRITTEN,
                "last_line": line, "seconds": round(time.perf_counter() - started, 1)}
    prepared = allocation.prepare_lm(graph, _with_bos(plan.calibration, bos.id), _with_bos(plan.probe, bos.id), log=log)
    for unit in prepared.units:
        unit.saving = measured.savings.get(unit.input_name) if measured and measured.savings else None
    # Against the input itself its dense run on the probe graph is the baseline; against a reference
    # (the fp32 model of a quantized one) the reference's NLL per window.
    baseline_nll = None if reference is None else perplexity(
        baseline, plan.calibration.reshape(-1), n, window_len, session=reference_session, bos=bos)["window_nll"]
    calibration_loss = allocation.LmLoss(prepared.session, _with_bos(plan.calibration, bos.id), keep_logprobs=False,
                                         baseline_nll=baseline_nll, first=first)
    dense_losses = calibration_loss.dense_window_nll - calibration_loss.baseline_window_nll
    limit = max_dppl if margin is None else max_dppl * margin
    limit_text = f"the budget {max_dppl:.2%}" if margin is None else (
        f"--margin {margin:g} x the budget {max_dppl:.2%} = {100 * limit:.3g}%")
    points = search.walk(prepared, calibration_loss.window_loss, limit, dense_losses, method=method,
                         check_windows=m, log=log)

    # 3. Choose.
    losses = np.stack([p.losses for p in points])
    chosen = selection.choose(losses, limit, check_windows=m)
    band = selection.bootstrap_band(losses)
    curve = [{"skipped_fraction": p.skipped, "point": p.label, "dppl": float(math.expm1(mean)),
              "trend": float(math.expm1(trend)), "band": [float(math.expm1(lo)), float(math.expm1(hi))],
              "bound": float(math.expm1(bound)), "window_sd": float(sd)}
             for p, mean, trend, lo, hi, bound, sd in zip(points, chosen.mean, chosen.trend, band[0], band[1],
                                                          chosen.bound, chosen.spread)]
    report: dict[str, Any] = {
        "command": command, "model": str(source), "reference": None if reference is None else str(reference),
        "output": str(out), "max_dppl": max_dppl, "margin": margin, "context": context, "method": method,
        "tokens": int(tokens.size), "window_len": window_len, "calibration_windows": n, "check_windows": m,
        "bos": bos.to_dict(), "window_construction": construction,
        "windows_available": list(plan.available), "windows_note": plan.note,
        "seconds_per_window": seconds_per_window,
        "layer_speed": ([speed.to_dict() for speed in measured.records] if measured is not None
                        else "not measured (--no-speed-aware): skipped bytes valued alike, gating from 10% sparsity"),
        "selection": {"z": chosen.z, "margin_factor": chosen.margin_factor, "index": chosen.index, "limit": limit,
                      "rule": "most skipped bytes whose monotone-fitted calibration loss + z x window sd x "
                              f"sqrt(1/calibration + 1/check windows) is within {limit_text}"},
        "calibration_curve": curve, "machine": machine_info(), "versions": versions(),
    }

    def finish(status: int, last_line: str) -> dict[str, Any]:
        report.update(exit_status=status, last_line=last_line, seconds=round(time.perf_counter() - started, 1))
        log(last_line)
        return report

    if chosen.index is None or points[chosen.index].skipped <= 0.0:
        report["written"] = False
        lowest = curve[1]["bound"] if len(curve) > 1 else curve[0]["bound"]
        report["advice"] = (f"no gating fits {limit_text} with confidence on this text (the least "
                            f"gated point's bound is {lowest:+.2%}"
                            + (f"; the input alone is at {curve[0]['dppl']:+.2%} vs the reference" if reference else "")
                            + "): nothing written. A larger --max-dppl" + ("" if margin is None else " or --margin")
                            + ", or a longer text (the margin shrinks with more windows), would be needed")
        return finish(EXIT_NOT_WRITTEN, f"tune: {report['advice']}")
    point = points[chosen.index]
    result = prepared.allocation(point.choice, limit, float(math.expm1(point.losses.mean())), search.history(points))
    # An ungated quantized LM head runs dense on our kernel only where that measured faster here.
    result.dense_on_ours, placement = head_placement.place_heads(graph, result.dense_on_ours, threads=threads, log=log)
    entries = result.entries()
    report["gating"] = {"method": method, "skipped_fraction": point.skipped, "sparsity": result.sparsity(),
                        "calibration_dppl": curve[chosen.index]["dppl"], "bound": curve[chosen.index]["bound"],
                        "history": search.history(points),
                        "allocation": {**result.report(), "head_placement": placement}}
    log(f"tune: chose {point.skipped:.1%} of gated bytes skipped (calibration dppl {curve[chosen.index]['dppl']:+.2%}, "
        f"bound {curve[chosen.index]['bound']:+.2%} for {m} check windows)")

    # The held-out curve around the choice (probe graph, check windows: not used to choose).
    ref_check = perplexity(baseline, plan.check.reshape(-1), m, window_len, session=reference_session, bos=bos)
    del reference_session
    check_loss = allocation.LmLoss(prepared.session, _with_bos(plan.check, bos.id), keep_logprobs=False,
                                   baseline_nll=ref_check["window_nll"], first=first)
    held_curve = []
    for offset in (0, *HELD_OUT_NEIGHBOURS):
        i = chosen.index + offset
        if 0 <= i < len(points):
            values = (check_loss.dense_window_nll - ref_check["window_nll"] if i == 0
                      else check_loss.window_loss(allocation.thresholds_for(prepared.units, prepared.layers,
                                                                            points[i].choice)))
            mean, low, high = selection.interval(values)
            held_curve.append({"skipped_fraction": points[i].skipped, "dppl": float(math.expm1(mean)),
                               "low": float(math.expm1(low)), "high": float(math.expm1(high)), "chosen": offset == 0})
    report["held_out_curve"] = sorted(held_curve, key=lambda h: h["skipped_fraction"])
    del check_loss, calibration_loss, prepared, graph, result  # the probe session and weights: memory for the check

    # 4. Attention at a long context, when the text can check it.
    attention, report["attention_note"] = None, "--context not given: attention left exact"
    if long_context is not None:
        attention = AttentionSettings(select="popcount")  # each attention form's recommended setting
        report["attention_note"] = f"PopcountAttention, recommended setting, for contexts of {context}"
    elif context is not None:
        report["attention_note"] = (f"--context {context} < {LONG_CONTEXT}: attention selection does not pay there; "
                                    "left exact")
    config = _gating_config(entries, attention, DEPLOY_MAX_GATED_ROWS)
    report["max_gated_rows"] = DEPLOY_MAX_GATED_ROWS

    with outputs:
        with _staged_model(folder, decoder, out, config, outputs, targets["model"]) as (staged, staged_decoder,
                                                                                        commit_model):
            # 5. The check, on what is written.
            written = every_row_gated(staged_decoder)
            report["rewrite"] = _rewrite_counts(written)
            held_out = _held_out(written, plan.check, window_len, bos, ref_check)
            report["held_out"] = held_out
            worst = held_out["dppl"]
            if plan.long_piece is not None:
                long_check = compare_lm(baseline, written, plan.long_piece, windows=1, window_len=context, bos=bos)
                report["held_out_long"] = {k: v for k, v in long_check.items() if not isinstance(v, np.ndarray)}
                worst = max(worst, long_check["dppl"])
            del written
            if worst > max_dppl:
                report["written"] = False
                report["advice"] = (f"held-out dppl {worst:+.2%} is over the budget {max_dppl:.2%} (calibration bound "
                                    f"{curve[chosen.index]['bound']:+.2%}): nothing written. A longer text (more "
                                    f"windows: a tighter bound) or a larger --max-dppl would be needed")
                return finish(EXIT_NOT_WRITTEN, f"tune: {report['advice']}")

            # 6. Speed: the staged model against the input, in the real loop.
            speed_context = min(context or 128, (positions or 1 << 30) - speed_steps - 8)
            report["speed_context"] = speed_context
            report["speed_runner"] = "onnxruntime_genai Generator" if folder is not None else "ONNX Runtime session"
            # The loop is teacher-forced on the user's own text: all of it (check_length made it longer than
            # any context the loop runs at), not the check windows alone, which may be shorter.
            try:
                report["speed"] = decode_speed({"input": folder if folder is not None else decoder, "tuned": staged},
                                               tokens, context=speed_context, steps=speed_steps, threads=threads,
                                               log=log)
            except Exception as error:  # a decoder the loop cannot drive (no KV cache): report, do not fail
                report["speed"] = {"error": f"decode loop not run: {str(error).splitlines()[0]}"}
            if long_context is not None and "error" not in report["speed"]:
                # A long context is a whole request: the prompt, then the answer (docs/measure.md).
                prompt = min(long_context, (positions or 1 << 30) - REQUEST_ANSWER) - REQUEST_ANSWER
                report["speed_request"] = request_speed(
                    {"input": folder if folder is not None else decoder, "tuned": staged}, tokens,
                    prompt=prompt, answer=REQUEST_ANSWER, threads=threads, log=log)

            # 7. Reports beside the model, then everything into place at once.
            report["written"] = True
            status, last_line = _verdict(report)
            report.update(exit_status=status, last_line=last_line, seconds=round(time.perf_counter() - started, 1))
            report["plot"] = reports.write_plot(report, lambda draw: outputs.write(targets[".png"], draw))
            outputs.write_text(targets[".json"], json.dumps(report, indent=1, default=float) + "\n")
            outputs.write_text(targets[".md"], reports.markdown(report))
            _commit(commit_model, outputs)
    log(reports.summary(report))  # ends with the last line
    return report


def _rewrite_counts(model: onnx.ModelProto) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in model.graph.node:
        if node.domain == DOMAIN:
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


def _verdict(report: Mapping[str, Any]) -> tuple[int, str]:
    """The exit status and the last line: written, and whether it ran slower than the input — the
    whole request (prompt + answer) when a long --context was measured, else the decode step; the
    ratio is the minimum over the measurement's rounds."""
    speed, request = report.get("speed") or {}, report.get("speed_request") or {}
    if "tuned" in request:
        ratio = request["tuned"]["speedup"]
        what = f"request time ({request['tuned']['request']} tokens, prompt + answer)"
    elif "input" in speed and "tuned" in speed:
        ratio = speed["tuned"].get("speedup", speed["tuned"]["tokens_per_s"] / speed["input"]["tokens_per_s"])
        what = f"decode at context {report['speed_context']}"
    else:
        ratio = None
    if ratio is not None:
        if ratio < 1.0:
            return EXIT_WRITTEN_SLOWER, (
                f"tune: WARNING: wrote {report['output']}, but it ran SLOWER than the input here: {ratio:.2f}x "
                f"{what}, worst round (exit status {EXIT_WRITTEN_SLOWER}; quality {report['held_out']['dppl']:+.2%} "
                "held-out)")
        return EXIT_WRITTEN, (f"tune: wrote {report['output']}: {ratio:.2f}x {what}, worst round; held-out dppl "
                              f"{report['held_out']['dppl']:+.2%}")
    return EXIT_WRITTEN, (f"tune: wrote {report['output']}: held-out dppl {report['held_out']['dppl']:+.2%}; decode speed "
                          f"not measured ({speed.get('error', 'no decode loop')})")
