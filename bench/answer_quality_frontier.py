"""Long-context attention settings judged at the point of use (docs/measure.md "Quality"): the input
onnxruntime-genai folder is rewritten once per setting (`--attn=popcount` plus the setting's flags),
and every rewrite decodes the same answer windows as the input model through the Generator, in one
loop (measure.answer_quality: each window's prompt read in one call, then the answer's decode steps
teacher-forced and scored; windows spread over the text). The report gives, per prefix length and
setting, the pooled dppl of the answer tokens vs exact attention with a 95% t-interval over windows,
top-1 agreement (mean and worst window), and the selection the setting makes.

A setting is NAME=FLAGS, FLAGS being rewrite-onnx's --attn-* flags separated by spaces, e.g.
  recommended="--attn=popcount"  wide="--attn=popcount --attn-topk 512 --attn-keep-recent 512"

usage: python bench/answer_quality_frontier.py MODEL_DIR --prefixes 4096 8192 --windows 8 6 --answer 256 \
         --settings recommended="--attn=popcount" ... -o reports/answer_quality_frontier
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
from pathlib import Path

from ortsparse import get_library_path
from ortsparse.benchmarking import check_report, command_line, machine_info, report_header, write_report
from ortsparse.graph_rewrite.genai import rewrite_genai_folder
from ortsparse.measure.answer_quality import answer_quality_of, plan_answer_windows
from ortsparse.measure.corpus import vocabulary_of
from ortsparse.measure.decode import loop_tokens, open_stepper
from ortsparse.rewrite_flags import add_technique_arguments, config_from_args
from ortsparse.runtime import context_length, genai_decoder


def setting_config(flags: str):
    """The RewriteConfig of a setting's rewrite-onnx flags (gating off unless the flags say)."""
    parser = argparse.ArgumentParser(prog="setting", exit_on_error=False)
    add_technique_arguments(parser)
    words = shlex.split(flags)
    if not any(word.startswith("--kwta") for word in words):
        words.append("--kwta=off")
    return config_from_args(parser.parse_args(words))


def share_library(folder: Path) -> Path:
    """The folder's copy of the op library replaced by a hard link to the one this process loads: the
    Generator's dlopen then finds the already loaded file (same inode), so the op counters
    measure.answer_quality reads (the cost proxy) are the ones its kernels bump, not a copy's. A hard
    link, not a symbolic one: genai resolves symbolic links and refuses a library outside the model's
    folder. Across file systems the copy stays, and the report has no keys-read figures."""
    copy = folder / "libortsparse_ops.so"
    if copy.is_file():
        linked = copy.with_name(copy.name + ".link")
        try:
            os.link(Path(get_library_path()).resolve(), linked)
        except OSError as error:
            print(f"{folder}: op library not shared ({error.strerror}): no keys-read figures", flush=True)
        else:
            os.replace(linked, copy)
    return folder


def certificates(row: dict) -> str:
    """Event-driven reuse and selective prefill figures of a report row (empty where off)."""
    parts = []
    if row.get("selection_event_ranked") or row.get("selection_event_reused_certified") \
            or row.get("selection_event_reused_budget"):
        parts.append(f"event: {row['selection_event_reused_certified']:.0f} certified, "
                     f"{row['selection_event_reused_budget']:.0f} budget, {row['selection_event_ranked']:.0f} ranked")
    if "selection_prefill_skipped" in row:
        parts.append(f"prefill skipped {row['selection_prefill_skipped']:.1%} of tiles")
    return "; ".join(parts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="the input onnxruntime-genai folder (exact attention: the reference)")
    parser.add_argument("--settings", nargs="+", required=True, metavar="NAME=FLAGS")
    parser.add_argument("--prefixes", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--windows", type=int, nargs="+", default=[8, 6],
                        help="windows per prefix (one number for all, or one per prefix)")
    parser.add_argument("--answer", type=int, default=256)
    parser.add_argument("--text", help="a UTF-8 text (default: Python's documentation)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("-o", "--output", required=True, metavar="STEM")
    args = parser.parse_args(argv)
    if len(args.windows) not in (1, len(args.prefixes)):
        parser.error("--windows: one number, or one per --prefixes")
    windows_per_prefix = args.windows * len(args.prefixes) if len(args.windows) == 1 else args.windows
    flags_of, settings = {}, {}
    for spec in args.settings:
        name, sep, flags = spec.partition("=")
        if not sep or not name or name == "reference":
            parser.error(f"--settings {spec!r}: give NAME=FLAGS (NAME not 'reference')")
        flags_of[name], settings[name] = flags, setting_config(flags)
    check_report(args.output)
    decoder = genai_decoder(args.model).model_file
    tokens, text = loop_tokens(text=args.text, corpus=None, model=Path(args.model), tokenizer=None,
                               vocabulary=vocabulary_of(decoder))
    command = command_line("python bench/answer_quality_frontier.py", argv)
    info = machine_info()
    rows = []

    def write(done: str) -> list[str]:
        """The report so far (rewritten after each prefix: a long run keeps what it measured)."""
        payload = {"machine": info, "command": command, "model": str(args.model), "text": text,
                   "answer": args.answer, "done": done, "rows": rows}
        lines = report_header("Long-context attention at the point of use", command, info)
        lines += [f"Input: {args.model} (exact attention, the reference). Text: {text}. Each window: the prompt read "
                  f"in one call by each model, then {args.answer} answer tokens decoded teacher-forced through the "
                  "Generator; only the answer steps are scored. dppl: pooled over the windows' answer steps, with a "
                  f"95% t-interval over windows; top-1: agreement with exact attention (mean, worst window). {done}",
                  "Keys read: keys scored exactly per head and answer step / keys cached (the cost proxy; page "
                  "bounds add 2 rows of D per page on top), pages certified: rows whose page choice no left-out page "
                  "could change; both from the op's counters, read only when one setting runs (rewrites share node "
                  "names).",
                  "Reuse / prefill: event-driven reuse (head-steps reused under the certificate, reused on budget, "
                  "ranked, per window) and the prompt's key tiles selective prefill skipped, where on.",
                  "", "| prefix | setting | flags | windows | dppl (95% interval) | top-1 (worst window) | keys read | "
                  "pages certified | reuse / prefill |", "|---|---|---|---|---|---|---|---|---|"]
        for row in rows:
            interval = "" if row["dppl_low"] is None else f" ({row['dppl_low']:+.2%} .. {row['dppl_high']:+.2%})"
            read, certified = (f"{row[key]:.1%}" if key in row else "" for key in
                               ("selection_keys_read", "selection_pages_certified"))
            lines.append(f"| {row['prefix']} | {row['setting']} | `{row['flags']}` | {row['windows']} | "
                         f"{row['dppl']:+.2%}{interval} | {row['top1_agreement']:.3f} ({row['top1_worst_window']:.3f}) | "
                         f"{read} | {certified} | {certificates(row)} |")
        write_report(args.output, payload, "\n".join(lines) + "\n")
        return lines

    with tempfile.TemporaryDirectory(prefix="ortsparse-frontier-") as workdir:
        folders = {name: share_library(rewrite_genai_folder(args.model, Path(workdir) / name, config).folder)
                   for name, config in settings.items()}
        for number, (prefix, count) in enumerate(zip(args.prefixes, windows_per_prefix), 1):
            plan = plan_answer_windows(tokens.size, prefix=prefix, answer=args.answer, windows=count,
                                       max_positions=context_length(decoder), source=text)
            print(f"prefix {prefix}: {count} windows of {plan.span} tokens of {text}", flush=True)
            reference = open_stepper(args.model, "og", args.threads)
            candidates = {name: open_stepper(folder, "og", args.threads) for name, folder in folders.items()}
            results = answer_quality_of(reference, candidates, tokens, plan, log=lambda line: print(line, flush=True))
            for name, result in results.items():
                rows.append({"prefix": prefix, "setting": name, "flags": flags_of[name], **result})
            del reference, candidates
            lines = write(f"Prefixes done: {number} of {len(args.prefixes)}.")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
