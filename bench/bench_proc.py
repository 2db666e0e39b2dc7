"""ProcSparseMatMul vs ORT's MatMul on the same shapes, same process, alternating A B A B, medians.

Each session holds `copies` parallel nodes on one input so Python's per-Run overhead is amortised:
- in-cache: the copies share one weight / one packed layer (it stays in L2/L3 between nodes);
- out-of-cache: distinct weights, as many copies as make *that representation's* bytes exceed
  3x the 32 MiB L3 (the packed layer is smaller than W, so it needs more copies to leave the cache;
  a real decode step streams every layer from DRAM either way).
Settings: fanout fraction x block x delta dtype x base_scale (base_scale > 0 hashes the base in
the kernel). Reports per-layer time, speedup = ORT / ours, mem_ratio, and at M = 1 GB/s of packed
bytes.

usage: python bench/bench_proc.py [--quick] [--threads 1 2] [-o reports/proc_kernel]
"""
from __future__ import annotations

import math
import sys

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from ortsparse.benchmarking import (command_line, kernel_bench_parser, kernel_bench_repeats, kernel_bench_shapes,
                                    machine_info, median, read_bandwidth_gbs, report_header, session, time_sessions,
                                    write_report)
from ortsparse.proc_sparse import build_proc_sparse

SHAPES = [(576, 1536), (1536, 576), (4096, 11008)]
SETTINGS = [  # (fanout fraction, block, delta dtype, base_scale)
    (1.0, 32, "float16", 0.0), (0.75, 32, "float16", 0.0), (0.5, 32, "float16", 0.0), (0.25, 32, "float16", 0.0),
    (0.5, 32, "float32", 0.0), (0.5, 64, "float16", 0.0), (0.5, 16, "float16", 0.0), (0.5, 32, "float16", 0.05),
]
OUT_OF_CACHE_BYTES = 96 * 1024 * 1024  # 3x the 32 MiB L3


def setting_name(s):
    frac, block, dtype, base = s
    return f"proc_f{frac}_b{block}_{'h' if dtype == 'float16' else 's'}{'_hash' if base else ''}"


def graph(k, n, nodes, inits, outputs):
    g = helper.make_graph(nodes, "bench", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["m", k])],
                          outputs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.ortsparse", 1)])


def matmul_model(k, n, copies, distinct, seed=0):
    rng = np.random.default_rng(seed)
    inits, nodes, outputs = [], [], []
    for c in range(copies if distinct else 1):
        inits.append(numpy_helper.from_array(rng.standard_normal((k, n)).astype(np.float32) * 0.05, f"W{c}"))
    for c in range(copies):
        nodes.append(helper.make_node("MatMul", ["X", f"W{c if distinct else 0}"], [f"Y{c}"], name=f"mm{c}"))
        outputs.append(helper.make_tensor_value_info(f"Y{c}", TensorProto.FLOAT, None))
    return graph(k, n, nodes, inits, outputs)


def proc_model(k, n, copies, distinct, setting, seed=0):
    frac, block, dtype, base = setting
    rng = np.random.default_rng(seed)
    inits, nodes, outputs = [], [], []
    attrs = None
    for c in range(copies if distinct else 1):
        w = rng.standard_normal((k, n)).astype(np.float32) * 0.05
        p = build_proc_sparse(w, block=block, fanout=float(frac), base_scale=base, seed=c, shed_eps=0.0,
                              watermark=0, delta_dtype=dtype)
        inits += [numpy_helper.from_array(p.indices, f"I{c}"), numpy_helper.from_array(p.deltas, f"D{c}")]
        attrs = p.attributes()
    for c in range(copies):
        src = c if distinct else 0
        a = dict(attrs, seed=src)
        nodes.append(helper.make_node("ProcSparseMatMul", ["X", f"I{src}", f"D{src}"], [f"Y{c}"], name=f"p{c}",
                                      domain="ai.ortsparse", **a))
        outputs.append(helper.make_tensor_value_info(f"Y{c}", TensorProto.FLOAT, None))
    return graph(k, n, nodes, inits, outputs)


def packed_bytes(k, n, setting):
    frac, block, dtype, _ = setting
    nb = math.ceil(k / block)
    f = max(1, min(nb, math.ceil(frac * nb - 1e-9)))
    return n * f * (2 + block * (2 if dtype == "float16" else 4))


def run_case(k, n, m, regime, threads, settings, repeats, rng):
    layer_bytes = k * n * 4
    if regime == "in-cache" and layer_bytes > 24 * 1024 * 1024:
        return []  # does not fit the L3: no in-cache regime for this shape
    distinct = regime == "out-of-cache"

    def copies_for(nbytes):
        return max(1, math.ceil(OUT_OF_CACHE_BYTES / nbytes)) if distinct else 8

    x = rng.standard_normal((m, k)).astype(np.float32)
    feeds = {"X": x}
    copies = {"ort_matmul": copies_for(layer_bytes)}
    sessions = {"ort_matmul": session(matmul_model(k, n, copies["ort_matmul"], distinct), threads)}
    for s in settings:
        name = setting_name(s)
        copies[name] = copies_for(packed_bytes(k, n, s))
        sessions[name] = session(proc_model(k, n, copies[name], distinct, s), threads)
    times = time_sessions(sessions, feeds, repeats=repeats, warmup=2)
    base = median(times["ort_matmul"]) / copies["ort_matmul"]
    rows = []
    for s in settings:
        name = setting_name(s)
        t = median(times[name]) / copies[name]
        nbytes = packed_bytes(k, n, s)
        row = dict(k=k, n=n, m=m, regime=regime, threads=threads, fanout_frac=s[0], block=s[1], delta_dtype=s[2],
                   base_scale=s[3], copies=copies[name], ort_copies=copies["ort_matmul"], ort_us=base * 1e6,
                   ours_us=t * 1e6, speedup=base / t, mem_ratio=nbytes / layer_bytes)
        if m == 1:
            row["ours_gbs"] = nbytes / t / 1e9
            row["ort_gbs"] = layer_bytes / base / 1e9
        rows.append(row)
    return rows


def markdown(rows, info, bandwidth, command):
    lines = report_header("ProcSparseMatMul vs ORT MatMul (kernel level)", command, info, bandwidth)
    lines += ["Per-layer medians; speedup = ORT time / ours (>1 is faster). 2 threads run with allow_spinning=0. "
              "mem = packed bytes / dense fp32 bytes. GB/s = packed bytes / time (M = 1). h = fp16 deltas, "
              "s = fp32; hash = base_scale 0.05 (base hashed in the kernel).", "",
              "| K x N | M | regime | thr | fanout | block | deltas | base | mem | ORT us | ours us | speedup | ours GB/s |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        gbs = f"{r['ours_gbs']:.1f}" if "ours_gbs" in r else ""
        lines.append(f"| {r['k']}x{r['n']} | {r['m']} | {r['regime']} | {r['threads']} | {r['fanout_frac']} | "
                     f"{r['block']} | {r['delta_dtype']} | {r['base_scale']} | {r['mem_ratio']:.3f} | {r['ort_us']:.1f} | "
                     f"{r['ours_us']:.1f} | {r['speedup']:.2f} | {gbs} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = kernel_bench_parser(__doc__.splitlines()[0], "reports/proc_kernel", "one small shape, M = 1, few repeats (smoke run)")
    args = parser.parse_args(argv)
    shapes = kernel_bench_shapes(args, SHAPES)
    settings = SETTINGS
    regimes = ("in-cache", "out-of-cache")
    if args.quick:
        shapes, settings, regimes = shapes[:1], SETTINGS[2:3] + SETTINGS[-1:], ("in-cache",)
        args.threads, args.ms = args.threads[:1], [1]
    rng = np.random.default_rng(0)
    info = machine_info()
    bandwidth = read_bandwidth_gbs(megabytes=64 if args.quick else 512)
    rows = []
    for threads in args.threads:
        for k, n in shapes:
            for m in args.ms:
                for regime in regimes:
                    repeats = kernel_bench_repeats(args, k, n, m, quick=3)
                    new = run_case(k, n, m, regime, threads, settings, repeats, rng)
                    for r in new:
                        print(f"{k}x{n} M={m} {regime} thr={threads} fanout={r['fanout_frac']} b{r['block']} "
                              f"{r['delta_dtype']} base={r['base_scale']}: ORT {r['ort_us']:.1f}us ours "
                              f"{r['ours_us']:.1f}us x{r['speedup']:.2f} mem {r['mem_ratio']:.3f}", flush=True)
                    rows.extend(new)
    command = command_line("python bench/bench_proc.py", argv)
    payload = dict(machine=info, bandwidth=bandwidth, command=command, rows=rows)
    paths = write_report(args.output, payload, markdown(rows, info, bandwidth, command))
    print("wrote", *paths)
    return 0


if __name__ == "__main__":
    sys.exit(main())
