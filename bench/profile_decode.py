"""Where a decode step's time goes: ORT's profiler per op type, dense vs KWTA-rewritten KV export.

usage: python bench/profile_decode.py [--k 0.75] [--target both] [--context 128] [--runs 5] [--warmup 2] [--threads 1]
       python bench/profile_decode.py --model GENAI_FOLDER_OR_ONNX --config layers.json [...]
       python bench/profile_decode.py --model GENAI_FOLDER --against REWRITTEN_FOLDER [...]  (e.g. a tune's output)
Each model prefills `--context` corpus tokens, then runs `--warmup` + `--runs` real decode steps
(the corpus continuation, the cache growing); the last `--runs` are profiled: per op type, the sum
over its nodes of each node's median time. The first steps of a fresh session are slower (its arena
grows, pages fault in) and not alike across graphs: averaged in, they made GroupQueryAttention look
~25% slower in a rewritten genai graph, while each node's later steps were alike. Node times come
from ORT's own profiler (it adds overhead; compare the two columns, not absolute tokens/s).
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import statistics
import tempfile

import onnx

from ortsparse import metrics, reset_metrics
from ortsparse.graph_rewrite import KwtaSettings, RewriteConfig, TechniqueChoice, rewrite_model
from ortsparse.graph_rewrite.config import load_overrides
from ortsparse.graph_rewrite.genai import model_input
from ortsparse.measure.corpus import load_corpus_tokens
from ortsparse.zoo.models import model_path
from ortsparse.runtime import KVDecoder, kv_layout, open_session, thread_options


def profile(model, tokens, context: int, runs: int, prefix: str, warmup: int = 2, threads: int = 1,
            spinning: bool = False) -> tuple[collections.Counter, dict[str, float]]:
    """Per op type, the sum over its nodes of each node's median time (us), and per gated layer
    (layer numbers as N) the share of decode calls its measured dispatch sent to the pool."""
    options = thread_options(threads, spinning)
    plain = open_session(model, options)  # the prefill is not what this profiles
    prefill = KVDecoder(plain, kv_layout(plain, model))
    prefill.advance(tokens[:context])
    session = open_session(model, {**options, "enable_profiling": True, "profile_file_prefix": prefix})
    decoder = KVDecoder(session, prefill.layout)
    decoder.past, decoder.position = prefill.past, prefill.position  # the cache is a plain CPU value
    reset_metrics()
    for step in range(warmup + runs):
        decoder.advance(tokens[context + step:context + step + 1])
    events = json.load(open(session.end_profiling()))
    pool_shares = collections.defaultdict(list)  # the measured dispatch's choices (ops.md, Threads)
    for name, values in metrics().items():
        if "decode.pool_ratio" in values and not name.startswith("total/"):
            pool_shares[re.sub(r"layers\.\d+", "layers.N", name.split("/", 1)[1])].append(values["decode.pool_ratio"])
    shares = {layer: statistics.mean(values) for layer, values in pool_shares.items()}
    run_starts = sorted(e["ts"] for e in events if e.get("cat") == "Session" and e["name"] == "model_run")
    if len(run_starts) != warmup + runs:
        raise SystemExit(f"profile_decode: expected {warmup + runs} model_run events, found {len(run_starts)}")
    profiled_from = run_starts[warmup]
    per_node: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time") and event["ts"] >= profiled_from:
            per_node[event["args"].get("op_name"), event["name"]].append(event["dur"])
    # A node's median over the profiled steps: one slow step (a page fault, the machine's other load)
    # moves a mean of 16 by more than the differences this compares.
    per_op: collections.Counter = collections.Counter()
    # The step as a whole (model_run): what the nodes' sum leaves out is the executor's own time.
    per_op["(whole step)"] = statistics.median(e["dur"] for e in events if e.get("cat") == "Session"
                                               and e["name"] == "model_run" and e["ts"] >= profiled_from)
    per_layer: collections.Counter = collections.Counter()  # per node name, layer numbers as N
    for (op, name), durations in per_node.items():
        per_op[op] += statistics.median(durations)
        per_layer[re.sub(r"layers\.\d+", "layers.N", name.removesuffix("_kernel_time"))] += statistics.median(durations)
    return per_op, shares, per_layer


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=float, default=0.75)
    parser.add_argument("--target", default="both")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2, help="decode steps run before the profiled ones")
    parser.add_argument("--model", help="a KV-cache decoder or onnxruntime-genai folder (default: our SmolLM2 export)")
    parser.add_argument("--config", help="an override file (calibrate / tune) instead of --k / --target")
    parser.add_argument("--against", help="a rewritten model (e.g. tune's output folder) to profile against --model "
                                          "as it is, instead of rewriting --model here")
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads of both sessions; above one with spinning off, as the benchmarks run")
    parser.add_argument("--spinning", action="store_true", help="above one thread, ORT's default spinning pool")
    parser.add_argument("--by-node", action="store_true",
                        help="also print each node name's time summed over the layers (layers.N), largest first")
    args = parser.parse_args(argv)
    dense = onnx.load(str(model_input(args.model) if args.model else model_path("smollm2", "kv.torchscript")))
    if args.against:
        gated = onnx.load(str(model_input(args.against)))
    elif args.config:
        config = RewriteConfig(techniques={"kwta": TechniqueChoice(KwtaSettings(), enabled=False, target="all")},
                               overrides=load_overrides(args.config))
    else:
        config = RewriteConfig(techniques={"kwta": TechniqueChoice(KwtaSettings(k_frac=args.k), enabled=True,
                                                                   target=args.target)})
    if not args.against:
        gated, _ = rewrite_model(dense, config)
    tokens = load_corpus_tokens()
    with tempfile.TemporaryDirectory() as tmp:
        profiles = {"dense": profile(dense, tokens, args.context, args.runs, f"{tmp}/dense", args.warmup, args.threads,
                                    args.spinning),
                    "kwta": profile(gated, tokens, args.context, args.runs, f"{tmp}/kwta", args.warmup, args.threads,
                                    args.spinning)}
    columns = {name: per_op for name, (per_op, _, _) in profiles.items()}
    ops = sorted(set(columns["dense"]) | set(columns["kwta"]), key=lambda op: -max(c[op] for c in columns.values()))
    what = args.against or args.config or f"k {args.k} on {args.target}"
    pool = " (ORT's default, spinning pool)" if args.spinning else ""
    print(f"per decode step, context {args.context}, {args.threads} thread(s){pool}, {what} (us of node time)")
    print(f"{'op':24s} {'dense':>10s} {'kwta':>10s}")
    for op in ops[:12]:
        print(f"{op:24s} {columns['dense'][op]:10.0f} {columns['kwta'][op]:10.0f}")
    nodes = {name: sum(t for op, t in column.items() if op != "(whole step)") for name, column in columns.items()}
    print(f"{'nodes total':24s} {nodes['dense']:10.0f} {nodes['kwta']:10.0f}")
    for layer, share in sorted(profiles["kwta"][1].items()):
        print(f"decode calls on the pool, {layer}: {share:.0%}")
    if args.by_node:
        for name, (_, _, per_layer) in profiles.items():
            print(f"{name}: per node name over the layers (us)")
            for node, us in per_layer.most_common(12):
                print(f"  {us:8.0f}  {node}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
