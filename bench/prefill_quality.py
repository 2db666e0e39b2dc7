"""What selective prefill costs in quality on a real model: a prompt of N corpus tokens is prefilled
by a candidate model (chunks of --chunk tokens, each a tiled prompt call), then the next --answer
tokens are fed teacher-forced in one call of the *reference* model over the candidate's KV cache.
Reported per candidate: perplexity of those answer tokens vs the reference's own prefill (dppl),
agreement of their top-1 predictions with the reference's, the prompt time ratio (the reference's
prompt time / the candidate's, both timed in this process, alternated window by window), and the
fraction of prompt tiles skipped (metric prefill.skipped_ratio).

The models are onnxruntime-genai folders (or KV decoder graphs) rewritten from the same input,
e.g. `ortsparse rewrite genai-int4 -o F --attn=popcount [--attn-prefill=budget]`. The prompt's
approximation changes every later layer's K/V: the answer decodes from that cache, exactly.

usage: python bench/prefill_quality.py REF CAND [CAND ...] --lengths 4096 8192 --windows 2 -o OUT
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import ortsparse
from ortsparse.benchmarking import check_report, command_line, machine_info, report_header, write_report
from ortsparse.measure.decode import open_stepper
from ortsparse.measure.perplexity import score_logits


def continuation_logits(stepper, ids: np.ndarray) -> np.ndarray:
    """Feeds ids after the stepper's cache in one call; the logits of every fed position [n, vocab]."""
    return stepper.decoder.advance(ids, every=True)


def prefill(stepper, prompt: np.ndarray, chunk: int) -> float:
    """Resets the stepper and feeds the prompt in chunks; wall seconds."""
    stepper.reset()
    t0 = time.perf_counter()
    for start in range(0, len(prompt), chunk):
        stepper.advance(prompt[start:start + chunk])
    return time.perf_counter() - t0


def skipped_ratio() -> float:
    """Tiles skipped over every attention node's prompt calls since the last reset."""
    tiles = skipped = 0.0
    for key, m in ortsparse.metrics().items():
        if "prefill.tiles" in m:
            tiles += m["prefill.tiles"]
            skipped += m["prefill.tiles"] * m["prefill.skipped_ratio"]
    return skipped / tiles if tiles else 0.0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reference", help="model whose prefill is exact (genai folder or KV graph)")
    parser.add_argument("candidates", nargs="+", help="models with selective prefill, NAME=PATH or PATH")
    parser.add_argument("--corpus", default=str(Path.home() / ".cache/ortsparse/models/smollm2/corpus_britannica.npy"))
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--answer", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=2048, help="prompt tokens per call")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--note", default="")
    parser.add_argument("-o", "--output", required=True)
    args = parser.parse_args(argv)
    tokens = np.load(args.corpus).astype(np.int64).reshape(-1)
    check_report(args.output)
    named = [c.split("=", 1) if "=" in c else (Path(c).name, c) for c in args.candidates]
    ref = open_stepper(args.reference, "ort", args.threads)
    cands = {name: open_stepper(path, "ort", args.threads) for name, path in named}
    rows = []
    for length in args.lengths:
        span = length + args.answer
        starts = np.linspace(0, len(tokens) - span - 1, args.windows).astype(int)
        result = {name: {"nll": [], "ref_nll": [], "agree": [], "ratio": [], "skipped": []} for name in cands}
        for start in starts:
            prompt, answer = tokens[start:start + length], tokens[start + length:start + span + 1]
            ref_time = prefill(ref, prompt, args.chunk)
            ref_logits = continuation_logits(ref, answer[:-1])
            ref_nll = score_logits(ref_logits, answer[1:])[0]
            for name, cand in cands.items():
                ortsparse.reset_metrics()
                cand_time = prefill(cand, prompt, args.chunk)
                skipped = skipped_ratio()
                # the answer: the reference model over the candidate's cache
                ref.decoder.past, ref.decoder.position = cand.decoder.past, cand.decoder.position
                logits = continuation_logits(ref, answer[:-1])
                r = result[name]
                r["nll"].append(score_logits(logits, answer[1:])[0])
                r["ref_nll"].append(ref_nll)
                r["agree"].append(float((logits.argmax(-1) == ref_logits.argmax(-1)).mean()))
                r["ratio"].append(ref_time / cand_time)
                r["skipped"].append(skipped)
        for name, r in result.items():
            nll = float(np.mean([np.mean(x) for x in r["nll"]]))
            ref_nll = float(np.mean([np.mean(x) for x in r["ref_nll"]]))
            row = {"candidate": name, "length": length, "windows": len(starts), "ppl": float(np.exp(nll)),
                   "ref_ppl": float(np.exp(ref_nll)), "dppl": float(np.exp(nll - ref_nll) - 1.0),
                   "top1_agreement": float(np.mean(r["agree"])), "prompt_ratio_min": min(r["ratio"]),
                   "prompt_ratio_median": statistics.median(r["ratio"]), "skipped": float(np.mean(r["skipped"]))}
            rows.append(row)
            print(f"{name} prompt {length}: dppl {row['dppl']:+.2%} (ppl {row['ppl']:.3f} vs {row['ref_ppl']:.3f}), "
                  f"top-1 agreement {row['top1_agreement']:.3f}, prompt time ratio min {row['prompt_ratio_min']:.2f} "
                  f"median {row['prompt_ratio_median']:.2f}, tiles skipped {row['skipped']:.1%}", flush=True)
    payload = {"command": command_line("python bench/prefill_quality.py", argv if argv is not None else sys.argv[1:]),
               "machine": machine_info(), "note": args.note, "rows": rows}
    lines = report_header("Selective prefill: answer quality after a selectively prefilled prompt", payload["command"],
                          payload["machine"])
    lines += [__doc__.split("\n\n")[0].replace("\n", " "), ""] + ([args.note, ""] if args.note else [])
    lines += ["| candidate | prompt | windows | dppl | top-1 agreement | prompt time ratio min / median | tiles skipped |",
              "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['candidate']} | {r['length']} | {r['windows']} | {r['dppl']:+.2%} | {r['top1_agreement']:.3f} | "
                     f"{r['prompt_ratio_min']:.2f} / {r['prompt_ratio_median']:.2f} | {r['skipped']:.1%} |")
    print("wrote", *write_report(args.output, payload, "\n".join(lines) + "\n"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
