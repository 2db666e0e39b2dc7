"""The scaling curve (docs/measure.md "Speed"): decode tokens/s of onnxruntime-genai models against the
same models with every linear layer (the head included) on KwtaBlockMatMul at a fixed keep fraction
(no calibration: the shape models carry random weights, quality is not the point), through the
Generator, per keep, context, thread count and ORT pool mode, each ratio the worst of the rounds beside
the bound the bytes read allow.

Per model, the keeps are rewritten once (rewrite-onnx `--kwta=on --kwta-target all --kwta-k KEEP`) and
every variant runs in one `ortsparse bench` per pool mode (models alternating inside each round, the
bench's protocol). The bound of a variant is the input's bytes per decode step over its own: linear-layer
weights (a gated layer's quantized rows times the keep; its scales and zero points whole, since a block's
scales are read when any of its rows is kept) plus the KV cache the step reads (from the bench rows).

usage: python bench/scaling_curve.py qwen0.5b-int8=DIR [NAME=DIR ...] --keeps 1.0 0.75 0.6 0.5 \
         --contexts 128 2048 --threads 1 2 --pools off default --rounds 3 -o reports/scaling_curve
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence

from ortsparse.benchmarking import check_report, command_line, machine_info, report_header, write_report
from ortsparse.graph_rewrite.genai import rewrite_genai_folder
from ortsparse.measure.speed import weight_table
from ortsparse.rewrite_flags import add_technique_arguments, config_from_args
from ortsparse.runtime import genai_decoder

POOLS = {"off": "allow_spinning=0", "default": "ORT's default pool (spinning)"}


def keep_label(keep: float) -> str:
    return f"keep{keep:g}"


def gated_config(keep: float):
    """The RewriteConfig of every linear layer on KwtaBlockMatMul keeping ``keep`` of its rows."""
    parser = argparse.ArgumentParser(prog="scaling_curve", exit_on_error=False)
    add_technique_arguments(parser)
    return config_from_args(parser.parse_args(["--kwta=on", "--kwta-target", "all", "--kwta-k", f"{keep:g}"]))


def weight_bytes(folder: str | Path, keep: float | None) -> float:
    """Linear-layer weight bytes one decode step reads in the genai folder: every gated node's
    quantized rows times ``keep`` (None: the input, nothing gated)."""
    table = weight_table(genai_decoder(folder).model_file)
    return table.bytes({name: keep for name in table.gated} if keep is not None else None)


def bench_command(variants: Mapping[str, Path], args: argparse.Namespace, pool: str, stem: Path) -> list[str]:
    threads = [t for t in args.threads if pool == "off" or t > 1]
    command = ["ortsparse", "bench", *(f"{name}={path}" for name, path in variants.items()), "--runners", "og",
               "--contexts", *map(str, args.contexts), "--threads", *map(str, threads), "--rounds", str(args.rounds),
               "--steps", str(args.steps), "-o", str(stem)]
    return command + (["--spinning"] if pool == "default" else [])


def curve_rows(model: str, bench: Mapping[str, Any], bytes_of: Mapping[str, float], keeps: Mapping[str, float],
               pool: str) -> list[dict]:
    """One row per (threads, context, keep) of a bench report: the ratio's worst round and median, and
    the bytes-read bound of the ratio (KV bytes from the bench rows, weights from ``bytes_of``)."""
    kv = {(r["threads"], r["context"], r["model"]): 1e6 * (r["kv_mb"] + r["kv_copy_mb"]) for r in bench["rows"]}
    base = {(r["threads"], r["context"]): r["tokens_per_s"] for r in bench["ratios"] if r["model"] == "input"}
    rows = []
    for ratio in bench["ratios"]:
        if ratio["model"] == "input":
            continue
        at = (ratio["threads"], ratio["context"])
        bound = (bytes_of["input"] + kv[(*at, "input")]) / (bytes_of[ratio["model"]] + kv[(*at, ratio["model"])])
        worst, median = ratio["speedup"]["min"], ratio["speedup"]["median"]
        rows.append(dict(model=model, pool=pool, threads=at[0], context=at[1], keep=keeps[ratio["model"]],
                         input_tokens_per_s=base[at]["median"], worst=worst, median=median,
                         rounds=ratio["speedup"]["rounds"], bound=bound, worst_over_bound=worst / bound))
    return rows


def measure_model(model: str, folder: Path, args: argparse.Namespace, workdir: Path) -> list[dict]:
    keeps = {keep_label(k): k for k in args.keeps}
    variants = {"input": folder}
    for label, keep in keeps.items():
        print(f"{model}: rewriting {label} ...", flush=True)
        variants[label] = rewrite_genai_folder(folder, workdir / f"{model}-{label}", gated_config(keep)).folder
    bytes_of = {"input": weight_bytes(folder, None), **{label: weight_bytes(variants[label], keep)
                                                         for label, keep in keeps.items()}}
    rows = []
    for pool in args.pools:
        if pool == "default" and not any(t > 1 for t in args.threads):
            continue
        stem = workdir / f"{model}-{pool}"
        command = bench_command(variants, args, pool, stem)
        print("  $ " + " ".join(command), flush=True)
        subprocess.run(command, check=True)
        rows += curve_rows(model, json.loads(stem.with_suffix(".json").read_text()), bytes_of, keeps, pool)
    return rows


def markdown(rows: Sequence[dict], command: str, info: Mapping[str, Any]) -> str:
    lines = report_header("Scaling curve: every linear layer gated at a fixed keep", command, info)
    lines += ["Decode through the Generator (text: Python's documentation), each ratio the worst of the rounds "
              "(median beside it) against the input in the same bench; bound: the input's bytes per step over "
              "the variant's (weights, scales whole, KV cache).", "",
              "| model | threads | pool | context | input tok/s (median) | keep | ratio, worst (median) | bytes bound "
              "| worst / bound |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['threads']} | {POOLS[r['pool']]} | {r['context']} | "
                     f"{r['input_tokens_per_s']:.1f} | {r['keep']:g} | **{r['worst']:.2f}x** ({r['median']:.2f}x) | "
                     f"{r['bound']:.2f}x | {r['worst_over_bound']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", metavar="NAME=DIR", help="onnxruntime-genai folders (int8 / int4)")
    parser.add_argument("--keeps", type=float, nargs="+", default=[1.0, 0.75, 0.6, 0.5])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 2048])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--pools", nargs="+", choices=sorted(POOLS), default=["off", "default"],
                        help="off: allow_spinning=0 (bench's default); default: ORT's spinning pool (threads > 1)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("-o", "--output", required=True, metavar="STEM")
    args = parser.parse_args(argv)
    models = {}
    for spec in args.models:
        name, sep, path = spec.partition("=")
        if not sep or not name or not Path(path).is_dir():
            parser.error(f"{spec!r}: give NAME=DIR, DIR an onnxruntime-genai folder")
        models[name] = Path(path)
    if any(not 0 < keep <= 1 for keep in args.keeps):
        parser.error(f"--keeps {args.keeps}: each in (0, 1]")
    check_report(args.output)
    command, info, rows = command_line("python bench/scaling_curve.py", argv), machine_info(), []
    for name, folder in models.items():
        with tempfile.TemporaryDirectory(prefix="ortsparse-scaling-") as workdir:
            rows += measure_model(name, folder, args, Path(workdir))
        # Rewritten after each model: a long run keeps what it measured.
        write_report(args.output, {"machine": info, "command": command, "rows": rows}, markdown(rows, command, info))
    print(markdown(rows, command, info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
