"""The quantized KwtaBlockMatMul through ONNX Runtime sessions vs the same kernel in a C++ loop.

bench/bench_quant_kernel.py times our kernel in a C++ loop (no session) against MatMulNBits in a
session. This one puts both ops in sessions — `copies` independent nodes on one X [1, 1, K], M = 1,
int8, block 32, symmetric, 1 thread, spinning off, sessions alternating in a fresh random order per
run, medians — and times the
kernel on the same tensors in the C++ loop beside them, so the cost of running inside a session is
visible. Variants: dense (k_frac 1, every row), keep ~0.72 by a threshold on |x| (what calibrated
gating does at ~28% skipped).

usage: python bench/bench_quant_op.py [--shape 576 960] [--copies 96] [--runs 60] [--glu] [--clock thread|wall]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

import ortsparse
from ortsparse import _kernels as K
from ortsparse.graph_rewrite import KwtaSettings, RewriteConfig, TechniqueChoice, rewrite_model

MS = "com.microsoft"


def quantized(rng, k, n):
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, DefaultWeightOnlyQuantizer

    w = (rng.standard_normal((k, n)) * 0.15).astype(np.float32)
    config = DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=True, bits=8)
    b, scales, _ = DefaultWeightOnlyQuantizer(config).qbits_block_quant(w)
    return b, scales


def nbits_graph(tensors, k, n):
    nodes, inits, outputs = [], [], []
    for i, (b, scales) in enumerate(tensors):
        inits += [onnx.numpy_helper.from_array(b, f"b{i}"), onnx.numpy_helper.from_array(scales, f"s{i}")]
        nodes.append(helper.make_node("MatMulNBits", ["X", f"b{i}", f"s{i}"], [f"y{i}"], name=f"/l{i}/MatMul_Q8",
                                      domain=MS, K=k, N=n, bits=8, block_size=32, accuracy_level=4))
    # One output (the sum of the nodes' outputs): returning every node's output to Python would add
    # its own per-node cost to both columns.
    nodes.append(helper.make_node("Sum", [f"y{i}" for i in range(len(tensors))], ["Y"], name="/sum"))
    outputs.append(helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 1, n]))
    graph = helper.make_graph(nodes, "nbits", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 1, k])],
                              outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)])
    model.ir_version = 10
    return model


def gated(model, settings):
    config = RewriteConfig(techniques={"kwta": TechniqueChoice(settings, enabled=True, target="all")})
    # fuse=False: the nodes share X, and the rewriter would fuse them into one wide node (and a Split),
    # which is not the per-node cost this bench compares with the loop.
    return rewrite_model(model, config, fuse=False)[0]


def with_glu(model, n):
    """Our nodes as the fused gate/up layer of a SwiGLU MLP (glu="silu": silu(first half) * second half),
    the output N / 2 wide."""
    for node in model.graph.node:
        if node.op_type == "KwtaBlockMatMul":
            node.attribute.append(helper.make_attribute("glu", "silu"))
    del model.graph.value_info[:]
    model.graph.output[0].type.tensor_type.shape.dim[2].dim_value = n // 2
    return model


def session(model, ours):
    options = ortsparse.session_options(intra_op_num_threads=1, allow_spinning=False) if ours else ort.SessionOptions()
    if not ours:
        options.intra_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.onnx"
        onnx.save(model, str(path))
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=2, default=[576, 960], metavar=("K", "N"))
    parser.add_argument("--copies", type=int, default=96)
    parser.add_argument("--runs", type=int, default=60)
    parser.add_argument("--clock", choices=["thread", "wall"], default="thread",
                        help="thread: CPU time of the calling thread (1 thread runs every node on it), so that time "
                             "the OS gives other programs on a shared machine is not counted; wall: elapsed time")
    parser.add_argument("--glu", action="store_true",
                        help="our session nodes fuse gate and up (glu=silu, N = both halves; SmolLM2's MLP: "
                             "--shape 576 3072); the loop and MatMulNBits compute the product only")
    args = parser.parse_args(argv)
    k, n = args.shape
    if args.glu and n % 2:
        parser.error("--glu needs an even N")
    rng = np.random.default_rng(0)
    tensors = [quantized(rng, k, n) for _ in range(args.copies)]
    x = rng.standard_normal((1, 1, k)).astype(np.float32)
    threshold = float(np.quantile(np.abs(x), 0.28))
    kept = np.flatnonzero(np.abs(x[0, 0]) >= threshold).astype(np.int32)
    base = nbits_graph(tensors, k, n)
    ours = {"dense": gated(base, KwtaSettings(k_frac=1.0)),
            f"keep {kept.size / k:.2f}": gated(base, KwtaSettings(k_frac=1.0, threshold=threshold))}
    if args.glu:
        ours = {name: with_glu(model, n) for name, model in ours.items()}
    sessions = {"MatMulNBits (ORT)" + (", no GLU" if args.glu else ""): session(base, False),
                **{f"ours {name}, session" + (", glu" if args.glu else ""): session(model, True)
                   for name, model in ours.items()}}
    # The rewrite carries MatMulNBits' accuracy_level 4 over: the loop runs the same numerics.
    loop = [K.QuantMatMul(b, s, None, k, n, 8, 32, accuracy_level=4) for b, s in tensors]
    loops = {"ours dense, C++ loop": None, f"ours keep {kept.size / k:.2f}, C++ loop": [kept]}
    times = {name: [] for name in [*sessions, *loops]}
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    def call(name):
        if name in sessions:
            sessions[name].run(None, {"X": x})
        else:
            K.quant_bench(loop, x[0], loops[name], runs=1, threads=1)

    names = list(times)
    order_rng = np.random.default_rng(1)
    for _ in range(args.runs):
        # A fresh order per run: what ran just before (and what it left in the caches) is no one's bias.
        for i in order_rng.permutation(len(names)):
            start = clock()
            call(names[i])
            times[names[i]].append((clock() - start) / args.copies)
    print(f"{k}x{n} int8 block 32, M = 1, {args.copies} nodes ({args.copies * k * n / 1e6:.0f} MB), 1 thread; "
          f"us per node ({args.clock} clock), median of {args.runs - 5}")
    for name, values in times.items():
        print(f"  {name:32s} {1e6 * np.median(values[5:]):7.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
