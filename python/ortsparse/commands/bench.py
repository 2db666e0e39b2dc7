"""``ortsparse bench``: the command over :mod:`ortsparse.measure.speed` (decode tokens/s in the real loop,
every model side by side in one process; docs/measure.md "Speed").

Models are cache names or ``NAME=PATH`` (KV-cache decoder graphs, onnxruntime-genai folders). The
technique flags (``--config``, ``--kwta-*``, ``--attn`` ...; only when given) add the rewrite of one
model (``--rewrite``, default the first): a KV graph is rewritten into a temporary file, a genai folder
into a temporary rewritten folder (:func:`ortsparse.graph_rewrite.genai.rewrite_genai_folder`) that
both runners use. ``--request`` measures whole requests instead (:mod:`ortsparse.measure.request`).
"""
from __future__ import annotations

import argparse
import dataclasses
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx

from ..benchmarking import check_report, write_report
from ..graph_rewrite import rewrite_model
from ..graph_rewrite.genai import rewrite_genai_folder
from ..graph_rewrite.output_paths import Inputs, resolve_report_stem
from ..graph_rewrite.techniques import flag_groups
from ..measure.corpus import vocabulary_of
from ..measure.decode import loop_tokens
from ..measure.request import RequestShape, parse_requests, request_bench, request_markdown
from ..measure.speed import CACHE_MODELS, RUNNERS, Candidate, add_loop_arguments, bench, markdown, resolve_model
from ..rewrite_flags import add_technique_arguments, config_from_args
from ..runtime import load_proto


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("models", nargs="*", metavar="MODEL", default=None,
                        help="models to compare, the first being the reference: cache names "
                             f"({', '.join(CACHE_MODELS)}) or NAME=PATH (a KV-cache .onnx, or an onnxruntime-genai "
                             "folder); default: ours ours-int4 ours-int8")
    parser.add_argument("--runners", nargs="+", default=list(RUNNERS), choices=RUNNERS,
                        help="how genai folders run: ort (their graph in an ORT session), og (onnxruntime_genai."
                             "Generator); default both")
    parser.add_argument("--rewrite", metavar="NAME", help="the model the technique flags rewrite (default the first)")
    parser.add_argument("--reference", metavar="NAME", help="the model the others are compared with (default the first)")
    add_loop_arguments(parser)
    parser.add_argument("--request", type=_requests, metavar="PROMPT:ANSWER[,...]",
                        help="measure whole requests instead of decode steps: each prompt in one call (time to first "
                             "token), then the answer's decode steps; e.g. 512:64,4096:256 (--contexts, --steps, "
                             "--warmup and --prefill-chunk do not apply)")
    parser.add_argument("--text", metavar="FILE",
                        help="a UTF-8 text to decode, tokenized with the first model's tokenizer (default: Python's "
                             "own documentation, pydoc_data.topics; --corpus gives token ids instead)")
    parser.add_argument("--tokenizer", metavar="PATH",
                        help="tokenizer.json (or its folder) for --text; default: beside the first model")
    parser.add_argument("-o", "--output", metavar="STEM",
                        help="also write the report as STEM.json and STEM.md (default: print the table only)")
    add_technique_arguments(parser)
    # A rewrite is added only when a technique flag is given: its default stays off the namespace
    # (argparse.SUPPRESS) so that run() can tell, and is filled in there.
    dests = {flag.dest for group in flag_groups() for flag in group.flags} | {"config"}
    for action in parser._actions:  # noqa: SLF001 (argparse has no public accessor)
        if action.dest in dests:
            _TECHNIQUE_DEFAULTS[action.dest] = action.default
            action.default = argparse.SUPPRESS


_TECHNIQUE_DEFAULTS: dict[str, Any] = {}


def _requests(text: str) -> list[RequestShape]:
    try:
        return parse_requests(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def technique_requested(args: argparse.Namespace) -> bool:
    """Whether the command line gave ``--config`` or any technique flag (KWTA's default ``auto``
    alone adds no rewrite: ``ortsparse bench genai-int4`` measures what is named). Fills in the
    defaults of the flags not given."""
    given = [dest for dest in _TECHNIQUE_DEFAULTS if dest in vars(args)]
    for dest, default in _TECHNIQUE_DEFAULTS.items():
        if dest not in vars(args):
            setattr(args, dest, default)
    return bool(given)


def rewritten_candidate(base: Candidate, config, workdir: Path, log: Callable[[str], None] = print) -> Candidate:
    """``base`` rewritten with ``config`` into ``workdir``: a KV graph as a file, a genai folder as a folder."""
    name = f"{base.name}+ortsparse"
    if base.is_genai:
        result = rewrite_genai_folder(base.source, workdir / name, config)
        log(result.report.summary())
        return Candidate(name, result.folder, base.runners)
    rewritten, report = rewrite_model(load_proto(base.source, load_weights=True), config)
    log(report.summary())
    path = workdir / f"{name}.onnx"  # a file: the sessions read it, Python holds no copy of the weights
    onnx.save(rewritten, str(path))
    return Candidate(name, path, ("ort",))


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    requested = technique_requested(args)
    if args.text and args.corpus:
        parser.error("--text and --corpus: give one (a text to tokenize, or token ids)")
    inputs = (Inputs().add(args.config, "the config file").add(args.corpus, "the corpus")  # never overwritten
              .add(args.text, "the text").add(args.tokenizer, "the tokenizer"))
    for spec in args.models or []:
        path = spec.split("=", 1)[1] if "=" in spec else spec
        if path and Path(path).exists():
            inputs.add_model(path, f"the input model {spec}")
    if args.output:
        args.output = resolve_report_stem(args.output, "bench")  # -o reports/: reports/bench.json
        check_report(args.output, inputs)
    config = config_from_args(args)
    specs = args.models or ["ours", "ours-int4", "ours-int8"]
    try:
        candidates = [resolve_model(spec, args.runners) for spec in specs]
    except (KeyError, FileNotFoundError, ValueError) as error:
        parser.error(str(error).strip("'\""))
    tokens, text = loop_tokens(text=args.text, corpus=args.corpus, model=candidates[0].source,
                               tokenizer=args.tokenizer, vocabulary=vocabulary_of(*(c.graph for c in candidates)))
    with tempfile.TemporaryDirectory(prefix="ortsparse-bench-") as workdir:
        if requested:
            names = [c.name for c in candidates]
            target = args.rewrite or names[0]
            if target not in names:
                parser.error(f"--rewrite {target}: not one of the models ({', '.join(names)})")
            candidates.append(rewritten_candidate(candidates[names.index(target)], config, Path(workdir)))
        try:
            if args.request:
                payload = request_bench(candidates, tokens, args.request, threads=args.threads, rounds=args.rounds,
                                        offset=args.offset, reference=args.reference, neighbour=args.neighbour,
                                        spinning=args.spinning)
            else:
                payload = bench(candidates, tokens, contexts=args.contexts, threads=args.threads, steps=args.steps,
                                warmup=args.warmup, prefill_chunk=args.prefill_chunk, offset=args.offset,
                                rounds=args.rounds, reference=args.reference, neighbour=args.neighbour,
                                spinning=args.spinning)
        except ValueError as error:  # a request or loop that does not fit the models or the corpus
            parser.error(str(error))
    command = getattr(args, "command_line", None) or "ortsparse bench"
    payload["command"] = command
    payload["text"] = text
    payload["models"] = {c.name: "rewritten, temporary" if c.name.endswith("+ortsparse") else str(c.source)
                         for c in candidates}
    if requested:
        payload["config"] = {"override_file": args.config, "rewrite": args.rewrite or candidates[0].name,
                             "techniques": {name: dataclasses.asdict(choice)
                                            for name, choice in config.techniques.items()}}
    table = request_markdown(payload, command) if args.request else markdown(payload, command,
                                                                                 "Decode speed, real loop")
    if not args.output:  # reports only where the user names them
        print(table)
        return 0
    paths = write_report(args.output, payload, table, protected=inputs)
    print("wrote", *paths)
    return 0
