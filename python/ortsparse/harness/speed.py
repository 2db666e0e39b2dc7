"""End-to-end speed: prefill and decode tokens/s, dense vs rewritten vs ORT's int4/int8
MatMulNBits, same process, alternating, medians (measure.md "Speed").

- decode: a KV-cache export, one new token per Run at a fixed context length (past K/V of that
  length are fed every step; their values do not change the cost);
- prefill: a full-sequence export (or the KV export with an empty past) on a prompt of P tokens.
The machine's read bandwidth is measured in the same report, with the bandwidth-bound tokens/s
(weight bytes a decode step must read / bandwidth) beside the achieved ones.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper

from .._library import metrics, reset_metrics
from ..benchmarking import (check_report, machine_info, median, read_bandwidth_gbs, report_header, session, time_sessions,
                            write_report)
from ..graph_rewrite import rewrite_model
from ..graph_rewrite.techniques import TECHNIQUES
from ..rewrite_flags import add_technique_arguments, config_from_args
from ..runtime import decode_feeds, load_proto, vocab_size
from .models import model_path, quantized_model
from .op_metrics import keep_ratios

LINEAR_OPS = {"MatMul", "Gemm", "KwtaBlockMatMul", "MatMulNBits"}


@dataclass
class SpeedModel:
    """One model under test: a name, its (KV or full) ONNX path or proto."""

    name: str
    source: Any
    kind: str  # "kv" or "full"
    sessions: dict = field(default_factory=dict)


def weight_bytes_per_token(source, keep_ratio_by_node: dict[str, float] | None = None) -> float:
    """Bytes of linear-layer weights one decode step reads: every constant weight of a MatMul /
    Gemm / KwtaBlockMatMul / MatMulNBits (scales and packed int4/int8 included), the gated ones
    times their measured keep ratio."""
    proto = load_proto(source)
    sizes = {}
    for init in proto.graph.initializer:
        count = int(np.prod(init.dims)) if len(init.dims) else 1
        itemsize = np.dtype(helper.tensor_dtype_to_np_dtype(init.data_type)).itemsize
        sizes[init.name] = count * itemsize
    total = 0.0
    seen: set[str] = set()
    for node in proto.graph.node:
        if node.op_type not in LINEAR_OPS:
            continue
        keep = (keep_ratio_by_node or {}).get(node.name, 1.0) if node.op_type == "KwtaBlockMatMul" else 1.0
        for name in node.input[1:]:
            if name in sizes and (name, node.name) not in seen:
                seen.add((name, node.name))
                total += sizes[name] * (keep if name == node.input[1] else 1.0)
    return total


def time_models(models: list[SpeedModel], feeds_by_kind: dict[str, dict], threads: int, repeats: int,
                tokens_per_run: int) -> dict[str, dict]:
    """Alternates Run calls of every model (feeds by the model's kind); returns per model median
    seconds and tokens/s, and under ``_metrics`` the op counters of those runs."""
    sessions = {m.name: session(m.source, threads) for m in models}
    reset_metrics()
    times = time_sessions(sessions, {m.name: feeds_by_kind[m.kind] for m in models}, repeats=repeats, warmup=2,
                          per_session=True)
    snapshot = metrics()
    out = {}
    for m in models:
        seconds = median(times[m.name])
        out[m.name] = {"median_s": seconds, "tokens_per_s": tokens_per_run / seconds, "runs": len(times[m.name])}
    out["_metrics"] = snapshot
    return out


def bench(kv: dict[str, Any], full: dict[str, Any] | None, *, contexts=(128, 1024), prompt_len: int = 128,
          threads=(1, 2), repeats: int = 15, log=print) -> dict:
    """kv / full: name -> model (path or proto); the names are the compared variants, the first
    being the reference (dense). Returns the report payload."""
    bandwidth = read_bandwidth_gbs()
    vocab = vocab_size(next(iter(kv.values())))
    rows = []
    for n_threads in threads:
        for context in contexts:
            models = [SpeedModel(name, src, "kv") for name, src in kv.items()]
            feeds = {"kv": decode_feeds(models[0].source, new_tokens=1, past=context, vocab=vocab)}
            result = time_models(models, feeds, n_threads, repeats, tokens_per_run=1)
            ratios = keep_ratios(result.pop("_metrics"))
            base = result[models[0].name]["tokens_per_s"]
            for m in models:
                r = result[m.name]
                weight_bytes = weight_bytes_per_token(m.source, ratios)
                bound = bandwidth["numpy_matvec_gbs"] * 1e9 / weight_bytes
                rows.append(dict(phase="decode", context=context, threads=n_threads, model=m.name,
                                 tokens_per_s=r["tokens_per_s"], speedup=r["tokens_per_s"] / base,
                                 weight_mb_per_token=weight_bytes / 1e6, bound_tokens_per_s=bound,
                                 achieved_over_bound=r["tokens_per_s"] / bound))
                log(f"decode ctx={context} threads={n_threads} {m.name}: {r['tokens_per_s']:.1f} tok/s "
                    f"(x{r['tokens_per_s'] / base:.2f}, bound {bound:.0f})")
        prefill_sources = full if full else kv
        models = [SpeedModel(name, src, "prefill") for name, src in prefill_sources.items()]
        feeds = {"prefill": decode_feeds(models[0].source, new_tokens=prompt_len, past=0, vocab=vocab)}
        result = time_models(models, feeds, n_threads, max(5, repeats // 3), tokens_per_run=prompt_len)
        result.pop("_metrics")
        base = result[models[0].name]["tokens_per_s"]
        for m in models:
            r = result[m.name]
            rows.append(dict(phase="prefill", context=prompt_len, threads=n_threads, model=m.name,
                             tokens_per_s=r["tokens_per_s"], speedup=r["tokens_per_s"] / base))
            log(f"prefill {prompt_len} threads={n_threads} {m.name}: {r['tokens_per_s']:.1f} tok/s "
                f"(x{r['tokens_per_s'] / base:.2f})")
    return dict(machine=machine_info(), bandwidth=bandwidth, rows=rows)


def markdown(payload: dict, command: str, title: str) -> str:
    lines = report_header(title, command, payload["machine"], payload["bandwidth"],
                          matvec_note="numpy matvec; used for the bound")
    lines += ["Medians of alternated runs; speedup vs the first model; 2 threads with allow_spinning=0. "
              "Bound = read bandwidth / linear-weight bytes per token (kept bytes for gated layers).", "",
              "| phase | context | threads | model | tokens/s | speedup | weight MB/token | bound tok/s | achieved/bound |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in payload["rows"]:
        extra = (f"{r['weight_mb_per_token']:.1f} | {r['bound_tokens_per_s']:.0f} | {r['achieved_over_bound']:.2f}"
                 if r["phase"] == "decode" else " | | ")
        lines.append(f"| {r['phase']} | {r['context']} | {r['threads']} | {r['model']} | {r['tokens_per_s']:.1f} | "
                     f"{r['speedup']:.2f} | {extra} |")
    return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kv", metavar="KV.onnx", help="KV-cache decode export (default: the cached SmolLM2 one)")
    parser.add_argument("--full", metavar="FULL.onnx", help="full-sequence export for prefill (default: cached SmolLM2)")
    parser.add_argument("--baselines", nargs="*", default=["int4", "int8"], choices=["int4", "int8"],
                        help="MatMulNBits baselines to include (default int4 int8)")
    parser.add_argument("--baseline-accuracy-level", type=int, default=4, choices=[0, 1, 2, 3, 4],
                        help="MatMulNBits accuracy_level of the baselines (default 4: int8 compute, ORT's fast "
                             "CPU path; 0 = ORT's default, fp32 compute)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--prompt", type=int, default=128, help="prefill prompt length (default 128)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("-o", "--output", default="reports/bench", help="report stem (.json and .md)")
    add_technique_arguments(parser)


def _default_paths(args) -> tuple[Path, Path | None]:
    if args.kv:
        return Path(args.kv), Path(args.full) if args.full else None
    return model_path("smollm2", "kv.torchscript"), (Path(args.full) if args.full
                                                      else model_path("smollm2", "full.torchscript"))


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    kv_path, full_path = _default_paths(args)
    inputs = [kv_path, full_path, args.config]  # never overwritten by the report
    check_report(args.output, inputs)
    config = config_from_args(args)
    kv_dense = onnx.load(str(kv_path))
    kv_models: dict[str, Any] = {"dense": kv_dense}
    full_models: dict[str, Any] | None = {"dense": onnx.load(str(full_path))} if full_path else None
    attention_on = getattr(config, "attention", None) is not None
    if args.config or attention_on or any(config.choice(name).enabled for name in TECHNIQUES):
        kv_models["ortsparse"], report = rewrite_model(kv_dense, config)
        print(report.summary())
        if full_models is not None:
            full_models["ortsparse"], _ = rewrite_model(full_models["dense"], config)
    for bits in args.baselines:
        level = args.baseline_accuracy_level or None
        kv_models[bits] = quantized_model(kv_path, bits=int(bits[3:]), accuracy_level=level)
        if full_models is not None:
            full_models[bits] = quantized_model(full_path, bits=int(bits[3:]), accuracy_level=level)
    payload = bench(kv_models, full_models, contexts=args.contexts, prompt_len=args.prompt,
                    threads=args.threads, repeats=args.repeats)
    command = "ortsparse bench " + " ".join(sys.argv[2:]) if len(sys.argv) > 1 else "ortsparse bench"
    payload["command"] = command
    kwta = config.choice("kwta")
    payload["config"] = {"kwta": dataclasses.asdict(kwta.settings), "kwta_enabled": config.switched_on("kwta"),
                         "target": kwta.target, "override_file": args.config,
                         "techniques": {name: dataclasses.asdict(choice) for name, choice in config.techniques.items()}}
    paths = write_report(args.output, payload, markdown(payload, command, f"End-to-end speed: {kv_path.name}"),
                         protected=inputs)
    print("wrote", *paths)
    return 0
