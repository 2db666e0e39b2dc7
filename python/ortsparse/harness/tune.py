"""``ortsparse tune MODEL --text FILE [--max-dppl 0.02] [--context N] -o OUT``: from "my model + my
text" to a tuned, verified model.

MODEL is an ONNX decoder (a full-sequence or KV-cache export) or an onnxruntime-genai folder; the
text is tokenized with the model's own tokenizer (``tokenizer.json`` beside it, or ``--tokenizer``).
The token ids are cut into windows, alternately held out and calibrating (held-out windows are never
seen while calibrating; both kinds sample the whole text). Then:

1. **Gating** (KwtaBlockMatMul, per-layer calibrated thresholds): each decoder linear layer's
   sensitivity is measured on the calibration windows and per-layer sparsities are allocated within
   ``margin x budget`` there (:func:`ortsparse.harness.calibrate.gating_search`, ``--method``).
2. **Attention selection** when ``--context`` is long enough to matter (>= 2048 keys) and the text
   holds a held-out window that long: the recommended PopcountAttention setting (``--attn=popcount``).
3. **Held-out check**: dppl and top-1 agreement of the tuned model vs MODEL on the held-out windows.
   Over the budget: nothing is written, and the message says what would be needed.
4. **Speed**: the real decode loop (text continuation, KV cache growing), MODEL and the tuned model
   round-robin in one process, at ``--context`` (default 128).
5. OUT (a model file, or a genai folder for a genai MODEL) and the report ``<OUT>.tune.{json,md,png}``,
   written together. The written model runs prompts dense (``max_gated_rows``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from .. import flag_types
from ..benchmarking import machine_info, versions
from ..graph_rewrite import KwtaSettings, RewriteConfig, TechniqueChoice
from ..graph_rewrite.config import parse_overrides
from ..graph_rewrite.errors import ModelFileError
from ..graph_rewrite.files import rewrite_file
from ..graph_rewrite.genai import model_input, rewrite_genai_folder, written_by_ortsparse
from ..graph_rewrite.output_paths import Inputs, OutputFiles
from ..graph_rewrite.techniques.popcount import AttentionSettings
from ..runtime import genai_decoder, genai_folder, vocab_size
from .calibrate import gating_search
from .corpus import split_held_out, text_per_window
from .perplexity import compare_lm, describe_spread
from .speed import decode_speed
from .text import BosChoice, as_bos, find_tokenizer, resolve_bos, text_tokens

LONG_CONTEXT = 2048  # below this, attention selection does not pay (measured; docs/measure.md)
MIN_WINDOW = 128


@dataclasses.dataclass(frozen=True)
class TextSplit:
    """Calibration and held-out windows of one text."""

    calibration: np.ndarray  # token ids (the odd windows of the text)
    held_out: np.ndarray  # token ids (the even windows)
    windows: int
    window_len: int


def split_text(tokens: np.ndarray, windows: int = 8, window_len: int = 512, context: int | None = None,
               bos: int | None = None) -> TextSplit:
    """The text cut into windows, alternately held out and calibrating (both see the same mix of the
    text: corpus.split_held_out), ``windows`` of each; windows shrink (to 128 tokens) and then
    become fewer (down to 1) when the text is short; too short even for that is a ModelFileError.
    With a ``bos`` each window holds one text token fewer (corpus.lm_windows)."""
    half = tokens.size // 2
    while window_len > MIN_WINDOW and windows * window_len > half:
        window_len //= 2
    windows = min(windows, half // window_len) if window_len else 0
    if windows < 1 or window_len < MIN_WINDOW:
        raise ModelFileError(f"the text has {tokens.size} tokens; tuning needs at least {2 * MIN_WINDOW} "
                             f"(a {MIN_WINDOW}-token calibration window and a held-out one)")
    # Alternate pieces of one window, or of the long context when one is checked (whole multiples of
    # the window, so the long check reads contiguous text and every window lies inside one piece).
    text = text_per_window(window_len, bos)
    piece = text * max(1, -(-text_per_window(context or 0, bos) // text))
    held_out, calibration = split_held_out(tokens, piece, "interleaved")
    if min(held_out.size, calibration.size) < windows * text:  # too short for long pieces: the long
        held_out, calibration = split_held_out(tokens, text, "interleaved")  # check then says so
    return TextSplit(calibration, held_out, windows, window_len)


# The written model gates calls of up to this many rows (decode, small batches); longer calls (a
# prompt) run dense. The held-out check gates every row, so its dppl is what generated tokens see and
# an upper bound for prompt tokens, which the written model computes exactly.
DEPLOY_MAX_GATED_ROWS = 8


def _gating_config(entries: list[dict[str, Any]], attention=None, max_gated_rows: int = 0) -> RewriteConfig:
    # The entries update the base settings, so max_gated_rows reaches every gated layer.
    base = KwtaSettings(max_gated_rows=max_gated_rows)
    return RewriteConfig(techniques={"kwta": TechniqueChoice(base, enabled=False, target="all")},
                         overrides=parse_overrides({"layers": entries}), attention=attention)


def tune(model: str | Path, tokens: np.ndarray, output: str | Path, *, max_dppl: float = 0.02, margin: float = 0.75,
         context: int | None = None, threads: int = 1, speed_steps: int = 32, report_stem: str | Path | None = None,
         protected: dict | None = None, reference: str | Path | None = None, method: str = "allocated", log=print,
         progress: bool = False, windows: int = 8, bos: BosChoice | int | None = None) -> dict[str, Any]:
    """Tune ``model`` on ``tokens`` within ``max_dppl`` (held-out); write ``output`` and the report.
    Returns the report; ``report["written"]`` is False when the budget was missed (nothing written).
    ``progress``: a bar over the steps (and the held-out windows) on stderr. ``reference``: measure
    dppl against this model (the fp32 model of a quantized ``model``: the budget is then the total
    loss), default ``model``. ``windows``: calibration windows and as many held-out ones (8: with 4,
    SmolLM2's calibration dppl varied by +/-1% between neighbouring settings, too noisy to search on).
    ``bos``: the token every window starts with (run() asks the model's tokenizer: text.resolve_bos)."""
    from tqdm.auto import tqdm

    started = time.perf_counter()
    bar = tqdm(total=5, desc="tune", unit="step", disable=not progress, leave=False)

    def step(name: str) -> None:
        bar.set_postfix_str(name)
        bar.update(1)

    source = Path(model)
    folder = genai_folder(source) if source.is_dir() else None
    decoder = model_input(source)
    out = Path(output)
    outputs, targets = tune_outputs(source, out, report_stem, protected, reference)  # checked before the long part
    graph = onnx.load(str(decoder))
    baseline = graph if reference is None else str(model_input(reference))
    max_positions = genai_decoder(folder).context_length if folder is not None else None
    bos = as_bos(bos)
    split = split_text(tokens, windows, window_len=min(512, max_positions or 512),
                       context=context if context is not None and context >= LONG_CONTEXT else None, bos=bos.id)
    if context is not None and max_positions is not None and context > max_positions:
        raise ModelFileError(f"--context {context} is longer than the model's {max_positions} positions")
    log(f"tune: {tokens.size} tokens -> {split.windows} calibration and {split.windows} held-out windows of "
        f"{split.window_len}; {bos.describe()}")

    # 1. Gating thresholds, searched on the calibration windows.
    entries, search = gating_search(graph, split.calibration, max_dppl * margin, windows=split.windows,
                                    window_len=split.window_len, reference=None if reference is None else baseline,
                                    method=method, bos=bos, threads=threads, log=log)

    step("calibrated")
    # 2. Attention selection, when the context is long and the text can check it.
    attention, attention_note = None, "--context not given: attention left exact"
    if context is not None and context >= LONG_CONTEXT:
        if split.held_out.size >= context:
            attention = AttentionSettings(select="popcount")  # each attention form's recommended setting
            attention_note = f"PopcountAttention, recommended setting, for contexts of {context}"
        else:
            attention_note = (f"--context {context}: the text's held-out part has {split.held_out.size} tokens, "
                              f"fewer than one {context}-token window; attention left exact")
    elif context is not None:
        attention_note = f"--context {context} < {LONG_CONTEXT}: attention selection does not pay there; left exact"
    config = _gating_config(entries, attention)

    # 3. Held-out check (and the attention at the full context, when chosen).
    from ..graph_rewrite import rewrite_model

    tuned_graph, rewrite_report = rewrite_model(graph, config)
    held_out = compare_lm(baseline, tuned_graph, split.held_out, windows=split.windows, window_len=split.window_len,
                          progress=progress, bos=bos)
    long_check = None
    if attention is not None:
        long_check = compare_lm(baseline, tuned_graph, split.held_out, windows=1, window_len=context, progress=progress,
                                bos=bos)
    worst = max(held_out["dppl"], long_check["dppl"] if long_check else -1.0)
    report: dict[str, Any] = {
        "command": "ortsparse tune " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["tune"] else None,
        "model": str(source), "reference": None if reference is None else str(reference), "output": str(out), "max_dppl": max_dppl, "margin": margin, "context": context,
        "tokens": int(tokens.size), "windows": split.windows, "window_len": split.window_len, "bos": bos.to_dict(),
        "window_construction": held_out["window_construction"],
        "gating": search, "attention": attention.attributes() if attention else None,
        "attention_note": attention_note, "rewrite": rewrite_report.to_dict()["counts"],
        "held_out": {k: v for k, v in held_out.items() if not isinstance(v, np.ndarray)},
        "held_out_long": ({k: v for k, v in long_check.items() if not isinstance(v, np.ndarray)}
                          if long_check else None),
        "machine": machine_info(), "versions": versions(),
    }
    del tuned_graph
    step("held-out checked")
    if worst > max_dppl:
        report["written"] = False
        report["advice"] = (f"held-out dppl {100 * worst:+.2f}% is over the budget {100 * max_dppl:.2f}%: nothing "
                            f"written. The calibration windows allowed {100 * search['calibration_dppl']:+.2f}% at "
                            f"margin {margin}; a smaller --margin, a longer text (more calibration windows), or "
                            f"--max-dppl {max(worst * 1.1, max_dppl * 1.5):.3f} would be needed")
        report["seconds"] = round(time.perf_counter() - started, 1)
        bar.close()
        log(f"tune: {report['advice']}")
        return report

    # 4. Speed in the real loop, 5. the outputs (written together).
    config = _gating_config(entries, attention, DEPLOY_MAX_GATED_ROWS)  # what is written (prompts dense)
    report["max_gated_rows"] = DEPLOY_MAX_GATED_ROWS
    with tempfile.TemporaryDirectory(prefix="ortsparse-tune-") as workdir, outputs:
        if folder is not None:
            staged = rewrite_genai_folder(folder, Path(workdir) / "tuned", config).folder
            candidates = {"input": folder, "tuned": staged}
        else:
            staged = Path(workdir) / "tuned.onnx"
            rewrite_file(decoder, staged, config, progress=False, check=False)
            candidates = {"input": decoder, "tuned": staged}
        speed_context = min(context or 128, (max_positions or 1 << 30) - speed_steps - 8)
        report["speed_context"] = speed_context
        report["speed_runner"] = "onnxruntime_genai Generator" if folder is not None else "ONNX Runtime session"
        try:
            report["speed"] = decode_speed(candidates, split.held_out if split.held_out.size > speed_context + speed_steps
                                           else None, context=speed_context, steps=speed_steps, threads=threads, log=log)
        except Exception as error:  # a decoder the loop cannot drive (no KV cache): report, do not fail
            report["speed"] = {"error": f"decode loop not run: {str(error).splitlines()[0]}"}
        step("speed measured")
        report["written"] = True
        report["seconds"] = round(time.perf_counter() - started, 1)
        outputs.write_text(targets[".json"], json.dumps(report, indent=1, default=float) + "\n")
        outputs.write_text(targets[".md"], markdown(report))
        outputs.write(targets[".png"], lambda path: plot(report, path))
        if folder is not None:
            rewrite_genai_folder(folder, out, config, outputs=outputs)
        else:
            rewrite_file(decoder, out, config, progress=False, outputs=outputs)
        outputs.commit()  # the model and its reports together
    step("written")
    bar.close()
    log(summary(report))
    return report


REPORT_FILES = ((".json", "JSON report"), (".md", "markdown report"), (".png", "plot"))


def tune_outputs(model: str | Path, output: str | Path, report_stem: str | Path | None = None,
                 protected: dict | None = None, reference: str | Path | None = None
                 ) -> tuple[OutputFiles, dict[str, Path]]:
    """What tune reads (``model`` and its data or folder, ``reference``, ``protected``: the text and
    tokenizer) and writes (``output``, a file or, for a genai folder, a folder; the report files
    ``<stem>.json/.md/.png``), declared and checked (graph_rewrite/output_paths.py): the
    OutputFiles to stage them in, and the report destinations by suffix. Nothing is written."""
    source = Path(model)
    folder = genai_folder(source) if source.is_dir() else None
    reads = Inputs(protected or {}).add_model(folder or source, "the source folder" if folder else "the input model")
    reads.add_model(reference, "the reference model")
    outputs = OutputFiles(reads)
    out = Path(output)
    if folder is None:
        outputs.add(out, "output")
    else:
        outputs.add_folder(out, "output", replaceable=written_by_ortsparse)
    stem = Path(report_stem) if report_stem is not None else out.with_name(out.name + ".tune")
    return outputs, {suffix: outputs.add(f"{stem}{suffix}", what) for suffix, what in REPORT_FILES}


def summary(report: dict[str, Any]) -> str:
    held = report["held_out"]
    dense = report["gating"].get("allocation", {}).get("dense_on_ours", [])
    gated = sum(c.get("rewritten", 0) for c in report["rewrite"].values() if isinstance(c, dict)) - len(dense)
    lines = [f"tune: wrote {report['output']}",
             f"  layers gated: {gated}; gated weight bytes skipped (calibration): "
             f"{100 * report['gating']['skipped_fraction']:.1f}%"
             + (f"; dense on our kernel: {', '.join(dense)}" if dense else ""),
             f"  held-out: {describe_spread(held)} (budget {100 * report['max_dppl']:.1f}%), top-1 agreement "
             f"{held['top1_agreement']:.3f} on {report['windows']} x {report['window_len']} tokens",
             f"  windows: {report.get('window_construction', '')}",
             f"  attention: {report['attention_note']}"]
    if report.get("max_gated_rows"):
        lines.append(f"  calls of more than {report['max_gated_rows']} rows (prompts) run dense in the written model")
    speed = report.get("speed") or {}
    if "input" in speed and "tuned" in speed:
        a, b = speed["input"]["tokens_per_s"], speed["tuned"]["tokens_per_s"]
        lines.append(f"  decode (real loop, context {report['speed_context']}, {report.get('speed_runner', 'ORT')}): "
                     f"{a:.1f} -> {b:.1f} tok/s ({b / a:.2f}x)")
    elif "error" in speed:
        lines.append(f"  decode: {speed['error']}")
    lines.append(f"  {report['seconds']:.0f} s")
    return "\n".join(lines)


def markdown(report: dict[str, Any]) -> str:
    held = report["held_out"]
    lines = [f"# ortsparse tune: {Path(report['model']).name}", ""]
    if report.get("command"):
        lines += [f"Command: `{report['command']}`  "]
    against = f" vs {Path(report['reference']).name}" if report.get("reference") else ""
    lines += [f"Text: {report['tokens']} tokens; {report['windows']} calibration + {report['windows']} held-out "
              f"windows of {report['window_len']}; budget {100 * report['max_dppl']:.1f}% dppl{against} (held-out)", "",
              f"Held-out windows: {report.get('window_construction', '')}.", "",
              "| | dppl (held-out) | top-1 agreement | gated bytes skipped | decode tok/s |", "|---|---|---|---|---|"]
    speed = report.get("speed") or {}
    base = speed.get("input", {}).get("tokens_per_s")
    tuned = speed.get("tuned", {}).get("tokens_per_s")
    # Against a --reference the input's own loss was not measured (the tuned dppl already includes it).
    own = "— | — |" if report.get("reference") else "0 | 1 |"
    lines.append(f"| input | {own} 0 | {base:.1f} |" if base else f"| input | {own} 0 | — |")
    lines.append(f"| tuned | {100 * held['dppl']:+.2f}% | {held['top1_agreement']:.3f} | "
                 f"{100 * report['gating']['skipped_fraction']:.1f}% | "
                 + (f"{tuned:.1f} ({tuned / base:.2f}x) |" if base and tuned else "— |"))
    if base and tuned:
        lines += ["", f"Decode: real loop at context {report['speed_context']}, {report.get('speed_runner', 'ORT')}, "
                      f"models alternating."]
    lines += ["", f"Held-out {describe_spread(held)}: the budget check reads the mean; a difference smaller "
                  "than the spread is within window-to-window noise."]
    placement = report["gating"].get("allocation", {}).get("head_placement") or []
    lines += [f"LM head {record['name']}: {record['note']} (timed on this machine, sessions alternating): "
              + ("dense on our kernel" if record["on_ours"] else "MatMulNBits kept") + "." for record in placement]
    lines += ["", f"Attention: {report['attention_note']}."]
    if report.get("held_out_long"):
        lines.append(f"Held-out at the full context: dppl {100 * report['held_out_long']['dppl']:+.2f}%.")
    lines += ["", f"Calibration search ({report['gating']['method']}, calibration windows):", "",
              "| gated bytes skipped | dppl |", "|---|---|"]
    lines += [f"| {100 * step['skipped_fraction']:.1f}% | {100 * step['loss']:+.2f}% |"
              for step in report["gating"]["history"] if "skipped_fraction" in step]
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib  # the plot extra: only when a PNG is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    history = report["gating"]["history"]
    tried = [h for h in history if "skipped_fraction" in h]
    ax.scatter([100 * h["skipped_fraction"] for h in tried], [100 * h["loss"] for h in tried],
               label="tried on calibration windows")
    held = report["held_out"]
    ax.scatter([100 * report["gating"]["skipped_fraction"]], [100 * held["dppl"]], marker="*", s=180, c="black",
               zorder=5, label="chosen, held-out")
    ax.axhline(100 * report["max_dppl"], color="grey", ls="--", lw=0.8, label="budget")
    ax.set_xlabel("gated weight bytes skipped (%)")
    ax.set_ylabel("dppl (%)")
    speed = report.get("speed") or {}
    if "tuned" in speed and "input" in speed:
        ax.set_title(f"decode {speed['tuned']['tokens_per_s'] / speed['input']['tokens_per_s']:.2f}x at context "
                     f"{report['speed_context']}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help="an ONNX decoder (.onnx) or an onnxruntime-genai folder")
    parser.add_argument("--text", metavar="FILE", required=True, help="a UTF-8 text like the model's real inputs")
    parser.add_argument("--tokenizer", metavar="PATH", help="tokenizer.json (or its folder); default: beside MODEL")
    parser.add_argument("--bos", default="auto", metavar="auto|none|ID",
                        help="the token every window starts with: auto (default) = BOS when the tokenizer adds one "
                             "(tokenizer_config.json add_bos_token, else tokenizer.json's template), none, or an id")
    parser.add_argument("-o", "--output", metavar="OUT", required=True,
                        help="the tuned model (.onnx), or a new folder for a genai MODEL")
    parser.add_argument("--max-dppl", type=flag_types.finite_float(0.0, 10.0, min_open=True, max_open=True),
                        default=0.02, help="held-out perplexity budget (default 0.02)")
    parser.add_argument("--margin", type=flag_types.fraction, default=0.75,
                        help="the search on calibration windows stays within margin x budget (default 0.75)")
    parser.add_argument("--context", type=flag_types.positive_int, default=None,
                        help="the context the model will run at; >= 2048 also tunes attention selection")
    parser.add_argument("--reference", metavar="MODEL", help="measure dppl against this model, e.g. the fp32 model of "
                        "a quantized MODEL (the budget then covers quantization and gating together)")
    parser.add_argument("--method", choices=["allocated", "uniform"], default="allocated",
                        help="per-layer sparsities from measured sensitivities (default), or one for every layer")
    parser.add_argument("--threads", type=flag_types.threads, default=1,
                        help="intra-op threads of the speed check (default 1)")
    parser.add_argument("--windows", type=flag_types.int_in(1, 64), default=8, metavar="N",
                        help="calibration windows, and as many held-out ones, of up to 512 tokens (default 8)")
    parser.add_argument("--report", metavar="STEM", help="report files STEM.json/.md/.png (default: OUT.tune)")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if not (0 < args.max_dppl < 10):
        parser.error(f"--max-dppl {args.max_dppl}: give a fraction such as 0.02")
    if not (0 < args.margin <= 1):
        parser.error(f"--margin {args.margin} must be in (0, 1]")
    if not 1 <= args.windows <= 64:
        parser.error(f"--windows {args.windows} must be in 1..64")
    if not Path(args.model).exists():
        parser.error(f"model {args.model} does not exist")
    decoder = model_input(args.model)
    tokenizer = find_tokenizer(args.model, args.tokenizer)
    protected = {Path(args.text): "the text", tokenizer: "the tokenizer"}
    tune_outputs(args.model, args.output, args.report, protected, args.reference)  # before reading the text
    tokens = text_tokens(args.text, args.model, args.tokenizer, vocab_size(decoder, default=None))
    bos = resolve_bos(args.bos, args.model, args.tokenizer, vocab_size(decoder, default=None))
    report = tune(args.model, tokens, args.output, max_dppl=args.max_dppl, margin=args.margin, context=args.context,
                  threads=args.threads, report_stem=args.report, progress=sys.stderr.isatty(),
                  reference=args.reference, method=args.method, windows=args.windows, bos=bos,
                  protected=protected)
    return 0 if report["written"] else 1
