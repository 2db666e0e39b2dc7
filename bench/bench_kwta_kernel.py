"""KwtaBlockMatMul vs ORT's MatMul on the same shapes, same process, alternating A B A B, medians.

Each session holds `copies` parallel nodes on one input so Python's per-Run overhead is amortised:
- in-cache: the copies share one weight (it stays in L2/L3 between nodes);
- out-of-cache: the copies have distinct weights whose total exceeds the L3 (DRAM streaming, as in
  a real decode step).
Reports per-layer time, ratio ORT/ours, and for M = 1 the achieved GB/s of kept weight bytes.

usage: python bench/bench_kwta_kernel.py [--quick] [--threads 1 2] [-o reports/kwta_kernel]
"""
from __future__ import annotations

import math
import sys

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from ortsparse.benchmarking import (command_line, kernel_bench_parser, kernel_bench_repeats, kernel_bench_shapes,
                                    machine_info, median, read_bandwidth_gbs, report_header, session, time_sessions,
                                    write_report)

SHAPES = [(576, 1536), (1536, 576), (4096, 11008)]
SETTINGS = [  # (keep ratio, block)
    (1.0, 1), (0.75, 1), (0.5, 1), (0.25, 1), (0.5, 32), (0.25, 32),
]
OUT_OF_CACHE_BYTES = 96 * 1024 * 1024  # 3x the 32 MiB L3


def build(k, n, copies, distinct, op, rng, **attrs):
    weights = [rng.standard_normal((k, n)).astype(np.float32) * 0.05 for _ in range(copies if distinct else 1)]
    inits = [numpy_helper.from_array(w, f"W{i}") for i, w in enumerate(weights)]
    nodes, outputs = [], []
    for c in range(copies):
        wname = f"W{c if distinct else 0}"
        if op == "MatMul":
            nodes.append(helper.make_node("MatMul", ["X", wname], [f"Y{c}"], name=f"mm{c}"))
        else:
            nodes.append(helper.make_node("KwtaBlockMatMul", ["X", wname], [f"Y{c}"], name=f"kw{c}",
                                          domain="ai.ortsparse", **attrs))
        outputs.append(helper.make_tensor_value_info(f"Y{c}", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "bench", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["m", k])],
                              outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.ortsparse", 1)])


def run_case(k, n, m, regime, threads, settings, repeats, rng):
    layer_bytes = k * n * 4
    if regime == "out-of-cache":
        copies = max(1, math.ceil(OUT_OF_CACHE_BYTES / layer_bytes))
        distinct = True
    else:
        if layer_bytes > 24 * 1024 * 1024:
            return []  # does not fit the L3: no in-cache regime for this shape
        copies, distinct = 8, False
    x = rng.standard_normal((m, k)).astype(np.float32)
    feeds = {"X": x}
    sessions = {"ort_matmul": session(build(k, n, copies, distinct, "MatMul", np.random.default_rng(0)), threads)}
    for keep, block in settings:
        attrs = dict(k_frac=float(keep), block=int(block))
        sessions[f"kwta_{keep}_b{block}"] = session(
            build(k, n, copies, distinct, "Kwta", np.random.default_rng(0), **attrs), threads)
    times = time_sessions(sessions, feeds, repeats=repeats, warmup=2)
    base = median(times["ort_matmul"]) / copies
    rows = []
    for keep, block in settings:
        name = f"kwta_{keep}_b{block}"
        t = median(times[name]) / copies
        row = dict(k=k, n=n, m=m, regime=regime, threads=threads, keep=keep, block=block, copies=copies,
                   ort_us=base * 1e6, ours_us=t * 1e6, speedup=base / t, target=(0.95 if keep == 1.0 else 0.85 / keep))
        if m == 1:
            row["ours_gbs"] = keep * layer_bytes / t / 1e9
            row["ort_gbs"] = layer_bytes / base / 1e9
        rows.append(row)
    return rows


def markdown(rows, info, bandwidth, command):
    lines = report_header("KwtaBlockMatMul vs ORT MatMul (kernel level)", command, info, bandwidth)
    lines += ["Per-layer medians; speedup = ORT time / ours (>1 is faster). 2 threads run with "
              "allow_spinning=0. GB/s = kept weight bytes / time (M = 1).", "",
              "| K x N | M | regime | thr | keep | block | ORT us | ours us | speedup | target | ours GB/s |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        gbs = f"{r['ours_gbs']:.1f}" if "ours_gbs" in r else ""
        lines.append(f"| {r['k']}x{r['n']} | {r['m']} | {r['regime']} | {r['threads']} | {r['keep']} | {r['block']} | "
                     f"{r['ort_us']:.1f} | {r['ours_us']:.1f} | {r['speedup']:.2f} | {r['target']:.2f} | {gbs} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = kernel_bench_parser(__doc__.splitlines()[0], "reports/kwta_kernel", "fewer shapes and repeats (smoke run)")
    args = parser.parse_args(argv)
    shapes = kernel_bench_shapes(args, SHAPES)
    if args.quick:
        shapes = shapes[:1]
    rng = np.random.default_rng(0)
    info = machine_info()
    bandwidth = read_bandwidth_gbs()
    rows = []
    for threads in args.threads:
        for k, n in shapes:
            for m in args.ms:
                for regime in ("in-cache", "out-of-cache"):
                    repeats = kernel_bench_repeats(args, k, n, m, quick=5)
                    new = run_case(k, n, m, regime, threads, SETTINGS, repeats, rng)
                    for r in new:
                        print(f"{k}x{n} M={m} {regime} thr={threads} keep={r['keep']} block={r['block']}: "
                              f"ORT {r['ort_us']:.1f}us ours {r['ours_us']:.1f}us x{r['speedup']:.2f}", flush=True)
                    rows.extend(new)
    command = command_line("python bench/bench_kwta_kernel.py", argv)
    payload = dict(machine=info, bandwidth=bandwidth, command=command, rows=rows)
    paths = write_report(args.output, payload, markdown(rows, info, bandwidth, command))
    print("wrote", *paths)
    return 0


if __name__ == "__main__":
    sys.exit(main())
