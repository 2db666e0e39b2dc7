"""``tune``: from "my model + my text" to a tuned model that was measured as written.

A pipeline of stages, each a function of the previous stages' results (:mod:`.results`), so each
can be run (and tested) on its own:

1. :func:`resolve_inputs` — the model opened once (:class:`ortsparse.measure.source.ModelSource`),
   the outputs declared and checked, the context and the text's length checked: too short a text
   is refused before anything is measured.
2. :func:`plan_text` — one forward pass timed, the text cut into contiguous parts, some held out
   (the check windows come only from those, the calibration windows only from the others, a window
   apart: :mod:`.windows`), and the loss passes' duration estimated from that speed.
3. :func:`profile_speed` — what gating each layer saves in time on this machine (:mod:`.layer_speed`:
   a layer stays dense where gating does not pay); nothing pays: stop before calibrating.
4. :func:`calibrate_path` — each gated unit's cost curve and probe (:mod:`ortsparse.calibration.allocation`),
   then a **path** of allocations of increasing skipped bytes, each measured window by window
   (:mod:`.search`), with progress and the remaining time.
5. :func:`choose` — the point skipping the most bytes whose monotone-fitted loss plus a margin from
   the measured spread — between parts of the text and between windows of a part — is within the
   budget (:mod:`.selection`), its per-layer decision, and where an ungated quantized head runs.
6. :func:`check_on_probe` — the held-out loss curve around the choice (probe graph, check windows).
7. :func:`stage_model` — the model (a genai folder or an .onnx file) rewritten once from the
   choice's per-node plan, into a staging place beside OUT.
8. :func:`check_written` — the staged decoder (its gated calls lifted to every row, as decode runs
   them) against the reference on the check windows — parts of the text never used to calibrate
   or choose —, with the range one more part of the text is expected in.
9. :func:`check_answers` — with a long ``--context`` only: attention selection judged where it
   acts, on answer windows of the held-out parts (a prompt of the context read in one call, then
   answer tokens teacher-forced and scored, :mod:`ortsparse.measure.answer_quality`), the staged
   model as an app runs it. Either check over the budget: nothing is moved into place.
10. :func:`check_speed` — the staged model against MODEL in the real decode loop.
11. :func:`commit` — reports rendered from the result beside the model, everything moved into place
    in one step.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from .._library import reset_metrics
from ..benchmarking import machine_info, versions
from ..calibration import allocation, head_placement
from ..graph_rewrite import KwtaSettings, RewriteConfig, TechniqueChoice
from ..graph_rewrite.as_decoded import as_decoded
from ..graph_rewrite.errors import ModelFileError
from ..graph_rewrite.files import rewrite_file
from ..graph_rewrite.genai import rewrite_genai_folder, source_entries, written_by_ortsparse
from ..graph_rewrite.output_paths import Inputs, OutputFiles, resolve_report_stem
from ..graph_rewrite.rules import DOMAIN
from ..graph_rewrite.techniques.popcount import AttentionSettings
from ..measure.answer_quality import answer_quality_of, summarize
from ..measure.corpus import first_scored, text_per_window
from ..measure.decode import open_stepper
from ..measure.op_metrics import snapshot
from ..measure.perplexity import perplexity
from ..measure.request import request_speed
from ..measure.source import ModelSource, open_model
from ..measure.speed import decode_speed
from ..measure.text import BosChoice, as_bos
from ..runtime import genai_folder, open_session, uses_ortsparse
from . import layer_speed, report as reports, search, selection
from .results import (EXIT_NOT_WRITTEN, EXIT_WRITTEN, EXIT_WRITTEN_SLOWER, AnswerCheck, CalibrationPath, Choice,
                      HeldOut, ProbeCheck, SpeedCheck, StagedModel, TuneInputs, TuneResult, Windows)
from .windows import (ANSWER_STEPS, PATH_POINTS, Progress, check_length, loss_pass_seconds, plan_windows,
                      spread_indices, window_length)

LONG_CONTEXT = 2048  # below this, attention selection does not pay (measured; docs/measure.md)
# The written model gates calls of up to this many rows (decode, small batches); longer calls (a
# prompt) run dense. The check lifts this (every row gated), so its dppl is what generated tokens
# see and an upper bound for prompt tokens, which the written model computes exactly.
DEPLOY_MAX_GATED_ROWS = 8
REQUEST_ANSWER = 256  # the answer of the request --context measures: prompt + 256 generated tokens
HELD_OUT_NEIGHBOURS = (-1, 1, 2)  # path points around the choice measured on the check windows
# The long --context check: answer windows after the first (timed) one while they fit this many
# seconds, never fewer than MIN_ANSWER_WINDOWS (the text holds one in each held-out part).
ANSWER_TIME_BUDGET_S = 600.0
MIN_ANSWER_WINDOWS = 2
REPORT_FILES = ((".json", "JSON report"), (".md", "markdown report"), (".png", "plot"))

__all__ = ["EXIT_NOT_WRITTEN", "EXIT_WRITTEN", "EXIT_WRITTEN_SLOWER", "tune", "tune_outputs", "every_row_gated"]


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
    reads = Inputs(dict(protected or {})).add_model(source, "the source folder" if folder else "the input model")
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


def with_bos(chunks: np.ndarray, bos: int | None) -> np.ndarray:
    """Model windows from text chunks: ``[bos] + chunk`` each (the chunks as they are without a BOS)."""
    chunks = np.asarray(chunks, dtype=np.int64)
    if bos is None:
        return chunks
    return np.concatenate([np.full((chunks.shape[0], 1), bos, dtype=np.int64), chunks], axis=1)


def every_row_gated(path: Path) -> onnx.ModelProto:
    """The written decoder at ``path`` computing every row as a decode step does
    (:func:`ortsparse.graph_rewrite.as_decoded.as_decoded`: gated layers gate a window's prefill,
    attention selects keys in it), the weights, thresholds and every other byte as written."""
    return as_decoded(onnx.load(str(path)))


class StageClock:
    """The seconds each stage took (``with clock("name"):``), into ``into`` (the result's
    ``stage_seconds``: printed at the end and reported)."""

    def __init__(self, into: dict[str, float]) -> None:
        self.seconds = into

    @contextlib.contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - start


# --------------------------------------------------------------------------- the stages


def resolve_inputs(model: str | Path | ModelSource, tokens: np.ndarray, output: str | Path, *,
                   max_dppl: float = 0.02, margin: float | None = None, context: int | None = None,
                   threads: int = 1, speed_steps: int = 32, reference: str | Path | ModelSource | None = None,
                   method: str = "allocated", windows: int | None = None, command: str | None = None,
                   bos: BosChoice | int | None = None, speed_aware: bool = True, gate_head: bool = False) -> TuneInputs:
    """Stage 1: the models opened, the context checked against their positions, the window length
    from the shorter of them, and the text's length checked (ModelFileError: a one-line refusal)."""
    source = model if isinstance(model, ModelSource) else open_model(model)
    ref = reference if isinstance(reference, ModelSource) or reference is None else open_model(reference)
    bos = as_bos(bos)
    # The longest sequence each model takes (its genai config: a folder, or the decoder file in one):
    # every window runs on MODEL and on the reference, the speed check on MODEL.
    limits = {"the model": source.context_length, "the reference model": ref.context_length if ref else None}
    for what, limit in limits.items():
        if context is not None and limit is not None and context > limit:
            raise ModelFileError(f"--context {context} is longer than {what}'s {limit} positions")
    long_context = context if context is not None and context >= LONG_CONTEXT else None
    positions = min(filter(None, limits.values()), default=None)
    window_len = window_length(positions)
    # The answer windows' prompt: the context, as long as the answer still fits the models' positions.
    answer_prefix = None if long_context is None else (
        long_context if positions is None else min(long_context, positions - ANSWER_STEPS))
    tokens = np.asarray(tokens)
    check_length(int(tokens.size), text_per_window(window_len, bos.id), answer_prefix)  # a BOS takes a position
    return TuneInputs(source, ref, tokens, Path(output), max_dppl, margin, context, long_context, answer_prefix,
                      window_len, bos, threads, speed_steps, method, windows, speed_aware, command, gate_head)


def seconds_per_window(session: Any, model: ModelSource, tokens: np.ndarray, window_len: int, bos: BosChoice) -> float:
    """One forward pass over a window, timed after a warm-up pass (the first run of a session
    allocates and is slower)."""
    perplexity(model, tokens[:window_len], 1, window_len, session=session, bos=bos)
    clock = time.perf_counter()
    perplexity(model, tokens[window_len:2 * window_len], 1, window_len, session=session, bos=bos)
    return time.perf_counter() - clock


def plan_text(inputs: TuneInputs, baseline_session: Any, log: Callable[[str], None] = print) -> Windows:
    """Stage 2: one forward pass of the baseline timed, the text cut into windows (fewer when the
    loss passes would not fit :data:`.windows.TIME_BUDGET_S` at that speed), and how long the loss
    passes will take, said before they start."""
    text_len = text_per_window(inputs.window_len, inputs.bos.id)
    speed = seconds_per_window(baseline_session, inputs.baseline, inputs.tokens, inputs.window_len, inputs.bos)
    plan = plan_windows(inputs.tokens, text_len, seconds_per_window=speed, windows=inputs.windows,
                        answer_prefix=inputs.answer_prefix)
    windows = Windows(plan, inputs.window_len, speed, inputs.bos)
    log(f"tune: {inputs.tokens.size} tokens -> {windows.calibration} calibration and {windows.check} check windows "
        f"of {inputs.window_len} ({plan.note}); {inputs.bos.describe()}")
    log(f"tune: {plan.split}")
    log(f"tune: about {_minutes(loss_pass_seconds(speed, windows.calibration, windows.check))} of loss passes at "
        f"{speed:.2f} s per window here; the layer speed, the probes and the speed check come on top")
    return windows


def profile_speed(inputs: TuneInputs, log: Callable[[str], None] = print) -> layer_speed.Measured | None:
    """Stage 3: what gating each speed class saves here (None with ``speed_aware`` off: bytes valued alike)."""
    if not inputs.speed_aware:
        return None
    return layer_speed.measure_model(inputs.source, inputs.target, threads=inputs.threads, log=log)


def calibrate_path(inputs: TuneInputs, windows: Windows, speed: layer_speed.Measured | None,
                   baseline_session: Any, log: Callable[[str], None] = print) -> CalibrationPath:
    """Stage 4: curves and probes on the calibration windows, then the path, window by window."""
    plan, bos, first = windows.plan, inputs.bos, first_scored(inputs.bos.id)
    prepared = allocation.prepare_lm(inputs.source, with_bos(plan.calibration, bos.id), with_bos(plan.probe, bos.id),
                                     target=inputs.target, log=log)
    for unit in prepared.units:
        unit.saving = speed.savings.get(unit.input_name) if speed and speed.savings else None
    log(f"tune: the probes predict {search.forecast(prepared.units, inputs.limit):.1%} of gated bytes skipped "
        f"within {inputs.limit_text} (a forecast: the path measures it)")
    # Against the input itself its dense run on the probe graph is the baseline; against a reference
    # (the fp32 model of a quantized one) the reference's NLL per window.
    baseline_nll = None if inputs.reference is None else perplexity(
        inputs.reference, plan.calibration.reshape(-1), windows.calibration, inputs.window_len,
        session=baseline_session, bos=bos)["window_nll"]
    loss = allocation.LmLoss(prepared.session, with_bos(plan.calibration, bos.id), keep_logprobs=False,
                             baseline_nll=baseline_nll, first=first)
    dense_losses = loss.dense_window_nll - loss.baseline_window_nll
    progress = Progress("path", windows.calibration * PATH_POINTS)

    def window_loss(thresholds: Mapping[int, float]) -> np.ndarray:
        losses = loss.window_loss(thresholds)
        log(f"tune: {progress.advance(windows.calibration)}")
        return losses

    points = search.walk(prepared, window_loss, inputs.limit, dense_losses, method=inputs.method,
                         check_windows=windows.check, parts=plan.calibration_parts, check_parts=plan.check_parts,
                         log=log)
    return CalibrationPath(prepared, loss, points)


def choose(inputs: TuneInputs, path: CalibrationPath, windows: Windows, log: Callable[[str], None] = print) -> Choice:
    """Stage 5: the selection along the path; when a point gating anything fits, its allocation
    (the per-layer decision) with an ungated quantized LM head run dense on our kernel only where
    that measured faster here."""
    points = path.points
    losses = np.stack([p.losses for p in points])
    chosen = Choice(selection.choose(losses, inputs.limit, check_windows=windows.check,
                                     parts=windows.plan.calibration_parts, check_parts=windows.plan.check_parts),
                    selection.bootstrap_band(losses), points, inputs.method)
    if not chosen.gates_anything:
        return chosen
    point = chosen.point
    result = path.prepared.allocation(point.choice, inputs.limit, float(math.expm1(point.losses.mean())),
                                      search.history(points))
    result.dense_on_ours, placement = head_placement.place_heads(inputs.source.weights, result.dense_on_ours,
                                                                 threads=inputs.threads, log=log)
    chosen.plan, chosen.sparsity = result.plan(), result.sparsity()
    chosen.allocation = {**result.report(), "head_placement": placement}
    log(f"tune: chose {point.skipped:.1%} of gated bytes skipped (calibration dppl {chosen.calibration_dppl:+.2%}, "
        f"bound {chosen.bound:+.2%} for {windows.check} check windows in {windows.held_out_parts} held-out parts; "
        f"between-part sd {chosen.selection.part_sd[chosen.index]:.4f} nats)")
    return chosen


def check_on_probe(inputs: TuneInputs, windows: Windows, path: CalibrationPath, choice: Choice,
                   baseline_session: Any) -> ProbeCheck:
    """Stage 6: the reference's run on the check windows, and the held-out curve around the choice
    on the probe graph (check windows: not used to choose), each point with the range one more part
    of the text is expected in (its between-part spread from the calibration parts)."""
    plan, bos = windows.plan, inputs.bos
    reference_run = perplexity(inputs.baseline, plan.check.reshape(-1), windows.check, inputs.window_len,
                               session=baseline_session, bos=bos)
    check_loss = allocation.LmLoss(path.prepared.session, with_bos(plan.check, bos.id), keep_logprobs=False,
                                   baseline_nll=reference_run["window_nll"], first=first_scored(bos.id))
    curve = []
    for offset in (0, *HELD_OUT_NEIGHBOURS):
        i = choice.index + offset
        if 0 <= i < len(choice.points):
            values = (check_loss.dense_window_nll - reference_run["window_nll"] if i == 0
                      else check_loss.window_loss(allocation.thresholds_for(path.prepared.units, path.prepared.layers,
                                                                            choice.points[i].choice)))
            mean, low, high = selection.interval(values, parts=plan.check_parts,
                                                 part_variance=float(choice.selection.part_sd[i]) ** 2)
            curve.append({"skipped_fraction": choice.points[i].skipped, "dppl": float(math.expm1(mean)),
                          "low": float(math.expm1(low)), "high": float(math.expm1(high)), "chosen": offset == 0})
    return ProbeCheck(reference_run, sorted(curve, key=lambda h: h["skipped_fraction"]))


def rewrite_config(choice: Choice, attention: AttentionSettings | None,
                   max_gated_rows: int = DEPLOY_MAX_GATED_ROWS) -> RewriteConfig:
    """The rewrite of the choice: KWTA off but on the plan's nodes, whose settings update the base
    (so ``max_gated_rows`` reaches every gated layer)."""
    return RewriteConfig(techniques={"kwta": TechniqueChoice(KwtaSettings(max_gated_rows=max_gated_rows), enabled=False,
                                                             target="all")},
                         plan=choice.plan, attention=attention)


def stage_model(inputs: TuneInputs, choice: Choice, outputs: OutputFiles, destination: Path) -> StagedModel:
    """Stage 7: the model rewritten once from the choice, into ``outputs``' staging (moved into
    place with the reports by :func:`commit`): the folder or file that runs, and its decoder."""
    attention, note = None, "--context not given: attention left exact"
    if inputs.long_context is not None:
        attention = AttentionSettings(select="popcount")  # each attention form's recommended setting
        note = f"PopcountAttention, recommended setting, for contexts of {inputs.context}"
    elif inputs.context is not None:
        note = f"--context {inputs.context} < {LONG_CONTEXT}: attention selection does not pay there; left exact"
    config = rewrite_config(choice, attention)
    source = inputs.source
    if source.folder is not None:
        written = rewrite_genai_folder(source.folder, inputs.output, config, outputs=outputs)
        staged = outputs.staged(destination)
        decoder = staged / written.model_file.relative_to(inputs.output)
    else:
        rewrite_file(source.decoder, inputs.output, config, progress=False, outputs=outputs)
        staged = decoder = outputs.staged(destination)
    return StagedModel(staged, decoder, note, DEPLOY_MAX_GATED_ROWS)


def rewrite_counts(model: onnx.ModelProto) -> dict[str, int]:
    """The ai.ortsparse nodes of ``model``, by op."""
    counts: dict[str, int] = {}
    for node in model.graph.node:
        if node.domain == DOMAIN:
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


def check_written(inputs: TuneInputs, windows: Windows, staged: StagedModel, probe: ProbeCheck,
                  choice: Choice) -> HeldOut:
    """Stage 8: the written decoder, every row gated, on the check windows (text chunks of the
    held-out parts, a BOS first when ``bos``) against the reference's run there; the interval is
    the range one more part of the text is expected in, from the between-part spread ``choice``
    measured on the calibration parts at the chosen point (:func:`.selection.interval`)."""
    written = every_row_gated(staged.decoder)
    check, window_len, reference = windows.plan.check, inputs.window_len, probe.reference_run
    reset_metrics()
    session = open_session(written)  # open until the metrics are read
    run = perplexity(written, check.reshape(-1), check.shape[0], window_len, session=session, bos=inputs.bos)
    metrics = snapshot(written) if uses_ortsparse(written) else {}
    losses = run["window_nll"] - reference["window_nll"]
    part_sd = float(choice.selection.part_sd[choice.index])
    mean, low, high = selection.interval(losses, parts=windows.plan.check_parts, part_variance=part_sd ** 2)
    return HeldOut(float(math.expm1(mean)), float(math.expm1(low)), float(math.expm1(high)),
                   float(np.mean(run["predictions"] == reference["predictions"])), int(check.shape[0]),
                   int(window_len), losses.tolist(), float(math.exp(reference["nll"])), float(run["ppl"]),
                   "the written decoder, every row gated", metrics, rewrite_counts(written), windows.held_out_parts,
                   part_sd, f"where one more part of the text is expected: mean -/+ {choice.selection.z} x "
                   "sqrt(between-part variance (calibration parts) x (1 + 1/held-out parts) + within-part variance / "
                   "windows)")


def check_answers(inputs: TuneInputs, windows: Windows, staged: StagedModel, log: Callable[[str], None] = print, *,
                  budget_s: float = ANSWER_TIME_BUDGET_S, clock: Callable[[], float] = time.perf_counter
                  ) -> AnswerCheck:
    """Stage 9, with a long --context: the staged model against the baseline (the reference, else
    MODEL) on the answer windows of the held-out parts (:attr:`.windows.WindowPlan.answers`), each
    read as an app reads a prompt — ``answer_prefix`` tokens in one call, a genai folder through
    the Generator — and then :data:`.windows.ANSWER_STEPS` tokens teacher-forced, only those scored
    (:func:`~ortsparse.measure.answer_quality.answer_quality_of`): where attention selection acts,
    past its ``min_keys`` keys, instead of a window averaged over positions that run exact. The
    first window is timed; as many more, spread over the held-out parts, as fit ``budget_s``
    (never fewer than :data:`MIN_ANSWER_WINDOWS` in all)."""
    planned = windows.plan.answers
    models = {"reference": inputs.baseline.runs_as, "tuned": staged.path}
    runners = {name: "og" if Path(path).is_dir() else "ort" for name, path in models.items()}
    reference, tuned = (open_stepper(models[name], runners[name], inputs.threads) for name in ("reference", "tuned"))

    def measured(offset: int) -> dict[str, float]:
        one = dataclasses.replace(planned, offsets=(offset,))
        row = answer_quality_of(reference, {"tuned": tuned}, inputs.tokens, one)["tuned"]["per_window"][0]
        log(f"tune: answer window at tokens {offset}..{offset + planned.span - 1}: dppl {row['dppl']:+.2%}, "
            f"top-1 {row['top1']:.3f}")
        return row

    available = len(planned.offsets)
    start = clock()
    rows = [measured(planned.offsets[0])]
    seconds = clock() - start
    count = min(available, max(MIN_ANSWER_WINDOWS, int(budget_s // max(seconds, 1e-9))))
    note = ("every answer window the held-out parts hold" if count == available else
            f"{count} of {available}: the answer windows fit ~{budget_s / 60:.0f} min at {seconds:.0f} s per window "
            "here")
    log(f"tune: answer check on {count} windows of a {planned.prefix}-token prompt + {planned.answer} answer tokens "
        f"({note})")
    rows += [measured(planned.offsets[i]) for i in spread_indices(available, count)[1:]]
    return AnswerCheck(summarize(rows), rows, planned.prefix, planned.answer, available, note, runners)


def check_speed(inputs: TuneInputs, staged: StagedModel, log: Callable[[str], None] = print,
                decode: Callable[..., Mapping[str, Any]] | None = None,
                request: Callable[..., Mapping[str, Any]] | None = None) -> SpeedCheck:
    """Stage 9: the staged model against the input in the real loop, teacher-forced on the user's
    own text — all of it (check_length made it longer than any context the loop runs at), not the
    check windows alone, which may be shorter —; at a long --context the whole request (prompt,
    then the answer: docs/measure.md). ``decode`` / ``request``: the measurements (default
    :func:`~ortsparse.measure.speed.decode_speed`, :func:`~ortsparse.measure.request.request_speed`)."""
    decode, request = decode or decode_speed, request or request_speed
    source = inputs.source
    positions = source.context_length or 1 << 30
    context = min(inputs.context or 128, positions - inputs.speed_steps - 8)
    runner = "onnxruntime_genai Generator" if source.folder is not None else "ONNX Runtime session"
    models = {"input": source.runs_as, "tuned": staged.path}
    try:
        measured = decode(models, inputs.tokens, context=context, steps=inputs.speed_steps, threads=inputs.threads,
                          log=log)
    except Exception as error:  # a decoder the loop cannot drive (no KV cache): report, do not fail
        return SpeedCheck(context, runner, {"error": f"decode loop not run: {str(error).splitlines()[0]}"})
    whole = None
    if inputs.long_context is not None:
        prompt = min(inputs.long_context, positions - REQUEST_ANSWER) - REQUEST_ANSWER
        whole = request(models, inputs.tokens, prompt=prompt, answer=REQUEST_ANSWER, threads=inputs.threads, log=log)
    return SpeedCheck(context, runner, measured, whole)


def verdict(output: Path, held_out_dppl: float, speed: SpeedCheck | None,
            answers: AnswerCheck | None = None) -> tuple[int, str]:
    """The exit status and the last line of a written model: whether it ran slower than the input
    (:meth:`SpeedCheck.ratio`: the worst round); the quality it was written with."""
    quality = f"held-out dppl {held_out_dppl:+.2%}" + (
        "" if answers is None else f", answer steps after {answers.prefix}-token prompts {answers.dppl:+.2%}")
    measured = speed.ratio() if speed is not None else None
    if measured is None:
        why = speed.error if speed is not None and speed.error else "no decode loop"
        return EXIT_WRITTEN, f"tune: wrote {output}: {quality}; decode speed not measured ({why})"
    ratio, what = measured
    if ratio < 1.0:
        return EXIT_WRITTEN_SLOWER, (
            f"tune: WARNING: wrote {output}, but it ran SLOWER than the input here: {ratio:.2f}x {what}, worst round "
            f"(exit status {EXIT_WRITTEN_SLOWER}; {quality})")
    return EXIT_WRITTEN, f"tune: wrote {output}: {ratio:.2f}x {what}, worst round; {quality}"


def no_fit_advice(inputs: TuneInputs, choice: Choice) -> str:
    """Why nothing is written when no point gating anything fits the limit, and what would help."""
    curve = choice.curve()
    lowest = curve[1]["bound"] if len(curve) > 1 else curve[0]["bound"]
    return (f"no gating fits {inputs.limit_text} with confidence on this text (the least gated point's bound is "
            f"{lowest:+.2%}" + (f"; the input alone is at {curve[0]['dppl']:+.2%} vs the reference"
                                if inputs.reference else "")
            + "): nothing written. A larger --max-dppl" + ("" if inputs.margin is None else " or --margin")
            + ", or a longer text (the margin shrinks with more windows), would be needed")


def over_budget_advice(inputs: TuneInputs, choice: Choice, held_out: HeldOut,
                       answers: AnswerCheck | None = None) -> str | None:
    """None when the written model is within the budget on the check windows (and on the answer
    steps after long prompts when a long --context was checked); else why nothing is written, and
    what would help."""
    if held_out.dppl > inputs.max_dppl:
        return (f"held-out dppl {held_out.dppl:+.2%} is over the budget {inputs.max_dppl:.2%} (calibration bound "
                f"{choice.bound:+.2%}): nothing written. A longer text (more windows: a tighter bound) or a larger "
                "--max-dppl would be needed")
    if answers is not None and answers.dppl > inputs.max_dppl:
        return (f"answer-step dppl {answers.dppl:+.2%} after {answers.prefix}-token prompts is over the budget "
                f"{inputs.max_dppl:.2%} (held-out windows {held_out.dppl:+.2%}): attention selection costs too much at "
                f"--context {inputs.context}; nothing written. A shorter --context (below {LONG_CONTEXT} attention "
                "stays exact) or a larger --max-dppl would be needed")
    return None


def commit(result: TuneResult, outputs: OutputFiles, targets: Mapping[str, Path]) -> None:
    """Stage 10: the reports, rendered from ``result``, beside the staged model; then everything
    into place at once (:meth:`OutputFiles.commit`, signals held back)."""
    result.plot = reports.write_plot(result, lambda draw: outputs.write(targets[".png"], draw))
    outputs.write_text(targets[".json"], json.dumps(result.to_dict(), indent=1, default=float) + "\n")
    outputs.write_text(targets[".md"], reports.markdown(result))
    outputs.commit()


# --------------------------------------------------------------------------- the pipeline


def tune(model: str | Path | ModelSource, tokens: np.ndarray, output: str | Path, *, max_dppl: float = 0.02,
         margin: float | None = None, context: int | None = None, threads: int = 1, speed_steps: int = 32,
         report_stem: str | Path | None = None, protected: Mapping[str | os.PathLike, str] | None = None,
         reference: str | Path | ModelSource | None = None, method: str = "allocated",
         log: Callable[[str], None] = print, windows: int | None = None, command: str | None = None,
         bos: BosChoice | int | None = None, speed_aware: bool = True, gate_head: bool = False) -> TuneResult:
    """Tune ``model`` (an ONNX decoder or a genai folder, or it opened) on ``tokens`` within
    ``max_dppl`` on check windows; write ``output`` and the report ``<report_stem>.{json,md,png}``
    together, or nothing. Returns the :class:`~.results.TuneResult` (``written``, ``exit_status``:
    :data:`EXIT_WRITTEN`, :data:`EXIT_NOT_WRITTEN`, :data:`EXIT_WRITTEN_SLOWER`, ``last_line``).
    ``reference``: measure dppl against this model (the fp32 model of a quantized ``model``: the
    budget is then the total loss). ``margin``: the calibration bound must also stay within margin x
    budget (default: the bound's own margin only). ``windows``: calibration windows and at most as
    many check windows (default: what the text gives within the time budget). ``command``: the
    command line the report quotes. ``bos``: the token every window starts with (the command asks
    the model's tokenizer: measure.text.resolve_bos). ``speed_aware``: value each layer's sparsity
    by the time it measurably saves here, at ``threads`` (:mod:`.layer_speed`); False: by the bytes
    it skips, every layer gated from 10% sparsity. ``gate_head``: the LM head a candidate unit like
    the others (default: attention and MLP layers only)."""
    seconds: dict[str, float] = {}
    clock = StageClock(seconds)
    with clock("inputs"):
        source_path = model.path if isinstance(model, ModelSource) else model
        reference_path = reference.path if isinstance(reference, ModelSource) else reference
        outputs, targets = tune_outputs(source_path, output, report_stem, protected, reference_path)  # before the long part
        inputs = resolve_inputs(model, tokens, output, max_dppl=max_dppl, margin=margin, context=context,
                                threads=threads, speed_steps=speed_steps, reference=reference, method=method,
                                windows=windows, command=command, bos=bos, speed_aware=speed_aware,
                                gate_head=gate_head)
    result = TuneResult(inputs, stage_seconds=seconds)

    def finish(status: int, line: str, advice: str | None = None) -> TuneResult:
        log(line)
        return result.finish(status, line, advice)

    with clock("windows"):
        baseline_session = open_session(inputs.baseline.decoder)
        result.windows = plan_text(inputs, baseline_session, log)
    with clock("layer speed"):
        result.layer_speed = profile_speed(inputs, log)
    if result.layer_speed is not None and result.layer_speed.nothing_pays:  # before minutes of calibration are spent
        note = layer_speed.nothing_pays_note(result.layer_speed.records, threads)
        return finish(EXIT_NOT_WRITTEN, f"tune: {note}: nothing written", note)
    with clock("calibration"):
        path = calibrate_path(inputs, result.windows, result.layer_speed, baseline_session, log)
    with clock("choice"):
        result.choice = choose(inputs, path, result.windows, log)
        result.machine, result.versions = machine_info(), versions()
    if not result.choice.gates_anything:
        advice = no_fit_advice(inputs, result.choice)
        return finish(EXIT_NOT_WRITTEN, f"tune: {advice}", advice)
    with clock("held-out curve"):
        result.probe_check = check_on_probe(inputs, result.windows, path, result.choice, baseline_session)
    del path, baseline_session  # the probe session and the reference's: memory for the check
    inputs.source.release_weights()

    with outputs:
        with clock("rewrite"):
            result.staged = stage_model(inputs, result.choice, outputs, targets["model"])
        with clock("held-out check"):
            result.held_out = check_written(inputs, result.windows, result.staged, result.probe_check, result.choice)
        if inputs.long_context is not None and result.held_out.dppl <= inputs.max_dppl:  # else it is decided
            with clock("answer check"):
                result.answers = check_answers(inputs, result.windows, result.staged, log)
        advice = over_budget_advice(inputs, result.choice, result.held_out, result.answers)
        if advice is not None:
            return finish(EXIT_NOT_WRITTEN, f"tune: {advice}", advice)
        with clock("speed check"):
            result.speed = check_speed(inputs, result.staged, log)
        result.written = True
        result.finish(*verdict(inputs.output, result.held_out.dppl, result.speed, result.answers))
        with clock("reports"):
            commit(result, outputs, targets)
    log(reports.summary(result))  # ends with the last line
    return result


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"
