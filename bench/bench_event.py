"""EventDrivenMatMul vs dense ORT, same process, alternating A B A B, medians.

Two parts (both axis = call, the mode where delta coding can pay):
1. kernel: one node (``copies`` parallel nodes on one input, so Python's per-Run overhead is
   amortised; each copy keeps its own streams) vs ORT MatMul on the real models' shapes, M rows per
   call, a stream where a fraction ``change`` of the input features changes per call; exact mode
   (topk 1, delta_theta 0: the refresh rate equals the change fraction, the result equals dense).
2. workloads (python/ortsparse/commands/event_workloads.py): MiniLM search-as-you-type and sentence
   edits, and the smooth stream through a generated MLP. Per setting: seconds per call of the event
   model vs the dense model on the same streams (MiniLM: also vs ORT's optimized dense export), and
   quality of the same run (embedding cosine, relative L2 gap of the output) with the refresh rate.

usage: python bench/bench_event.py [--quick] [--threads 1] [--part kernel workloads] [-o reports/event]
"""
from __future__ import annotations

import argparse
import sys

import numpy as np
from onnx import TensorProto, helper, numpy_helper

import ortsparse
from ortsparse.benchmarking import alternate, machine_info, median, session, write_report
from ortsparse.commands import event_workloads as ew
from ortsparse.zoo.models import real_model_path
from ortsparse.runtime import open_session, thread_options

SHAPES = [(384, 1536), (1536, 384), (576, 1536), (1536, 576)]
CHANGES = [0.05, 0.25, 0.5, 1.0]
ROWS = [1, 12]
WORKLOAD_SETTINGS = [  # (topk, delta_theta)
    (1.0, 0.0), (1.0, 0.05), (1.0, 0.1), (0.5, 0.05),
]


def kernel_model(k, n, copies, op, rng):
    weights = [rng.standard_normal((k, n)).astype(np.float32) * 0.05 for _ in range(copies)]
    inits = [numpy_helper.from_array(w, f"W{i}") for i, w in enumerate(weights)]
    nodes, outputs = [], []
    for c in range(copies):
        if op == "MatMul":
            nodes.append(helper.make_node("MatMul", ["X", f"W{c}"], [f"Y{c}"], name=f"mm{c}"))
        else:
            nodes.append(helper.make_node("EventDrivenMatMul", ["X", f"W{c}"], [f"Y{c}"], name=f"ev{c}",
                                          domain="ai.ortsparse", axis="call", topk=1.0, delta_theta=0.0,
                                          gap_every=0))
        outputs.append(helper.make_tensor_value_info(f"Y{c}", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "bench", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["m", k])],
                              outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.ortsparse", 1)])


def input_cycle(rows, k, change, calls, rng):
    """`calls` inputs, each differing from the previous in a `change` fraction of features."""
    x = rng.standard_normal((rows, k)).astype(np.float32)
    out = []
    for _ in range(calls):
        x = x.copy()
        mask = rng.random(x.shape) < change
        x[mask] += rng.standard_normal(int(mask.sum())).astype(np.float32)
        out.append(x)
    return out


def run_kernel(args, rng):
    rows_out = []
    for k, n in SHAPES:
        copies = max(1, (8 << 20) // (k * n * 4))  # ~8 MB of weights per session: in L3, several nodes per Run
        dense = session(kernel_model(k, n, copies, "MatMul", rng), args.threads)
        for m in ROWS:
            for change in CHANGES:
                event = session(kernel_model(k, n, copies, "Event", rng), args.threads)
                inputs = input_cycle(m, k, change, 64, rng)
                state = {"i": 0}

                def step(s, state=state, inputs=inputs):
                    x = inputs[state["i"] % len(inputs)]
                    s.run(None, {"X": x})

                def run_dense():
                    step(dense)

                def run_event():
                    step(event)
                    state["i"] += 1

                ortsparse.reset_metrics()
                times = alternate({"dense": run_dense, "event": run_event}, repeats=args.repeats, warmup=3)
                refreshed = ortsparse.metrics()["total/EventDrivenMatMul"]["event.topk_kept"]
                d, e = median(times["dense"]) / copies, median(times["event"]) / copies
                rows_out.append({"k": k, "n": n, "m": m, "change": change, "copies": copies, "refreshed": refreshed,
                                 "dense_us": d * 1e6, "event_us": e * 1e6, "speedup": d / e})
                print(f"kernel {k}x{n} M={m:<3d} change {change:<5g} refreshed {refreshed:.3f} dense {d * 1e6:8.1f} us "
                      f"event {e * 1e6:8.1f} us  speedup {d / e:5.2f}x", flush=True)
    return rows_out


def run_workloads(args):
    options = thread_options(args.threads)
    results = []
    for workload in args.workloads:
        dense_model = ew.dense_model_for(workload)
        streams = ew.workload_streams(workload, args.count, mlp_rows=args.mlp_rows)
        baselines = {"dense": open_session(dense_model, options)}
        if workload != "mlp":
            opt = real_model_path("minilm", "torchscript.ortopt.onnx")
            if opt.exists():
                baselines["dense_ortopt"] = open_session(opt, options)
        for topk, theta in WORKLOAD_SETTINGS:
            model, report = ew.event_model(dense_model, target=args.target, topk=topk, delta_theta=theta,
                                           gap_every=args.gap_every, gap_tol=args.gap_tol)
            event = open_session(model, options)
            ortsparse.reset_metrics()
            quality = ew.compare_streams(baselines["dense"], event, streams, embedding=workload != "mlp")
            metrics = ew.event_metrics_summary()
            candidates = {name: (lambda s=s: [ew.replay(s, st, reset=False) for st in streams])
                          for name, s in baselines.items()}
            candidates["event"] = lambda: [ew.replay(event, st, reset=True) for st in streams]
            times = alternate(candidates, repeats=args.workload_repeats, warmup=1)
            calls = sum(len(st) for st in streams)
            per_call = {name: median(t) / calls * 1e3 for name, t in times.items()}
            record = {"workload": workload, "mlp_rows": args.mlp_rows if workload == "mlp" else None, "topk": topk, "delta_theta": theta, "target": args.target,
                      "rewritten_layers": len(report.rewritten), "ms_per_call": per_call,
                      "speedup_vs_dense": per_call["dense"] / per_call["event"], "quality": quality,
                      "refreshed": metrics.get("event.topk_kept"), "disables": metrics.get("disables", 0)}
            if "dense_ortopt" in per_call:
                record["speedup_vs_dense_ortopt"] = per_call["dense_ortopt"] / per_call["event"]
            results.append(record)
            cos = f" cos {quality['cosine_mean']:.5f} (min {quality['cosine_min']:.5f})" if "cosine_mean" in quality else ""
            print(f"{workload:7s} topk {topk:<4g} theta {theta:<5g} refreshed {record['refreshed'] or 0:.3f} "
                  f"dense {per_call['dense']:.3f} ms event {per_call['event']:.3f} ms speedup "
                  f"{record['speedup_vs_dense']:.2f}x gap {quality['gap_mean']:.4f} (p95 {quality['gap_p95']:.4f})"
                  f"{cos}", flush=True)
    return results


def markdown(payload):
    lines = [f"# EventDrivenMatMul vs dense (threads {payload['threads']})", "",
             f"Command: `{payload['command']}`", ""]
    if payload.get("kernel"):
        lines += ["## Kernel (axis call, exact mode: refresh rate = change fraction)", "",
                  "| K x N | M | change | refreshed | dense us | event us | speedup |", "|---|---|---|---|---|---|---|"]
        for r in payload["kernel"]:
            lines.append(f"| {r['k']}x{r['n']} | {r['m']} | {r['change']} | {r['refreshed']:.3f} | {r['dense_us']:.1f} | "
                         f"{r['event_us']:.1f} | {r['speedup']:.2f}x |")
        lines.append("")
    if payload.get("workloads"):
        lines += ["## Workloads (axis call)", "",
                  "| workload | topk | delta_theta | refreshed | ms/call dense | ms/call event | speedup | gap mean | "
                  "gap p95 | cosine mean / min |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in payload["workloads"]:
            q = r["quality"]
            cos = f"{q['cosine_mean']:.5f} / {q['cosine_min']:.5f}" if "cosine_mean" in q else "-"
            lines.append(f"| {r['workload']} | {r['topk']} | {r['delta_theta']} | {r['refreshed'] or 0:.3f} | "
                         f"{r['ms_per_call']['dense']:.3f} | {r['ms_per_call']['event']:.3f} | "
                         f"{r['speedup_vs_dense']:.2f}x | {q['gap_mean']:.4f} | {q['gap_p95']:.4f} | {cos} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny smoke run (timings meaningless)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--part", nargs="+", choices=("kernel", "workloads"), default=["kernel", "workloads"])
    parser.add_argument("--workloads", nargs="+", choices=("search", "edits", "mlp"), default=["search", "edits", "mlp"])
    parser.add_argument("--count", type=int, default=16, help="streams per workload")
    parser.add_argument("--repeats", type=int, default=200, help="kernel: alternations")
    parser.add_argument("--workload-repeats", type=int, default=5)
    parser.add_argument("--target", default="all", help="event target layers (default all)")
    parser.add_argument("--mlp-rows", type=int, default=1, help="mlp workload: rows of X per call (default 1)")
    parser.add_argument("--gap-every", type=int, default=0, help="gap check period (default 0: off while timing)")
    parser.add_argument("--gap-tol", type=float, default=0.03)
    parser.add_argument("-o", "--output", default="reports/event")
    args = parser.parse_args(argv)
    global SHAPES, CHANGES, ROWS, WORKLOAD_SETTINGS
    if args.quick:
        SHAPES, CHANGES, ROWS = [(64, 96)], [0.25], [1, 3]
        WORKLOAD_SETTINGS = [(1.0, 0.05)]
        args.repeats, args.workload_repeats, args.count = 5, 1, 2
    rng = np.random.default_rng(0)
    payload = {"machine": machine_info(), "threads": args.threads, "command": " ".join(["python"] + sys.argv)}
    if "kernel" in args.part:
        payload["kernel"] = run_kernel(args, rng)
    if "workloads" in args.part:
        payload["workloads"] = run_workloads(args)
    if not args.quick:
        paths = write_report(args.output, payload, markdown(payload))
        print("wrote", *paths)
    else:
        print(markdown(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
