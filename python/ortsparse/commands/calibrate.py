"""Calibrated KWTA (TEAL-style): per-layer magnitude thresholds that meet a quality budget.

1. Capture the input of every targeted linear layer of the dense model on calibration windows
   (taken from the end of the token array; evaluation windows come from the start, so the two
   never overlap) and record per layer the |x| quantile for each sparsity level of a grid.
2. Search the highest uniform sparsity s whose per-layer thresholds (threshold_l = quantile_l(s),
   block 1, k_frac 1 so the threshold alone decides) keep calibration dppl <= the budget.
3. Optionally (`--greedy`), raise the sparsity of one layer group (role: q/k/v/out/up/down) at a
   time, taking the step that skips the most weight bytes per unit of dppl, until the budget is hit.
4. Write the per-layer override file the rewriter reads, and report held-out dppl (and tokens/s
   with `--bench`).
Encoders use a cosine floor (`--min-cosine`) on a sentence set instead of dppl.
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from .. import flag_types, tt
from ..calibration import allocation, head_placement
from ..graph_rewrite import KwtaSettings, RewriteConfig, TechniqueChoice, rewrite_model
from ..graph_rewrite.config import NodePlan
from ..graph_rewrite.errors import ModelFileError
from ..graph_rewrite.genai import model_input, rewrite_genai_folder
from ..graph_rewrite.layer_settings import rewritten_with, selected_layers
from ..graph_rewrite.output_paths import Inputs, check_outputs, write_text_files
from ..measure.corpus import (SPLITS, check_windows, encoder_batches, lm_windows, load_corpus_tokens,
                              split_held_out, text_per_window)
from ..measure.decode import plan
from ..measure.embeddings import compare_embeddings
from ..measure.perplexity import compare_lm, describe_spread, perplexity
from ..measure.speed import decode_speed
from ..measure.text import BosChoice, as_bos, resolve_bos, text_tokens, tokenizer_read
from ..runtime import captured_values, context_length, genai_folder, lm_feeds, load_proto, vocab_size
from ..zoo.models import model_path

# --bench: the decode loop's contexts, timed steps and untimed warm-up steps.
BENCH_CONTEXTS = (128, 1024)
BENCH_STEPS = 32
BENCH_WARMUP = 4

SPARSITY_GRID = (0.0, 0.05, 0.1, 0.15, 0.2, 0.225, 0.25, 0.275, 0.3, 0.325, 0.35, 0.4, 0.45, 0.5, 0.6, 0.7)


@dataclass
class TargetLayer:
    name: str
    role: str  # group of the greedy stage: the layer's role, "<role>@first" for the first of its role
    layer_class: str
    input_name: str
    weight_bytes: int
    quantiles: dict[float, float]  # sparsity -> |x| threshold


def target_layers(model, target: str) -> list[TargetLayer]:
    """The linear layers `target` selects, with the graph value feeding each (its X)."""
    layers = []
    seen_roles: set[str] = set()
    for layer in selected_layers(model, "kwta", target):
        # The first layer of each role gets its own group: on SmolLM2 layer 0's MLP is by far the
        # most fragile (measure.md), and the greedy stage should be able to spare it alone.
        group = layer.role if layer.role in seen_roles else f"{layer.role}@first"
        seen_roles.add(layer.role)
        layers.append(TargetLayer(layer.name, group, layer.layer_class, layer.node.inputs[0].name,
                                  4 * int(layer.k) * int(layer.n), {}))
    return layers


def capture_quantiles(model, layers: list[TargetLayer], windows,
                      grid=SPARSITY_GRID, samples_per_window: int = 200_000, seed: int = 0, log=print) -> None:
    """Fills layer.quantiles: the |x| value below which a fraction s of the layer's inputs fall
    (mean over windows), for each s of the grid. windows: token windows of an LM, or named sentence
    batches of an encoder (anything ortsparse.runtime.lm_feeds takes)."""
    wanted = sorted({layer.input_name for layer in layers})
    rng = np.random.default_rng(seed)
    sums: dict[str, np.ndarray] = {name: np.zeros(len(grid)) for name in wanted}
    # A decoder graph (e.g. onnxruntime-genai's) prefills from an empty past.
    for i, (_, values) in enumerate(captured_values(model, wanted, windows)):
        for name, value in zip(wanted, values):
            flat = np.abs(value.reshape(-1))
            if flat.size > samples_per_window:
                flat = rng.choice(flat, samples_per_window, replace=False)
            sums[name] += np.quantile(flat, grid)
        log(f"calibrate: captured window {i + 1}/{len(windows)}")
    for layer in layers:
        mean = sums[layer.input_name] / len(windows)
        layer.quantiles = {float(s): float(q) for s, q in zip(grid, mean)}


def layer_calibration(model, target: str, batches: Iterable[Any], max_rows: int = 2048, seed: int = 0,
                      feeds: Callable[[Any, Any], Mapping[str, np.ndarray]] = lm_feeds) -> dict[str, np.ndarray]:
    """Calibration inputs for ``rewrite_model(..., calibration=...)``: {node name: X [rows, K]} for
    the linear layers ``target`` selects (mlp, attn, both, down, all), from running the dense model
    on ``batches`` (LM token windows or encoder sentence batches, see ortsparse.runtime.lm_feeds;
    ``feeds(session, batch)`` makes a batch's feeds)."""
    layers = target_layers(model, target)
    by_input = tt.collect_matmul_inputs(model, [layer.input_name for layer in layers], batches, max_rows=max_rows,
                                        seed=seed, feeds=feeds)
    return {layer.name: by_input[layer.input_name] for layer in layers}


def plan_for(layers: list[TargetLayer], sparsity: dict[str, float]) -> NodePlan:
    """Each layer gated by its own threshold (every other layer, and one at sparsity 0, off)."""
    return NodePlan("kwta", {layer.name: {"threshold": layer.quantiles[sparsity[layer.name]], "k_frac": 1.0, "block": 1}
                             for layer in layers if sparsity.get(layer.name, 0.0) > 0.0})


def skipped_bytes(layers: list[TargetLayer], sparsity: dict[str, float]) -> float:
    return sum(layer.weight_bytes * sparsity.get(layer.name, 0.0) for layer in layers)


def search(layers: list[TargetLayer], evaluate: Callable[[dict[str, float]], float], budget: float,
           greedy: bool, grid=SPARSITY_GRID, log=print, max_rounds: int = 8) -> tuple[dict[str, float], list[dict]]:
    """Uniform search, then optional greedy per-role refinement. evaluate(sparsity) -> loss
    (dppl, or 1 - mean cosine), which must stay <= budget."""
    history = []
    best: dict[str, float] = {layer.name: 0.0 for layer in layers}
    for s in grid[1:]:
        candidate = {layer.name: s for layer in layers}
        loss = evaluate(candidate)
        history.append({"stage": "uniform", "sparsity": s, "loss": loss})
        log(f"calibrate: uniform sparsity {s:.2f}: loss {loss:+.4f}")
        if loss > budget:
            break
        best = candidate
    if not greedy:
        return best, history
    roles = sorted({layer.role for layer in layers})
    for _ in range(max_rounds):
        options = []
        for role in roles:
            members = [layer for layer in layers if layer.role == role]
            current = best[members[0].name]
            higher = [s for s in grid if s > current]
            if not higher:
                continue
            candidate = dict(best)
            for layer in members:
                candidate[layer.name] = higher[0]
            loss = evaluate(candidate)
            gain = skipped_bytes(layers, candidate) - skipped_bytes(layers, best)
            history.append({"stage": "greedy", "role": role, "sparsity": higher[0], "loss": loss})
            log(f"calibrate: greedy {role} -> {higher[0]:.2f}: loss {loss:+.4f}")
            if loss <= budget:
                options.append((gain / max(loss, 1e-6), candidate))
        if not options:
            return best, history
        best = max(options, key=lambda option: option[0])[1]
        history.append({"stage": "greedy-accepted", "sparsity_by_group": {
            role: next(best[layer.name] for layer in layers if layer.role == role) for role in roles}})
        log(f"calibrate: greedy accepted {history[-1]['sparsity_by_group']}")
    return best, history


def gating_search(model, calib_tokens: np.ndarray, budget: float, *, windows: int = 4, window_len: int = 512,
                  target: str = "both", greedy: bool = False, greedy_rounds: int = 8, reference: Any = None,
                  method: str = "uniform", score: str = "l2", bos: BosChoice | int | None = None,
                  threads: int = 1, log=print) -> tuple[NodePlan, dict[str, Any]]:
    """Per-layer KWTA thresholds for the ``target`` layers of the LM ``model`` (ModelProto) that keep
    the dppl on ``windows`` calibration windows of ``calib_tokens`` within ``budget``. Returns the
    per-node plan (its ``entries()`` are the override file) and the search: ``history`` (each tried point: sparsity, loss = dppl,
    skipped_fraction of the targeted layers' weight bytes), the chosen ``sparsity`` per layer,
    ``skipped_fraction`` and ``calibration_dppl`` of the choice. ``reference``: the model the dppl is
    measured against (e.g. the fp32 model when ``model`` is its quantized version: the budget is then
    the total loss of quantization and gating); default ``model`` itself. ``method``: ``uniform`` (one
    sparsity for every layer, then optional ``greedy`` per-role steps) or ``allocated`` (per-layer
    sparsities from measured sensitivities, :mod:`ortsparse.calibration.allocation`; ``score`` l2 or
    l2_weighted). ``bos``: the token every window starts with (see perplexity.perplexity). An ungated
    quantized LM head is put dense on our kernel only when a measurement with ``threads`` threads finds
    it faster there (head_placement; the record is under ``allocation.head_placement``)."""
    bos = as_bos(bos)
    if method == "allocated":
        result = allocation.allocate_lm(model, calib_tokens, budget, margin=1.0, target=target, score=score,
                                        windows=windows, window_len=window_len, reference=reference, bos=bos.id,
                                        log=log)
        result.dense_on_ours, placement = head_placement.place_heads(model, result.dense_on_ours, threads=threads,
                                                                     log=log)
        history = [{"stage": "allocated", "mu": h["mu"], "loss": h["loss"], "skipped_fraction": h["skipped"]}
                   for h in result.history]
        return result.plan(), {
            "method": "allocated", "score": score, "history": history, "sparsity": result.sparsity(),
            "budget": budget, "skipped_fraction": result.skipped_fraction(),
            "calibration_dppl": result.calibration_loss, "layers": len(result.layers), "target": target,
            "allocation": {**result.report(), "head_placement": placement}, "bos": bos.to_dict(),
        }
    if method != "uniform":
        raise ValueError(f"unknown calibration method {method!r} (uniform, allocated)")
    calib = lm_windows(calib_tokens, windows, window_len, bos=bos.id)
    layers = target_layers(model, target)
    log(f"calibrate: {len(layers)} layers ({target}), {len(calib)} calibration windows of {window_len}; "
        f"{bos.describe()}")
    capture_quantiles(model, layers, calib, log=log)
    dense = perplexity(model if reference is None else reference, calib_tokens, windows, window_len, bos=bos)["ppl"]
    total = sum(layer.weight_bytes for layer in layers) or 1

    def evaluate(sparsity: dict[str, float]) -> float:
        rewritten = rewritten_with(model, plan_for(layers, sparsity))
        return perplexity(rewritten, calib_tokens, windows, window_len, bos=bos)["ppl"] / dense - 1.0

    best, history = search(layers, evaluate, budget, greedy, log=log, max_rounds=greedy_rounds)
    for step in history:
        if "sparsity" in step and step.get("stage") == "uniform":
            step["skipped_fraction"] = float(step["sparsity"])  # uniform: every layer the same fraction
    accepted = [h["loss"] for h in history if "loss" in h and h["loss"] <= budget]
    return plan_for(layers, best), {
        "method": "uniform", "history": history, "sparsity": best, "budget": budget,
        "skipped_fraction": skipped_bytes(layers, best) / total,
        "calibration_dppl": max(accepted) if accepted else 0.0,
        "layers": len(layers), "target": target, "bos": bos.to_dict(),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", help="LM export (default: cached SmolLM2 full.torchscript; a KV-cache "
                        "decoder or an onnxruntime-genai folder is scored with an empty past) or an encoder")
    parser.add_argument("-o", "--output", required=True, help="override file to write (JSON)")
    parser.add_argument("--max-dppl", type=flag_types.positive_float, default=0.02,
                        help="LM budget: ppl_rewritten/ppl_dense - 1")
    parser.add_argument("--min-cosine", type=flag_types.finite_float(-1.0, 1.0), default=None,
                        help="encoder budget: mean embedding cosine floor (switches to the encoder mode)")
    parser.add_argument("--target", default="all-decoder", choices=["mlp", "attn", "both", "down", "all-decoder", "all"],
                        help="layers to calibrate (all-decoder = mlp + attn; the head stays dense; all = with the head)")
    parser.add_argument("--method", choices=["uniform", "allocated"], default="uniform",
                        help="uniform: one sparsity for every layer (+ --greedy); allocated: per-layer sparsity from "
                             "measured sensitivities (ortsparse.calibration.allocation)")
    parser.add_argument("--score", choices=allocation.SCORES, default="l2",
                        help="gate score of --method allocated (l2 = |x|; l2_weighted = |x_k|*||W_k||)")
    parser.add_argument("--tokens", help="token ids (.npy) (default: the cached britannica corpus), split into "
                        "held-out and calibration windows by --split")
    parser.add_argument("--text", metavar="FILE", help="a UTF-8 text instead of --tokens (tokenized with --tokenizer, "
                        "else the tokenizer.json beside MODEL); split as --tokens is")
    parser.add_argument("--tokenizer", metavar="PATH", help="tokenizer.json (or its folder) for --text")
    parser.add_argument("--bos", default="auto", metavar="auto|none|ID",
                        help="the token every window starts with: auto (default) = BOS when the model's tokenizer "
                             "adds one (tokenizer_config.json add_bos_token, else tokenizer.json's template), "
                             "none, or a token id")
    parser.add_argument("--margin", type=flag_types.fraction, default=0.75,
                        help="calibration windows must stay within margin x budget, so the held-out result "
                             "has room to differ (default 0.75)")
    parser.add_argument("--split", choices=SPLITS, default="halves",
                        help="held-out vs calibration tokens: halves (first half held out; default) or interleaved "
                             "(alternate windows: both see the same mix of the text)")
    parser.add_argument("--calib-windows", type=flag_types.positive_int, default=4)
    parser.add_argument("--eval-windows", type=flag_types.positive_int, default=8)
    parser.add_argument("--window-len", type=flag_types.window_len, default=512)
    parser.add_argument("--greedy", action="store_true", help="per-role greedy refinement after the uniform search")
    parser.add_argument("--greedy-rounds", type=flag_types.non_negative_int, default=8,
                        help="at most this many greedy steps (default 8)")
    parser.add_argument("--reference", metavar="MODEL", help="measure dppl against this model (e.g. the fp32 model "
                        "of a quantized MODEL: the budget then covers quantization and gating together)")
    parser.add_argument("--bench", action="store_true", help="also measure decode tokens/s (KV export)")
    parser.add_argument("--report", default=None, help="JSON report path (default: next to the output)")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    check_outputs([(args.output, "override file"), (_report_path(args), "report")], _inputs(args))  # before the long run
    staged: dict[str, tuple[str, str]] = {}
    code = _calibrate(args, lambda path, what, text: staged.__setitem__(path, (what, text)))
    write_text_files(staged, _inputs(args))  # the override file and its report together, after every check
    return code


def _calibrate(args: argparse.Namespace, write: Callable[[str, str, str], None]) -> int:
    target = "both" if args.target == "all-decoder" else args.target
    log = print
    if args.min_cosine is not None and args.method == "allocated":
        return allocation.run(args, target, write, _report_path(args), log)
    if args.min_cosine is not None:
        if not args.model:
            args.model = str(model_path("minilm", "torchscript"))
        return _run_encoder(args, target, log, write)
    model_file = args.model
    if not model_file:
        model_file = str(model_path("smollm2", "full.torchscript"))
    model_file = str(model_input(model_file))  # a genai folder: its decoder graph
    model = load_proto(model_file, load_weights=True)  # external data under ONNX Runtime's rule
    if args.text and args.tokens:
        raise ModelFileError("give --text or --tokens, not both")
    tokens = (text_tokens(args.text, args.model or model_file if args.tokenizer is None else None, args.tokenizer,
                          vocab_size(model, default=None))
              if args.text else load_corpus_tokens(args.tokens, vocab_size(model, default=None)))
    bos = resolve_bos(args.bos, args.model or model_file, args.tokenizer, vocab_size(model, default=None))
    eval_tokens, calib_tokens = split_held_out(tokens, text_per_window(args.window_len, bos.id), args.split)
    source = args.text or args.tokens or "the default corpus"
    for part, flag, count in ((eval_tokens, "--eval-windows", args.eval_windows),
                              (calib_tokens, "--calib-windows", args.calib_windows)):
        check_windows(part.size, count, args.window_len, windows_flag=flag, max_positions=context_length(model_file),
                      source=f"the {'held-out' if part is eval_tokens else 'calibration'} part of {source} "
                             f"(--split {args.split})", bos=bos.id)
    if args.bench:  # its decode loop is teacher-forced on the same text: long enough for the longest context
        needed = max(plan(context, BENCH_STEPS, BENCH_WARMUP, max_positions=context_length(model_file)).tokens_needed
                     for context in BENCH_CONTEXTS)
        if tokens.size < needed:
            raise ModelFileError(f"--bench runs the decode loop on {source} up to context {max(BENCH_CONTEXTS)}: it "
                                 f"needs {needed} tokens, the text has {tokens.size}")
    reference = str(model_input(args.reference)) if args.reference else None
    gating, found = gating_search(model, calib_tokens, args.margin * args.max_dppl, windows=args.calib_windows,
                                   window_len=args.window_len, target=target, greedy=args.greedy,
                                   greedy_rounds=args.greedy_rounds, reference=reference, method=args.method,
                                   score=args.score, bos=bos, log=log)
    best, history = found["sparsity"], found["history"]
    write(args.output, "override file", json.dumps({"layers": gating.entries()}, indent=1) + "\n")
    held_out = compare_lm(reference or model, rewritten_with(model, gating), eval_tokens, windows=args.eval_windows,
                          window_len=args.window_len, bos=bos)
    report = {
        "command": getattr(args, "command_line", None),
        "model": model_file, "reference": reference, "split": args.split, "bos": bos.to_dict(),
        "windows": held_out["window_construction"], "budget_dppl": args.max_dppl, "margin": args.margin, "target": target,
        "method": args.method, "sparsity": best, "history": history,
        "skipped_weight_fraction_of_targeted": found["skipped_fraction"],
        **({"allocation": found["allocation"]} if "allocation" in found else {}),
        "held_out": {k: v for k, v in held_out.items() if not isinstance(v, np.ndarray)},
        # Measured by the op on the held-out run (the planned fraction above is the calibration grid's).
        "bytes": allocation.bytes_summary(model, held_out.get("metrics", {}),
                                          found.get("allocation", {}).get("dense_on_ours", [])),
    }
    if args.bench:
        report["bench"] = _bench_with(model_file, gating, tokens, log)
    report_path = _report_path(args)
    write(report_path, "report", json.dumps(report, indent=1, default=float) + "\n")
    log(f"calibrate: held-out windows: {held_out['window_construction']}")
    log(f"calibrate: wrote {args.output}; held-out {describe_spread(held_out)}, top-1 agreement "
        f"{held_out.get('top1_agreement', float('nan')):.3f}, skipped {report['skipped_weight_fraction_of_targeted']:.1%} "
        f"of targeted weight bytes; report {report_path}")
    return 0 if held_out["dppl"] <= args.max_dppl else 1


def _report_path(args) -> str:
    return args.report or str(Path(args.output).with_suffix(".report.json"))


def _inputs(args) -> Inputs:
    """What calibrate reads (never overwritten by its outputs)."""
    inputs = Inputs().add_model(args.model).add(args.tokens, "the tokens").add(args.text, "the text")
    if args.text:
        inputs.add(tokenizer_read(args.model, args.tokenizer), "the tokenizer")
    return inputs.add_model(args.reference, "the reference model")


def _run_encoder(args, target: str, log, write: Callable[[str, str, str], None]) -> int:
    model = load_proto(args.model, load_weights=True)
    layers = target_layers(model, target)
    batches = encoder_batches()
    capture_quantiles(model, layers, batches, log=log)
    budget = 1.0 - args.min_cosine

    def evaluate(sparsity):
        result = compare_embeddings(model, rewritten_with(model, plan_for(layers, sparsity)))
        return 1.0 - result["cosine_mean"]

    best, history = search(layers, evaluate, args.margin * budget, args.greedy, log=log,
                           max_rounds=args.greedy_rounds)
    gating = plan_for(layers, best)
    write(args.output, "override file", json.dumps({"layers": gating.entries()}, indent=1) + "\n")
    final = compare_embeddings(model, rewritten_with(model, gating))
    report = {"command": getattr(args, "command_line", None), "model": args.model,
              "min_cosine": args.min_cosine, "sparsity": best, "history": history,
              "result": {k: v for k, v in final.items() if not isinstance(v, np.ndarray)}}
    report_path = _report_path(args)
    write(report_path, "report", json.dumps(report, indent=1, default=float) + "\n")
    log(f"calibrate: wrote {args.output}; cosine mean {final['cosine_mean']:.4f} min {final['cosine_min']:.4f}")
    return 0 if final["cosine_mean"] >= args.min_cosine else 1


def _bench_with(model_file: str, gating: NodePlan, tokens: np.ndarray, log) -> dict:
    """Decode tokens/s of the calibrated rewrite vs dense in the real loop, at :data:`BENCH_CONTEXTS`,
    teacher-forced on ``tokens`` (the calibration's text): on the cached SmolLM2 KV export (node names
    are those of the full export), or, when the calibrated model is an onnxruntime-genai decoder, on
    its folder (rewritten into a temporary one)."""
    import tempfile

    config = RewriteConfig(techniques={"kwta": TechniqueChoice(KwtaSettings(), enabled=False, target="all")}, plan=gating)
    with tempfile.TemporaryDirectory(prefix="ortsparse-calibrate-") as workdir:
        folder = genai_folder(model_file)
        if folder is not None:
            dense: Any = folder
            rewritten: Any = rewrite_genai_folder(folder, Path(workdir) / "calibrated", config).folder
        else:
            dense = onnx.load(str(model_path("smollm2", "kv.torchscript")))
            rewritten, _ = rewrite_model(dense, config)
        return {str(context): decode_speed({"dense": dense, "calibrated": rewritten}, tokens, context=context,
                                           steps=BENCH_STEPS, warmup=BENCH_WARMUP, log=log)
                for context in BENCH_CONTEXTS}
