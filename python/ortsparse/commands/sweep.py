"""A grid of KwtaBlockMatMul settings on a model: quality (dppl, top-1 agreement) on the
full-sequence export and decode speed on the KV export for every point, written as JSON, a
markdown table and a PNG (speedup vs dppl, one point per setting, the dense point marked).
"""
from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np

from .. import flag_types
from ..benchmarking import check_report, machine_info, plot_skipped
from ..graph_rewrite import KwtaSettings, RewriteConfig, TechniqueChoice, rewrite_model
from ..graph_rewrite.output_paths import Inputs, resolve_report_stem, write_files
from ..measure.corpus import load_corpus_tokens, vocabulary_of
from ..measure.perplexity import perplexity
from ..measure.speed import decode_speed
from ..runtime import load_proto
from ..zoo.models import model_path


def grid(scopes, keeps, blocks, scores) -> list[dict[str, Any]]:
    return [dict(target=t, k_frac=float(k), block=int(b), score=s)
            for t, k, b, s in itertools.product(scopes, keeps, blocks, scores)]


def config_for(point: dict[str, Any]):
    settings = KwtaSettings(k_frac=point["k_frac"], block=point["block"], score=point["score"])
    return RewriteConfig(techniques={"kwta": TechniqueChoice(settings, enabled=True, target=point["target"])})


def label(point: dict[str, Any]) -> str:
    return f"{point['target']} k={point['k_frac']:g} b={point['block']} {point['score']}"


def run_sweep(full_model, kv_model, tokens: np.ndarray, points: list[dict[str, Any]], *, windows: int,
              window_len: int, context: int, steps: int, log=print) -> list[dict[str, Any]]:
    """Quality on ``windows`` x ``window_len`` tokens of the full export, decode speed of the KV
    export in the real loop (dense and rewritten round-robin, ``context`` prompt tokens, ``steps``
    timed steps, 1 thread)."""
    dense = perplexity(full_model, tokens, windows, window_len)
    log(f"sweep: dense ppl {dense['ppl']:.3f} on {windows}x{window_len} tokens")
    results = []
    for i, point in enumerate(points):
        config = config_for(point)
        full_rewritten, _ = rewrite_model(full_model, config)
        gated = perplexity(full_rewritten, tokens, windows, window_len)
        quality = {"dppl": gated["ppl"] / dense["ppl"] - 1.0, "ppl_rewritten": gated["ppl"], "ppl_dense": dense["ppl"],
                   "top1_agreement": float(np.mean(gated["predictions"] == dense["predictions"]))}
        kv_rewritten, _ = rewrite_model(kv_model, config)
        speed = decode_speed({"dense": kv_model, "rewritten": kv_rewritten}, tokens, context=context, steps=steps)
        keep = speed["rewritten"]["keep_ratio"]
        row = dict(point, label=label(point), dppl=quality["dppl"], ppl=quality["ppl_rewritten"],
                   ppl_dense=quality["ppl_dense"], top1_agreement=quality["top1_agreement"],
                   decode_tokens_per_s=speed["rewritten"]["tokens_per_s"],
                   dense_tokens_per_s=speed["dense"]["tokens_per_s"],
                   speedup=speed["rewritten"]["tokens_per_s"] / speed["dense"]["tokens_per_s"],
                   decode_top1_agreement=speed["rewritten"]["top1_agreement"],
                   mean_keep_ratio=keep if keep is not None else 1.0)
        results.append(row)
        log(f"sweep {i + 1}/{len(points)} {row['label']}: dppl {row['dppl']:+.2%} agree {row['top1_agreement']:.3f} "
            f"speedup x{row['speedup']:.2f}")
    return results


def plot(results: list[dict[str, Any]], path: str, title: str) -> None:
    """The PNG (matplotlib, the plot extra: :func:`ortsparse.benchmarking.plot_skipped` says when it is missing)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    markers = {"mlp": "o", "down": "v", "both": "s", "attn": "^", "all": "D"}
    for target in sorted({r["target"] for r in results}):
        for block in sorted({r["block"] for r in results}):
            pts = [r for r in results if r["target"] == target and r["block"] == block]
            if not pts:
                continue
            ax.scatter([100 * r["dppl"] for r in pts], [r["speedup"] for r in pts], marker=markers.get(target, "o"),
                       label=f"{target}, block {block}", s=36)
            for r in pts:
                ax.annotate(f"{r['k_frac']:g}" + ("w" if r["score"] == "l2_weighted" else ""),
                            (100 * r["dppl"], r["speedup"]), fontsize=7, xytext=(3, 2), textcoords="offset points")
    ax.scatter([0], [1.0], marker="*", s=200, c="black", label="dense ORT", zorder=5)
    ax.axvline(2.0, color="grey", ls="--", lw=0.8)
    ax.text(2.05, ax.get_ylim()[0], " 2% budget", color="grey", fontsize=8, va="bottom")
    ax.set_xscale("symlog", linthresh=1.0)
    ax.set_xlim(left=min(-0.5, 1.2 * min(100 * r["dppl"] for r in results)))
    ax.set_xlabel("perplexity increase dppl (%) — symlog")
    ax.set_ylabel("decode speedup vs dense ORT (tokens/s ratio, real decode loop, 1 thread)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(results, command: str, png: str | None, plot_note: str | None = None) -> str:
    """The table; ``png``: the plot beside it, or None (``plot_note`` says why there is none)."""
    figure = f"![sweep]({Path(png).name})" if png else f"({plot_note})"
    lines = ["# KwtaBlockMatMul sweep", "", f"Command: `{command}`", "", figure, "",
             "| scope | keep | block | score | dppl | top-1 agree | mean keep | decode tok/s | dense tok/s | speedup |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: (r["target"], r["block"], r["score"], -r["k_frac"])):
        lines.append(f"| {r['target']} | {r['k_frac']:g} | {r['block']} | {r['score']} | {r['dppl']:+.2%} | "
                     f"{r['top1_agreement']:.3f} | {r['mean_keep_ratio']:.2f} | {r['decode_tokens_per_s']:.1f} | "
                     f"{r['dense_tokens_per_s']:.1f} | {r['speedup']:.2f} |")
    return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--full", help="full-sequence export (default: cached SmolLM2)")
    parser.add_argument("--kv", help="KV-cache export (default: cached SmolLM2)")
    parser.add_argument("--scopes", nargs="+", default=["mlp", "down", "both"])
    parser.add_argument("--keeps", type=flag_types.fraction, nargs="+", default=[0.9, 0.75, 0.6, 0.5, 0.4])
    parser.add_argument("--blocks", type=flag_types.positive_int, nargs="+", default=[1, 16, 32, 64])
    parser.add_argument("--scores", nargs="+", default=["l2"], choices=["l2", "mean_abs", "l2_weighted"])
    parser.add_argument("--tokens", help="token ids (.npy) for perplexity (default: the cached britannica corpus)")
    parser.add_argument("--windows", type=flag_types.positive_int, default=4)
    parser.add_argument("--window-len", type=flag_types.window_len, default=512)
    parser.add_argument("--context", type=flag_types.positive_int, default=128,
                        help="prompt length before the timed decode steps")
    parser.add_argument("--steps", type=flag_types.positive_int, default=32,
                        help="timed decode steps of the real loop (default 32)")
    parser.add_argument("-o", "--output", required=True, metavar="STEM",
                        help="report stem: STEM.json, STEM.md and STEM.png (e.g. reports/sweep_kwta)")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.full and args.kv:
        full_path, kv_path = Path(args.full), Path(args.kv)
    else:
        full_path, kv_path = model_path("smollm2", "full.torchscript"), model_path("smollm2", "kv.torchscript")
    inputs = (Inputs().add_model(full_path, "the full-sequence model").add_model(kv_path, "the KV-cache model")
              .add(args.tokens, "the tokens"))  # never overwritten by the report
    args.output = resolve_report_stem(args.output, "sweep")  # -o reports/: reports/sweep.json
    check_report(args.output, inputs, ".png")
    plot_note = plot_skipped()  # said before the grid runs; the JSON and markdown reports are written all the same
    if plot_note:
        print(f"sweep: {plot_note}")
    full_model, kv_model = load_proto(full_path, load_weights=True), load_proto(kv_path, load_weights=True)
    tokens = load_corpus_tokens(args.tokens, vocabulary_of(full_model, kv_model))
    points = grid(args.scopes, args.keeps, args.blocks, args.scores)
    results = run_sweep(full_model, kv_model, tokens, points, windows=args.windows, window_len=args.window_len,
                        context=args.context, steps=args.steps)
    command = getattr(args, "command_line", None) or "ortsparse sweep"
    png = None if plot_note else args.output + ".png"
    title = f"KwtaBlockMatMul on {full_path.parent.name}: {args.windows}x{args.window_len} tokens, decode ctx {args.context}"
    payload = json.dumps(dict(machine=machine_info(), command=command, results=results, plot=plot_note), indent=1)
    text = markdown(results, command, png, plot_note)
    files = {args.output + ".json": ("JSON report", lambda staged: staged.write_text(payload, encoding="utf-8")),
             args.output + ".md": ("markdown report", lambda staged: staged.write_text(text, encoding="utf-8"))}
    if png:
        files[png] = ("plot", lambda staged: plot(results, staged, title))
    write_files(files, inputs, create_dirs=True)  # together
    print("wrote", *files)
    return 0
