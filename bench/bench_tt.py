"""TTMatMul vs ORT's MatMul on the same shapes, same process, alternating A B A B, medians; each
speedup is set against the FLOP ratio (dense multiply-adds / TT multiply-adds per token). The
target is speedup >= 0.7 x FLOP ratio.

Cores are random (speed does not depend on their values); layouts: ``lowrank`` (d = 2,
W = U V, in_modes [K, 1], out_modes [1, N]) at several ranks, and ``balanced`` d = 3 TT-matrices.
Each session holds `copies` parallel nodes on one input so Python's per-Run overhead is amortised:
- in-cache: the copies share one weight (it stays in L2/L3 between nodes);
- out-of-cache: the copies have distinct weights; the dense copies total > 3x the 32 MiB L3 (DRAM
  streaming, as in a real decode step). TT copies are distinct too (their cores are small: that
  they fit in cache where W does not is part of TT's point).

usage: python bench/bench_tt.py [--quick] [--threads 1 2] [--ms 1 128] [-o reports/tt_kernel]
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

from ortsparse import tt  # noqa: E402
from ortsparse.benchmarking import (command_line, kernel_bench_parser, kernel_bench_repeats,  # noqa: E402
                                    kernel_bench_shapes, machine_info, median, read_bandwidth_gbs, report_header,
                                    session, time_sessions, write_report)

SHAPES = [(576, 1536), (1536, 576), (4096, 11008)]
LOWRANK_RANKS = [16, 32, 64, 128, 256]
BALANCED_RANKS = [4, 8, 16, 32]
OUT_OF_CACHE_BYTES = 96 * 1024 * 1024  # 3x the 32 MiB L3
TARGET_EFFICIENCY = 0.7


def configs(k: int, n: int, quick: bool) -> list[tuple[str, list[int], list[int], list[int]]]:
    out = []
    for r in (LOWRANK_RANKS[1:3] if quick else LOWRANK_RANKS):
        if r < min(k, n):
            out.append((f"lowrank r={r}", [k, 1], [1, n], [1, r, 1]))
    in3, out3 = tt.choose_modes(k, n, 3, "balanced")
    for r in (BALANCED_RANKS[1:2] if quick else BALANCED_RANKS):
        ranks = tt.uniform_ranks(3, r, in3, out3)
        out.append((f"tt3 {in3}x{out3} r={r}", in3, out3, ranks))
    return out


def build(k, n, copies, distinct, rng, tt_shape=None):
    """copies parallel nodes X -> Y_c: MatMul with W, or TTMatMul with random cores."""
    inits, nodes, outputs = [], [], []
    for c in range(copies if distinct else 1):
        if tt_shape is None:
            inits.append(numpy_helper.from_array(rng.standard_normal((k, n)).astype(np.float32) * 0.05, f"W{c}"))
        else:
            in_modes, out_modes, ranks = tt_shape
            cores = [(rng.standard_normal((ranks[t], a, b, ranks[t + 1])) / math.sqrt(ranks[t] * a)).astype(np.float32)
                     for t, (a, b) in enumerate(zip(in_modes, out_modes))]
            inits.append(numpy_helper.from_array(tt.concat_cores(cores), f"W{c}"))
    for c in range(copies):
        wname = f"W{c if distinct else 0}"
        if tt_shape is None:
            nodes.append(helper.make_node("MatMul", ["X", wname], [f"Y{c}"], name=f"mm{c}"))
        else:
            in_modes, out_modes, ranks = tt_shape
            nodes.append(helper.make_node("TTMatMul", ["X", wname], [f"Y{c}"], name=f"tt{c}", domain="ai.ortsparse",
                                          in_modes=in_modes, out_modes=out_modes, ranks=ranks))
        outputs.append(helper.make_tensor_value_info(f"Y{c}", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "bench", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["m", k])],
                              outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.ortsparse", 1)])


def run_case(k, n, m, regime, threads, cases, repeats, rng):
    layer_bytes = k * n * 4
    if regime == "out-of-cache":
        copies, distinct = max(1, math.ceil(OUT_OF_CACHE_BYTES / layer_bytes)), True
    else:
        if layer_bytes > 24 * 1024 * 1024:
            return []  # W does not fit the L3: no in-cache regime for this shape
        copies, distinct = 8, False
    feeds = {"X": rng.standard_normal((m, k)).astype(np.float32)}
    sessions = {"ort_matmul": session(build(k, n, copies, distinct, np.random.default_rng(0)), threads)}
    for label, in_modes, out_modes, ranks in cases:
        sessions[label] = session(build(k, n, copies, distinct, np.random.default_rng(1),
                                        (in_modes, out_modes, ranks)), threads)
    times = time_sessions(sessions, feeds, repeats=repeats, warmup=2)
    base = median(times["ort_matmul"]) / copies
    rows = []
    for label, in_modes, out_modes, ranks in cases:
        t = median(times[label]) / copies
        flop_ratio = k * n / tt.tt_macs(in_modes, out_modes, ranks)
        speedup = base / t
        rows.append(dict(k=k, n=n, m=m, regime=regime, threads=threads, config=label, in_modes=in_modes,
                         out_modes=out_modes, ranks=ranks, copies=copies, ort_us=base * 1e6, tt_us=t * 1e6,
                         speedup=speedup, flop_ratio=flop_ratio, efficiency=speedup / flop_ratio,
                         meets_target=speedup >= TARGET_EFFICIENCY * flop_ratio,
                         mem_ratio=sum(ranks[i] * a * b * ranks[i + 1]
                                       for i, (a, b) in enumerate(zip(in_modes, out_modes))) / (k * n)))
    return rows


def markdown(rows, info, bandwidth, command):
    lines = report_header("TTMatMul vs ORT MatMul (kernel level)", command, info, bandwidth)
    lines += [f"Per-layer medians; speedup = ORT time / TT time; efficiency = speedup / FLOP ratio (target >= "
              f"{TARGET_EFFICIENCY}). 2 threads run with allow_spinning=0.", "",
              "| K x N | M | regime | thr | config | mem | FLOP ratio | ORT us | TT us | speedup | efficiency | target met |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['k']}x{r['n']} | {r['m']} | {r['regime']} | {r['threads']} | {r['config']} | "
                     f"{r['mem_ratio']:.1%} | {r['flop_ratio']:.1f} | {r['ort_us']:.1f} | {r['tt_us']:.1f} | "
                     f"{r['speedup']:.2f} | {r['efficiency']:.2f} | {'yes' if r['meets_target'] else 'no'} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = kernel_bench_parser(__doc__.splitlines()[0], "reports/tt_kernel", "one shape, two configs, few repeats (smoke run)")
    parser.add_argument("--regimes", nargs="+", default=["in-cache", "out-of-cache"])
    args = parser.parse_args(argv)
    shapes = kernel_bench_shapes(args, SHAPES)
    if args.quick:
        shapes, args.threads, args.regimes = shapes[:1], args.threads[:1], args.regimes[:1]
    rng = np.random.default_rng(0)
    info = machine_info()
    bandwidth = read_bandwidth_gbs(megabytes=64 if args.quick else 512)
    rows = []
    for threads in args.threads:
        for k, n in shapes:
            cases = configs(k, n, args.quick)
            for m in args.ms:
                for regime in args.regimes:
                    repeats = kernel_bench_repeats(args, k, n, m, quick=3)
                    new = run_case(k, n, m, regime, threads, cases, repeats, rng)
                    for r in new:
                        print(f"{k}x{n} M={m} {regime} thr={threads} {r['config']}: ORT {r['ort_us']:.1f}us "
                              f"TT {r['tt_us']:.1f}us x{r['speedup']:.2f} (FLOP ratio {r['flop_ratio']:.1f}, "
                              f"efficiency {r['efficiency']:.2f})", flush=True)
                    rows.extend(new)
    command = command_line("python bench/bench_tt.py", argv)
    payload = dict(machine=info, bandwidth=bandwidth, command=command, rows=rows,
                   target_efficiency=TARGET_EFFICIENCY)
    paths = write_report(args.output, payload, markdown(rows, info, bandwidth, command))
    print("wrote", *paths)
    return 0


if __name__ == "__main__":
    sys.exit(main())
