"""The quant weight backend vs ORT's MatMulNBits (accuracy_level 4, same bits and block_size), same
process, alternating, medians per round, minimum and median over rounds.

- ORT: one graph of `copies` independent MatMulNBits nodes (each with its own weights) on one input X;
  time per node = Run time / copies.
- ours: `copies` QuantMatMul objects built from the same tensors, called in a C++ loop
  (_kernels.quant_bench: one pass over every copy, per-call time measured inside C++; 1 thread runs
  inline, 2 threads use a two-thread runner that sleeps between calls, like ORT with
  session.intra_op.allow_spinning=0).
- in-l2 (not in the default --regimes): one layer of <= 1 MiB reused, so the weights stay in L2 and the
  kernels are compute-bound (what a core pays per byte when it is slow or the data is near);
- in-cache: copies whose total is <= 8 MiB (skipped for layers larger than 16 MiB);
  out-of-cache: distinct copies totalling >= 96 MiB (3x the 32 MiB L3).
- ours runs both decode numerics: accuracy_level 4 (int8 activations, int8 dot products: what a
  rewritten accuracy_level-4 MatMulNBits runs) and accuracy_level 0 (fp32 products of the
  dequantized weights), each against the same MatMulNBits timings.
- rounds: each case is timed in --rounds rounds of `repeats` alternated calls (ORT, then each of
  ours); a round's ratio is the ratio of its medians; the report gives the minimum and the median
  over rounds (the minimum is the number to quote: a machine's slow moments are a user's too).
At M = 1 the rows each call keeps are a random list (block 1) of `keep` x K rows; GB/s = bytes the
call must read (kept rows' quantized bytes + scales + zero points) / time.

usage: python bench/bench_quant_kernel.py [--quick] [--bits 4 8] [--block 32] [--threads 1 2] [--rounds 3]
       [-o reports/quant_kernel]
"""
from __future__ import annotations

import math
import sys

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from ortsparse import _kernels as K
from ortsparse.benchmarking import (command_line, kernel_bench_parser, kernel_bench_repeats, kernel_bench_shapes,
                                   machine_info, median, read_bandwidth_gbs, report_header, write_report)

# SmolLM2-135M's layers (q/o 576x576, k/v 576x192, gate+up fused 576x3072, down 1536x576, head
# 576x49152), a 7B MLP (4096x11008) and a wide head (Gemma-3's 640x262144).
SHAPES = [(576, 576), (576, 192), (576, 3072), (1536, 576), (576, 49152), (4096, 11008), (640, 262144)]
KEEPS = [1.0, 0.5]
LEVELS = (4, 0)  # our decode numerics: MatMulNBits accuracy_level 4 (int8 activations) and 0 (fp32)
IN_L2_BYTES = 1024 * 1024
IN_CACHE_BYTES = 8 * 1024 * 1024
OUT_OF_CACHE_BYTES = 96 * 1024 * 1024


def make_tensors(rng, k, n, bits, block, zero_points):
    nb = (k + block - 1) // block
    b = rng.integers(0, 256, (n, nb, block * bits // 8), dtype=np.uint8)
    scales = (rng.standard_normal((n, nb)) * 0.01).astype(np.float32)
    zp = rng.integers(0, 256, (n, (nb * bits + 7) // 8), dtype=np.uint8) if zero_points else None
    return b, scales, zp


def layer_bytes(k, n, bits, block, zero_points):
    nb = (k + block - 1) // block
    return n * nb * block * bits // 8 + n * nb * 4 + (n * ((nb * bits + 7) // 8) if zero_points else 0)


def ort_session(tensors, k, n, bits, block, threads):
    inits, nodes, outputs = [], [], []
    for c, (b, scales, zp) in enumerate(tensors):
        inits += [helper.make_tensor(f"B{c}", TensorProto.UINT8, b.shape, b.tobytes(), raw=True),
                  helper.make_tensor(f"S{c}", TensorProto.FLOAT, scales.shape, scales.tobytes(), raw=True)]
        names = ["X", f"B{c}", f"S{c}"]
        if zp is not None:
            inits.append(helper.make_tensor(f"Z{c}", TensorProto.UINT8, zp.shape, zp.tobytes(), raw=True))
            names.append(f"Z{c}")
        nodes.append(helper.make_node("MatMulNBits", names, [f"Y{c}"], domain="com.microsoft", K=k, N=n, bits=bits,
                                      block_size=block, accuracy_level=4))
        outputs.append(helper.make_tensor_value_info(f"Y{c}", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "bench", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["m", k])],
                              outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    if threads > 1:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def run_case(k, n, m, bits, block, zero_points, regime, threads, repeats, rounds, rng):
    lb = layer_bytes(k, n, bits, block, zero_points)
    if regime == "in-l2":  # one layer reused: compute-bound (the cost per byte the core itself pays)
        if lb > IN_L2_BYTES:
            return []
        copies = 1
    elif regime == "in-cache":
        if lb > 2 * IN_CACHE_BYTES:
            return []
        copies = max(1, min(8, IN_CACHE_BYTES // lb))
    else:
        copies = max(1, math.ceil(OUT_OF_CACHE_BYTES / lb))
    tensors = [make_tensors(np.random.default_rng(c), k, n, bits, block, zero_points) for c in range(copies)]
    sess = ort_session(tensors, k, n, bits, block, threads)
    ours = {level: [K.QuantMatMul(b, s, z, k, n, bits, block, accuracy_level=level) for b, s, z in tensors]
            for level in LEVELS}
    del tensors
    x = rng.standard_normal((m, k)).astype(np.float32)
    keeps = KEEPS if m == 1 else [1.0]
    row_lists = {keep: (None if keep == 1.0 else
                        [np.sort(rng.choice(k, int(round(keep * k)), replace=False)).astype(np.int32)])
                 for keep in keeps}
    feeds = {"X": x}
    cases = [(level, keep) for level in LEVELS for keep in keeps]
    for _ in range(2):  # warm-up
        sess.run(None, feeds)
        for level, keep in cases:
            K.quant_bench(ours[level], x, row_lists[keep], runs=1, threads=threads)
    import time
    ort_rounds, our_rounds = [], {case: [] for case in cases}
    for _ in range(rounds):
        ort_times, our_times = [], {case: [] for case in cases}
        for _ in range(repeats):
            t0 = time.perf_counter()
            sess.run(None, feeds)
            ort_times.append((time.perf_counter() - t0) / copies)
            for level, keep in cases:
                our_times[level, keep].append(float(K.quant_bench(ours[level], x, row_lists[keep], runs=1,
                                                                  threads=threads)[0]))
        ort_rounds.append(median(ort_times))
        for case in cases:
            our_rounds[case].append(median(our_times[case]))
    base = median(ort_rounds)
    ours_bytes = ours[LEVELS[0]][0].bytes
    panel_width = ours[LEVELS[0]][0].panel * ours[LEVELS[0]][0].num_panels
    rows = []
    for level, keep in cases:
        ratios = [o / t for o, t in zip(ort_rounds, our_rounds[level, keep])]
        t = median(our_rounds[level, keep])
        row = dict(k=k, n=n, m=m, bits=bits, block=block, zero_points=zero_points, regime=regime, threads=threads,
                   accuracy_level=level, keep=keep, copies=copies, rounds=rounds, repeats=repeats,
                   ort_us=base * 1e6, ours_us=t * 1e6, speedup=median(ratios), speedup_min=min(ratios),
                   speedup_rounds=ratios, target=(1.0 if keep == 1.0 else 0.85 / keep) if m == 1 else 0.9)
        if m == 1:
            # Scales and zero points of a block are read when any of its rows is kept (at block 1 and
            # keep >= 0.5 that is every block); the quantized bytes only for kept rows.
            q_bytes = k * n * bits // 8
            row["ours_gbs"] = (keep * q_bytes + (ours_bytes - q_bytes * panel_width / n)) / t / 1e9
            row["ort_gbs"] = lb / base / 1e9
        rows.append(row)
    return rows


def markdown(rows, info, bandwidth, command):
    lines = report_header("Quant backend vs ORT MatMulNBits (accuracy_level 4), kernel level", command, info, bandwidth)
    lines += ["Per-call medians per round, alternating in one process; speedup = ORT time / ours (>1 is faster), "
             "the minimum and the median over rounds. acc = our decode numerics (MatMulNBits accuracy_level: "
             "4 = int8 activations, 0 = fp32 products); MatMulNBits always runs accuracy_level 4. "
             "keep < 1: random row lists at block 1. 2 threads: allow_spinning=0 for ORT, a sleeping "
             "two-thread runner for ours. GB/s (M = 1) = bytes the call reads / time. Ours is timed in a C++ loop, "
             "MatMulNBits in a session: bench/bench_quant_op.py measures what a session adds per node.", "",
             "| K x N | bits | block | M | regime | thr | acc | keep | ORT us | ours us | speedup min | speedup median "
             "| target | ORT GB/s | ours GB/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        og = f"{r['ort_gbs']:.1f}" if "ort_gbs" in r else ""
        ug = f"{r['ours_gbs']:.1f}" if "ours_gbs" in r else ""
        lines.append(f"| {r['k']}x{r['n']} | {r['bits']} | {r['block']} | {r['m']} | {r['regime']} | {r['threads']} | "
                     f"{r['accuracy_level']} | {r['keep']} | {r['ort_us']:.1f} | {r['ours_us']:.1f} | {r['speedup_min']:.2f} | "
                     f"{r['speedup']:.2f} | {r['target']:.2f} | "
                     f"{og} | {ug} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = kernel_bench_parser(__doc__.splitlines()[0], "reports/quant_kernel", "one shape, few repeats (smoke run)")
    parser.add_argument("--bits", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--zero-points", action="store_true", help="asymmetric weights (uint8 zero points)")
    parser.add_argument("--regimes", nargs="+", default=["in-cache", "out-of-cache"])
    parser.add_argument("--rounds", type=int, default=3, help="rounds per case (>= 3: the minimum is reported)")
    args = parser.parse_args(argv)
    shapes = kernel_bench_shapes(args, SHAPES)
    if args.quick:
        shapes = shapes[:1]
    rng = np.random.default_rng(0)
    info = machine_info()
    bandwidth = read_bandwidth_gbs()
    rows = []
    for bits in args.bits:
        for threads in args.threads:
            for k, n in shapes:
                for m in args.ms:
                    for regime in args.regimes:
                        repeats = kernel_bench_repeats(args, k, n, m, quick=5)
                        new = run_case(k, n, m, bits, args.block, args.zero_points, regime, threads, repeats,
                                       args.rounds, rng)
                        for r in new:
                            print(f"int{bits} {k}x{n} M={m} {regime} thr={threads} acc={r['accuracy_level']} "
                                  f"keep={r['keep']}: ORT {r['ort_us']:.1f}us ours {r['ours_us']:.1f}us "
                                  f"x{r['speedup_min']:.2f} min / x{r['speedup']:.2f} median (target {r['target']:.2f})"
                                  + (f" GB/s ORT {r['ort_gbs']:.1f} ours {r['ours_gbs']:.1f}" if m == 1 else ""),
                                  flush=True)
                        rows.extend(new)
    command = command_line("python bench/bench_quant_kernel.py", argv)
    payload = dict(machine=info, bandwidth=bandwidth, command=command, rows=rows)
    paths = write_report(args.output, payload, markdown(rows, info, bandwidth, command))
    print("wrote", *paths)
    return 0


if __name__ == "__main__":
    sys.exit(main())
