"""Event-driven attention by heads on SmolLM2's onnxruntime-genai decoder (issue 28, decode half).

The real decode loop (ortsparse.measure.decode: corpus prompt, growing KV cache, teacher-forced
steps, models advanced round-robin in one process) over the folder's decoder graph in ONNX Runtime
sessions, 1 thread:

- `input`: the folder as built (com.microsoft.GroupQueryAttention, exact);
- `pages`: `--attn=popcount` (PopcountGroupQueryAttention, the recommended budgeted page selector);
- `event-*`: the same plus `--attn-event=1` at several budgets (`--attn-event-topk`: of the heads
  the certificate does not cover, the fraction that re-ranks; 1 = certified reuse only), with the
  default gap check (every 64 steps, 3% relative L2 per head output) or without it (`-nogap`), and
  the default staleness (8 reuses in a row) or `-age2`. Every loop opens fresh sessions (a gap
  check's disable lasts for the session).

Per model and context: decode tok/s (median step; min / median over rounds of the ratio to
`pages`), the (head, step) pairs reused with the certificate and by the budget (the op's metrics;
each model's attention nodes are renamed so its counters are its own), gap-check disables, and
quality on the decode steps themselves: dppl of the corpus's next tokens against `input` and
against `pages`, top-1 agreement with `pages`.

    python bench/bench_event_attention.py --contexts 4096 8192 --steps 256 --rounds 2 \\
        -o reports/event_attention_genai_int4
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import onnx

from ortsparse.benchmarking import machine_info, ratio_summary, report_header
from ortsparse.cli import add_rewrite_arguments, config_from_args
from ortsparse.graph_rewrite import rewrite_model
from ortsparse.measure import decode
from ortsparse.runtime import genai_decoder

MODELS = Path.home() / ".cache" / "ortsparse" / "models" / "smollm2"
CORPUS = MODELS / "corpus_britannica.npy"
EVENT = ["--attn=popcount", "--attn-event=1"]
VARIANTS = {  # name: topk (fraction of uncertified heads re-ranked), age (max reuses in a row), gap check
    "pages": ["--attn=popcount"],
    "event-cert": [*EVENT, "--attn-event-topk=1"],
    "event-0.5": [*EVENT, "--attn-event-topk=0.5"],
    "event-0": [*EVENT, "--attn-event-topk=0"],
    "event-0.5-nogap": [*EVENT, "--attn-event-topk=0.5", "--attn-event-gap-every=0"],
    "event-0-age2-nogap": [*EVENT, "--attn-event-topk=0", "--attn-event-age-max=2", "--attn-event-gap-every=0"],
    "event-0-nogap": [*EVENT, "--attn-event-topk=0", "--attn-event-gap-every=0"],
}


def rewritten(model_file: Path, flags: list[str], label: str) -> bytes:
    parser = argparse.ArgumentParser()
    add_rewrite_arguments(parser)
    config = config_from_args(parser.parse_args([str(model_file), *flags]))
    proto = onnx.load(str(model_file))  # external data read in: the session gets bytes
    out, _ = rewrite_model(proto, config)
    for node in out.graph.node:
        if node.op_type == "PopcountGroupQueryAttention":
            node.name = f"{node.name}@{label}"
    return out.SerializeToString()


def event_counts(raw: dict, label: str) -> dict:
    keys = ("event.heads_ranked", "event.reused_certified", "event.reused_budget", "event.gap_checks",
            "event.disabled")
    total = {k: 0.0 for k in keys}
    layers_disabled = 0
    for name, values in raw.items():
        if name.startswith("PopcountGroupQueryAttention/") and name.endswith(f"@{label}"):
            for k in keys:
                total[k] += float(values.get(k, 0.0))
            layers_disabled += bool(values.get("event.disabled"))
    pairs = total["event.heads_ranked"] + total["event.reused_certified"] + total["event.reused_budget"]
    return dict(pairs=pairs, certified=total["event.reused_certified"] / pairs if pairs else 0.0,
                budget=total["event.reused_budget"] / pairs if pairs else 0.0,
                gap_checks=total["event.gap_checks"], layers_disabled=layers_disabled)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="genai-int4", help="a folder under the model cache (default genai-int4)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--offset", type=int, default=0)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("-o", "--output", help="report stem (STEM.json, STEM.md)")
    args = parser.parse_args(argv)
    command = "python bench/bench_event_attention.py " + " ".join(sys.argv[1:] if argv is None else argv)
    info = genai_decoder(MODELS / args.model)
    tokens = np.load(CORPUS)
    models = {"input": str(info.model_file)}
    for label in args.variants:
        models[label] = rewritten(info.model_file, VARIANTS[label], label)
    rows = []
    for round_index in range(args.rounds):
        for context in args.contexts:
            # Fresh sessions per loop: a gap check disables reuse for a kernel's life (the session's),
            # which would carry over from one loop into the next.
            steppers = {label: decode.OrtStepper(source, 1, layout_source=info.model_file)
                        for label, source in models.items()}
            loop = decode.plan(context, args.steps, args.warmup, offset=args.offset + round_index * 97,
                               max_positions=info.context_length)
            print(f"round {round_index + 1}/{args.rounds}, context {context} (prompt {loop.prompt})", flush=True)
            result = decode.decode_loop(steppers, tokens, loop, reference="pages", log=print)
            raw = result.pop("_metrics")
            for label, r in result.items():
                nll_gap_input = float(np.expm1(r["mean_nll"] - result["input"]["mean_nll"]))
                row = dict(round=round_index, context=context, prompt=loop.prompt, model=label,
                           tokens_per_s=r["tokens_per_s"], speedup_vs_pages=r["tokens_per_s"] / result["pages"]["tokens_per_s"],
                           dppl_vs_input=nll_gap_input, dppl_vs_pages=r["dppl_vs_reference"],
                           top1_vs_pages=r["top1_agreement"], **event_counts(raw, label))
                rows.append(row)
                print(f"  {label}: {row['tokens_per_s']:.1f} tok/s (x{row['speedup_vs_pages']:.3f} vs pages), reused "
                      f"{row['certified']:.1%} certified + {row['budget']:.1%} budget, dppl vs input "
                      f"{row['dppl_vs_input']:+.2%}, vs pages {row['dppl_vs_pages']:+.2%}, disabled layers "
                      f"{row['layers_disabled']}", flush=True)
            del steppers
    summary = []
    for context in args.contexts:
        for label in models:
            group = [r for r in rows if r["context"] == context and r["model"] == label]
            summary.append(dict(context=context, model=label,
                                tokens_per_s=ratio_summary([r["tokens_per_s"] for r in group]),
                                speedup_vs_pages=ratio_summary([r["speedup_vs_pages"] for r in group]),
                                certified=float(np.mean([r["certified"] for r in group])),
                                budget=float(np.mean([r["budget"] for r in group])),
                                dppl_vs_input=float(np.mean([r["dppl_vs_input"] for r in group])),
                                dppl_vs_pages=float(np.mean([r["dppl_vs_pages"] for r in group])),
                                top1_vs_pages=float(np.mean([r["top1_vs_pages"] for r in group])),
                                layers_disabled=max(r["layers_disabled"] for r in group)))
    if args.output:
        payload = dict(machine=machine_info(), command=command, rows=rows, summary=summary,
                       loop=dict(steps=args.steps, warmup=args.warmup, rounds=args.rounds, offset=args.offset))
        Path(args.output + ".json").write_text(json.dumps(payload, indent=1))
        lines = report_header("Event-driven attention by heads: genai SmolLM2 decode", command, payload["machine"])
        lines += [__doc__.split("\n\n")[1], "",
                  f"{args.steps} timed teacher-forced decode steps after {args.warmup} warm-up, {args.rounds} round(s) "
                  "(round r starts 97·r tokens later in the corpus). Speed ratio vs `pages`: minimum / median over "
                  "rounds. Reuse, dppl and agreement: means over rounds (dppl of the decode steps' next-token NLL; "
                  "each model sees its own KV cache).", "",
                  "| context | model | tok/s (min-median) | vs pages min / median | reused certified | reused budget | "
                  "dppl vs input | dppl vs pages | top-1 vs pages | layers disabled |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for s in summary:
            lines.append(f"| {s['context']} | {s['model']} | {s['tokens_per_s']['min']:.1f}-{s['tokens_per_s']['median']:.1f} | "
                         f"**{s['speedup_vs_pages']['min']:.3f}** / {s['speedup_vs_pages']['median']:.3f} | "
                         f"{s['certified']:.1%} | {s['budget']:.1%} | {s['dppl_vs_input']:+.2%} | {s['dppl_vs_pages']:+.2%} | "
                         f"{s['top1_vs_pages']:.3f} | {s['layers_disabled']} |")
        Path(args.output + ".md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
