"""Prompt (prefill) speed of one attention node: PopcountGroupQueryAttention against onnxruntime's
com.microsoft.GroupQueryAttention, SmolLM2-135M's shape (9 query heads, 3 KV heads, head dim 64),
one first-prompt call as onnxruntime-genai makes it (packed QKV, rotary, one KV buffer bound as past
and present), in one process.

Per thread count and prompt length: both sessions are warmed up, then every round times --repeats
calls of each, alternated call by call (A B A B ...); a round's ratio is the median onnxruntime time
over the median PopcountGroupQueryAttention time (> 1: ours is faster). Reported: the minimum and
median ratio over --rounds rounds, and the median times. Two threads run with allow_spinning off
(ortsparse.runtime.thread_options). Each --variants entry is one more PopcountGroupQueryAttention
configuration (attributes a=b,c=d), timed in the same alternation; --selective adds the selective
prefill variants (SELECTIVE: prefill_select=certified / budget on the page selector), and the report
gives each variant's fraction of (query block, key tile) pairs skipped (metric prefill.skipped_ratio)
and its error against GroupQueryAttention. The prompt is random (rotary applied): its attention is
flat, so certified skips little here and budget's error is larger than on a real model's Q/K.

usage: python bench/bench_prefill.py -o reports/bench_prefill      (~5 min on a quiet 2-core machine)
       python bench/bench_prefill.py --quick -o /tmp/bench_prefill  (smoke: 512 and 1024, 1 thread)
       python bench/bench_prefill.py --lengths 4096 8192 --threads 1 --selective -o /tmp/bench_selective
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

import ortsparse
from ortsparse.benchmarking import (check_report, command_line, machine_info, op_attributes, report_header,
                                    write_report)
from ortsparse.runtime import open_session, thread_options

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.ops import gqa_graphs as G  # noqa: E402  (the one-node graphs the op tests use)

HEADS, KV_HEADS, HEAD_SIZE = 9, 3, 64
# Selective prefill beside the exact page-selector setting (docs/ops.md, "Selective prefill").
SELECTIVE = ["select=pages,prefill_select=certified,prefill_eps=0.001",
             "select=pages,prefill_select=budget,prefill_budget=1024"]


def attributes(text: str) -> dict:
    """'select=pages,topk=256' -> {'select': 'pages', 'topk': 256} (ortsparse.benchmarking.op_attributes)."""
    try:
        return op_attributes(text)
    except ValueError as error:
        raise SystemExit(f"bench_prefill: --variants entry {error}") from None


class Prompt:
    """One session and its bound first-prompt call of `length` tokens (the KV buffer holds exactly
    the prompt, as a genai buffer sized to it)."""

    def __init__(self, cfg: G.Gqa, length: int, threads: int, ours: bool, attrs: dict, seed: int = 0,
                 node_name: str = "gqa"):
        rng = np.random.default_rng(seed)
        self.session = open_session(G.model(cfg, ours=ours, node_name=node_name, **attrs), thread_options(threads))
        cos, sin = G.rotary_tables(rng, length, cfg.half)
        width = cfg.hidden + 2 * cfg.kv_hidden
        self.feeds = {"query": rng.standard_normal((1, length, width), dtype=np.float32),
                      "seqlens_k": np.array([length - 1], np.int32),
                      "total_sequence_length": np.array([length], np.int32), "cos_cache": cos, "sin_cache": sin}
        self.k = ort.OrtValue.ortvalue_from_numpy(np.zeros((1, cfg.kv_num_heads, length, cfg.head_size), np.float32))
        self.v = ort.OrtValue.ortvalue_from_numpy(np.zeros((1, cfg.kv_num_heads, length, cfg.head_size), np.float32))
        self.binding = self.session.io_binding()
        for name, value in self.feeds.items():
            self.binding.bind_cpu_input(name, value)
        self.binding.bind_ortvalue_input("past_key", self.k)
        self.binding.bind_ortvalue_input("past_value", self.v)
        self.binding.bind_output("output")
        self.binding.bind_ortvalue_output("present_key", self.k)
        self.binding.bind_ortvalue_output("present_value", self.v)

    def __call__(self) -> tuple[float, float]:
        """(wall seconds, CPU seconds of the process: all its threads, spinning included)."""
        t0, c0 = time.perf_counter(), time.process_time()
        self.session.run_with_iobinding(self.binding)
        return time.perf_counter() - t0, time.process_time() - c0

    def output(self) -> np.ndarray:
        return self.binding.copy_outputs_to_cpu()[0]


def bench_case(length: int, threads: int, variants: list[str], rounds: int, repeats: int, log=print) -> dict:
    cfg = G.Gqa(num_heads=HEADS, kv_num_heads=KV_HEADS, head_size=HEAD_SIZE, packed=True, rotary=True)
    runs = {"GroupQueryAttention": Prompt(cfg, length, threads, ours=False, attrs={})}
    nodes = {v: f"bench_prefill_{length}_{threads}_{i}" for i, v in enumerate(variants)}
    for v in variants:
        runs[v] = Prompt(cfg, length, threads, ours=True, attrs=attributes(v), node_name=nodes[v])
    for run in runs.values():  # warm-up (first-call allocations), and the outputs agree
        run()
    reference = runs["GroupQueryAttention"].output()
    errors = {v: float(np.abs(runs[v].output() - reference).max() / np.abs(reference).max()) for v in variants}
    per_round, cpu_round = [], []
    for _ in range(rounds):
        times = {name: [] for name in runs}
        cpu = {name: [] for name in runs}
        for _ in range(repeats):
            for name, run in runs.items():
                wall, used = run()
                times[name].append(wall)
                cpu[name].append(used)
        per_round.append({name: statistics.median(t) for name, t in times.items()})
        cpu_round.append({name: statistics.median(t) for name, t in cpu.items()})
    skipped = {v: ortsparse.metrics().get(f"PopcountGroupQueryAttention/{nodes[v]}", {}).get("prefill.skipped_ratio", 0.0)
               for v in variants}
    ort_name = "GroupQueryAttention"
    row = {"length": length, "threads": threads, "rounds": rounds, "repeats": repeats,
           "ort_ms": 1e3 * statistics.median(r[ort_name] for r in per_round),
           "ort_cpu_ms": 1e3 * statistics.median(r[ort_name] for r in cpu_round), "variants": {}}
    for v in variants:
        ratios = [r[ort_name] / r[v] for r in per_round]
        cpu_ratios = [r[ort_name] / r[v] for r in cpu_round]
        row["variants"][v] = {"ms": 1e3 * statistics.median(r[v] for r in per_round), "ratio_min": min(ratios),
                              "ratio_median": statistics.median(ratios), "ratios": ratios,
                              "cpu_ms": 1e3 * statistics.median(r[v] for r in cpu_round),
                              "cpu_ratio_min": min(cpu_ratios), "cpu_ratio_median": statistics.median(cpu_ratios),
                              "max_error_of_scale": errors[v], "tiles_skipped": skipped[v]}
        log(f"prompt {length:5d}, {threads} thread(s): GroupQueryAttention {row['ort_ms']:8.1f} ms, {v} "
            f"{row['variants'][v]['ms']:8.1f} ms, speed ratio min {min(ratios):.2f} median "
            f"{row['variants'][v]['ratio_median']:.2f}; CPU time ratio min {min(cpu_ratios):.2f} median "
            f"{row['variants'][v]['cpu_ratio_median']:.2f} (error {errors[v]:.1e} of scale, tiles skipped "
            f"{skipped[v]:.1%})", flush=True)
    return row


def markdown(payload: dict) -> str:
    lines = report_header("Prompt (prefill) attention: PopcountGroupQueryAttention vs GroupQueryAttention",
                          payload["command"], payload["machine"])
    lines += [f"One first-prompt call of a SmolLM2-135M attention node ({HEADS} query heads, {KV_HEADS} KV heads, "
              f"head dim {HEAD_SIZE}; packed QKV, rotary, KV buffer bound as past and present), sessions "
              "alternated call by call in one process. Ratio: GroupQueryAttention time / ours per round "
              "(> 1: ours faster), minimum and median over rounds; times are medians. CPU: the same from the "
              "process's CPU time (all threads) instead of wall time — what a loaded machine distorts less.", ""]
    if payload.get("note"):
        lines += [payload["note"], ""]
    lines += ["| variant | threads | prompt | GroupQueryAttention ms | ours ms | ratio min | ratio median | "
              "CPU ratio min | CPU ratio median | max error | tiles skipped |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in payload["rows"]:
        for v, r in row["variants"].items():
            lines.append(f"| {v} | {row['threads']} | {row['length']} | {row['ort_ms']:.1f} | {r['ms']:.1f} | "
                         f"{r['ratio_min']:.2f} | {r['ratio_median']:.2f} | {r['cpu_ratio_min']:.2f} | "
                         f"{r['cpu_ratio_median']:.2f} | {r['max_error_of_scale']:.1e} | "
                         f"{r.get('tiles_skipped', 0.0):.1%} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 4096, 8192])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--variants", nargs="+", default=["select=none"],
                        help="PopcountGroupQueryAttention attribute sets (default: select=none, the exact op)")
    parser.add_argument("--selective", action="store_true",
                        help="also time the selective prefill variants: " + " ".join(SELECTIVE))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="calls per session per round")
    parser.add_argument("--note", default="", help="a line for the report (e.g. 'machine shared with builds')")
    parser.add_argument("--quick", action="store_true", help="smoke run: prompts 512 1024, 1 thread, 2 rounds of 1")
    parser.add_argument("-o", "--output", default="reports/bench_prefill", help="report stem: writes .json and .md")
    args = parser.parse_args(argv)
    if args.quick:
        args.lengths, args.threads, args.rounds, args.repeats = [512, 1024], [1], 2, 1
    bad = [n for n in args.lengths + args.threads + [args.rounds, args.repeats] if n < 1]
    if bad:
        print(f"bench_prefill: --lengths, --threads, --rounds and --repeats must be >= 1, got {bad[0]}",
              file=sys.stderr)
        return 2
    if args.selective:
        args.variants = list(args.variants) + [v for v in SELECTIVE if v not in args.variants]
    for v in args.variants:
        attributes(v)
    check_report(args.output)
    started = time.perf_counter()
    command = command_line("python bench/bench_prefill.py", argv if argv is not None else sys.argv[1:])
    payload = {"command": command, "machine": machine_info(), "note": args.note, "rows": []}
    for threads in args.threads:
        for length in args.lengths:
            payload["rows"].append(bench_case(length, threads, args.variants, args.rounds, args.repeats))
    payload["seconds"] = round(time.perf_counter() - started)
    paths = write_report(args.output, payload, markdown(payload))
    print("wrote", *paths, f"({payload['seconds']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
