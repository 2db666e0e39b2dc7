"""``ortsparse quality``: a rewritten model against its dense original, by the kind of model.

The library underneath (use it directly from Python):

- :mod:`ortsparse.measure.perplexity` (``perplexity``, ``compare_lm``): language models on token
  windows of :mod:`ortsparse.measure.corpus`;
- :mod:`ortsparse.measure.embeddings` (``sentence_embeddings``, ``compare_embeddings``): sentence
  embedding cosine of encoders;
- :mod:`ortsparse.measure.output_error` (``compare_outputs``, ``gated_layers_exact``): any model,
  every output on generated inputs against a budget.

This module picks the kind (:func:`detect_kind`), rewrites in memory when no rewritten file is
given (:func:`rewrite_in_memory`), prints and writes the JSON report. The rewritten side's
``ortsparse.metrics()`` are reset before it runs and reported afterwards (keep ratios). See
docs/measure.md.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import onnx

from .. import flag_types
from ..benchmarking import json_default, versions
from ..graph_rewrite import ModelFileError, rewrite_model
from ..graph_rewrite.as_decoded import as_decoded
from ..graph_rewrite.genai import model_input
from ..measure.corpus import check_windows, default_corpus, default_sentences, load_corpus_tokens
from ..measure.embeddings import compare_embeddings
from ..measure.output_error import compare_outputs
from ..measure.perplexity import compare_lm, describe_spread
from ..measure.text import resolve_bos, text_tokens
from ..rewrite_flags import add_technique_arguments, config_from_args
from ..runtime import context_length, load_proto, vocab_size

EXIT_OK, EXIT_OVER_BUDGET, EXIT_USAGE = 0, 1, 2
KINDS = ("auto", "lm", "embedding", "generic")


def rewrite_in_memory(model: Any, config: Any = None):
    """(rewritten ModelProto, RewriteReport) of a path (external data loaded into memory, so the
    result runs from memory) or ModelProto; nothing is written."""
    if isinstance(model, (bytes, bytearray)):
        model = onnx.load_from_string(bytes(model))
    if not isinstance(model, onnx.ModelProto):
        model = load_proto(model, load_weights=True)  # external data under ONNX Runtime's rule
    return rewrite_model(model, config)


def detect_kind(model: Any) -> str:
    """``lm`` (a ``logits`` output; a KV-cache decoder is scored with an empty past),
    ``embedding`` (``last_hidden_state`` output) or ``generic``."""
    graph = load_proto(model).graph
    outputs = {o.name for o in graph.output}
    if "logits" in outputs:
        return "lm"
    if "last_hidden_state" in outputs:
        return "embedding"
    return "generic"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL.onnx",
                        help="the dense model (an onnxruntime-genai folder: its decoder graph)")
    parser.add_argument("--rewritten", metavar="OUT.onnx",
                        help="the rewritten model or genai folder; without it MODEL is rewritten in memory with the "
                             "flags below")
    parser.add_argument("--kind", choices=KINDS, default="auto",
                        help="lm: perplexity (a KV-cache decoder, e.g. a genai graph, prefills each window from an "
                             "empty past); embedding: sentence cosine; generic: output error on generated "
                             "inputs; auto (default): lm if there is a logits output, embedding if "
                             "last_hidden_state, else generic")
    lm = parser.add_argument_group("lm")
    lm.add_argument("--corpus", metavar="TOKENS.npy",
                    help="1-D token ids (default: the cache's smollm2/corpus_britannica.npy)")
    lm.add_argument("--text", metavar="FILE", help="a UTF-8 text to score instead of --corpus (tokenized with "
                    "--tokenizer, else the tokenizer.json beside MODEL)")
    lm.add_argument("--tokenizer", metavar="PATH", help="tokenizer.json (or its folder) for --text")
    lm.add_argument("--bos", default="auto", metavar="auto|none|ID",
                    help="the token every window starts with: auto (default) = BOS when the model's tokenizer adds "
                         "one (tokenizer_config.json add_bos_token, else tokenizer.json's template), none, or an id")
    lm.add_argument("--windows", type=flag_types.positive_int, default=8, help="number of windows (default 8)")
    lm.add_argument("--window-len", type=flag_types.window_len, default=512, help="tokens per window (default 512)")
    lm.add_argument("--offset", type=flag_types.non_negative_int, default=0,
                    help="first token of the first window (default 0)")
    lm.add_argument("--max-dppl", type=flag_types.any_finite, metavar="FRAC",
                    help="exit 1 when dppl exceeds this")
    lm.add_argument("--prefix", type=flag_types.positive_int, metavar="N",
                    help="quality at the point of use: each window's first N tokens are read as a prompt (one call), "
                         "then --answer tokens are decoded teacher-forced and only those are scored, MODEL and the "
                         "rewritten model each running the whole window (a genai folder through the Generator); "
                         "--windows windows spread over the text (default text: Python's documentation)")
    lm.add_argument("--answer", type=flag_types.positive_int, default=256, metavar="M",
                    help="answer tokens scored after each --prefix prompt (default 256)")
    emb = parser.add_argument_group("embedding")
    emb.add_argument("--sentences", metavar="FILE.npz",
                     help="input_ids/attention_mask[/token_type_ids] (default: the cache's minilm/sentences.npz)")
    emb.add_argument("--batch-size", type=flag_types.positive_int, default=32)
    emb.add_argument("--min-cosine", type=flag_types.finite_float(-1.0, 1.0), metavar="COS",
                     help="exit 1 when the mean cosine is below this")
    gen = parser.add_argument_group("generic")
    gen.add_argument("--runs", type=flag_types.positive_int, default=4, help="generated input sets (default 4)")
    gen.add_argument("--shape", action="append", metavar="SPEC", help="dynamic dims: dim=INT or input=AxBxC")
    gen.add_argument("--budget", type=flag_types.non_negative_float,
                     help="relative L2 budget (default 1e-4 if exact, else 0.5)")
    gen.add_argument("--seed", type=flag_types.seed, default=0)
    add_technique_arguments(parser)
    parser.add_argument("--threads", type=flag_types.threads, default=None, help="intra-op threads (default: ORT's)")
    parser.add_argument("--json", metavar="FILE", help="write the result as JSON")
    parser.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors")


def _format(result: Mapping[str, Any]) -> str:
    kind = result["kind"]
    lines = []
    if kind == "lm":
        lines.append(f"perplexity: {result['window_construction']}")
        lines.append(f"  {'model':10s} {'ppl':>10s} {'nll':>8s}")
        lines.append(f"  {'dense':10s} {result['ppl_dense']:10.4f} {result['nll_dense']:8.4f}")
        lines.append(f"  {'rewritten':10s} {result['ppl_rewritten']:10.4f} {result['nll_rewritten']:8.4f}"
                     "   (every row computed as a decode step computes it)")
        lines.append(f"  {describe_spread(result)}   top-1 agreement {result['top1_agreement']:.4f}")
    elif kind == "embedding":
        lines.append(f"embedding cosine over {result['sentences']} sentences: mean {result['cosine_mean']:.6f}  "
                     f"min {result['cosine_min']:.6f} (sentence {result['cosine_min_index']})")
    else:
        lines.append(result["text"])
    ops = (result.get("metrics") or {}).get("ops", {})
    for op, values in ops.items():
        ratio = values.get("keep_ratio")
        if ratio is not None:
            lines.append(f"  {op}: keep ratio {ratio:.4f} over {len(result['metrics'].get('nodes', {}))} node(s)")
    weighted = (result.get("metrics") or {}).get("weighted_keep_ratio")
    if weighted is not None:
        lines.append(f"  gated weight bytes read: {weighted:.4f} of the gated layers'")
    return "\n".join(lines)


def _candidate_model(args: argparse.Namespace, workdir: Path, say) -> Path:
    """The rewritten model the answer windows run: --rewritten, else MODEL rewritten with the flags
    into ``workdir`` (a genai folder as a folder, so the Generator runs it as an app would)."""
    from ..graph_rewrite.genai import rewrite_genai_folder

    if args.rewritten:
        return Path(args.rewritten)
    config = config_from_args(args)
    if Path(args.model).is_dir():
        result = rewrite_genai_folder(args.model, workdir / "rewritten", config)
        say(result.report.summary())
        return result.folder
    rewritten, report = rewrite_in_memory(args.model, config)
    say(report.summary())
    path = workdir / "rewritten.onnx"
    onnx.save(rewritten, str(path))
    return path


def run_answer_quality(args: argparse.Namespace, parser: argparse.ArgumentParser, inputs, say) -> int:
    """``--prefix``: :mod:`ortsparse.measure.answer_quality` on MODEL vs the rewritten model."""
    import tempfile

    from ..graph_rewrite.output_paths import write_text_files
    from ..measure.answer_quality import answer_quality, describe, plan_answer_windows
    from ..measure.corpus import vocabulary_of
    from ..measure.decode import loop_tokens, open_stepper

    if args.text and args.corpus:
        parser.error("give --text or --corpus, not both")
    for path, what in ((args.model, "model"), (args.rewritten, "rewritten model")):
        if path and not Path(path).exists():
            parser.error(f"{what} {path} does not exist")
    reference_source = Path(args.model)
    decoder = model_input(args.model)
    tokens, text = loop_tokens(text=args.text, corpus=args.corpus, model=reference_source, tokenizer=args.tokenizer,
                               vocabulary=vocabulary_of(decoder))
    try:
        windows = plan_answer_windows(tokens.size, prefix=args.prefix, answer=args.answer, windows=args.windows,
                                      max_positions=context_length(decoder), source=text)
    except ValueError as error:
        parser.error(str(error))
    runner = "og" if reference_source.is_dir() else "ort"
    threads = args.threads or 1
    with tempfile.TemporaryDirectory(prefix="ortsparse-quality-") as workdir:
        candidate_source = _candidate_model(args, Path(workdir), say)
        if runner == "og" and not Path(candidate_source).is_dir():
            parser.error(f"rewritten model {candidate_source}: MODEL is a genai folder, so give the rewritten folder")
        say(f"answer quality: {len(windows.offsets)} windows of {args.prefix} + {args.answer} tokens of {text}"
            f"{' (overlapping: the text is short)' if windows.overlapping else ''}, runner {runner}, {threads} thread(s)")
        result = answer_quality(open_stepper(reference_source, runner, threads),
                                open_stepper(candidate_source, runner, threads), tokens, windows, log=say)
    result.update({"kind": "answer", "text": text, "runner": runner, "threads": threads})
    say(describe(result))
    code = EXIT_OVER_BUDGET if args.max_dppl is not None and result["dppl"] > args.max_dppl else EXIT_OK
    if args.json:
        document = {"command": getattr(args, "command_line", None), "model": str(args.model),
                    "rewritten": args.rewritten or "rewritten with the flags, temporary", "versions": versions(),
                    "result": result}
        write_text_files({args.json: ("JSON report", json.dumps(document, indent=2, default=json_default) + "\n")},
                         inputs)
        say(f"wrote {args.json}")
    if code == EXIT_OVER_BUDGET:
        print("quality: over the given budget", file=sys.stderr)
    return code


def _lm_windows(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[Any, Path, Any]:
    """(token ids, their source, the BOS choice) of an LM comparison, the windows checked against them."""
    if args.text:
        if args.corpus:
            parser.error("give --text or --corpus, not both")
        corpus = Path(args.text)
        tokens = text_tokens(args.text, args.model if args.tokenizer is None else None, args.tokenizer,
                             vocab_size(args.model, default=None))
    else:
        corpus = Path(args.corpus) if args.corpus else default_corpus()
        if not corpus.is_file():
            parser.error(f"token corpus {corpus} not found (give --corpus TOKENS.npy or run `ortsparse models`)")
        tokens = load_corpus_tokens(corpus, vocab_size(args.model, default=None))
    bos = resolve_bos(args.bos, args.model, args.tokenizer, vocab_size(args.model, default=None))
    check_windows(tokens.size, args.windows, args.window_len, offset=args.offset, source=str(corpus),
                  max_positions=context_length(args.model), bos=bos.id)
    return tokens, corpus, bos


def _score_lm(args: argparse.Namespace, parser: argparse.ArgumentParser, rewritten: Any, windows: tuple[Any, Path, Any],
              options: Mapping[str, Any] | None, progress: bool) -> tuple[dict[str, Any], int]:
    """compare_lm of MODEL and the rewritten model on the windows: (result, exit status)."""
    import onnxruntime

    tokens, corpus, bos = windows
    onnxruntime.set_default_logger_severity(4)  # a failing run is reported below, in one line
    # Teacher-forced windows are one call each: measured as decode steps compute every row (prompts
    # gated and selecting keys), the loss generated tokens see (graph_rewrite/as_decoded.py).
    decoded = as_decoded(load_proto(rewritten, load_weights=True))
    try:
        result = compare_lm(args.model, decoded, tokens, args.windows, args.window_len, offset=args.offset,
                            session_options=options, progress=progress, bos=bos)
    except Exception as error:
        if not type(error).__module__.startswith("onnxruntime"):
            raise
        reason = str(error).splitlines()[0].split("Status Message:")[-1].strip()
        parser.error(f"onnxruntime could not score windows of {args.window_len} tokens on {args.model}: "
                     f"{reason} (a --window-len longer than the model's context does this)")
    finally:
        onnxruntime.set_default_logger_severity(2)
    result["corpus"] = str(corpus)
    result["rewritten_rows"] = "every row as a decode step computes it (max_gated_rows = prefill_rows = 0)"
    over = args.max_dppl is not None and result["dppl"] > args.max_dppl
    return result, EXIT_OVER_BUDGET if over else EXIT_OK


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from ..graph_rewrite.output_paths import Inputs, check_outputs, write_text_files
    from ..measure.text import tokenizer_read

    say = (lambda text: None) if args.quiet else print
    inputs = (Inputs().add_model(args.model).add_model(args.rewritten, "the rewritten model")  # never overwritten
              .add(args.corpus, "the corpus").add(args.text, "the text").add(args.sentences, "the sentence set")
              .add(args.config, "the config file"))
    if args.text:
        inputs.add(tokenizer_read(args.model, args.tokenizer), "the tokenizer")
    check_outputs([(args.json, "JSON report")], inputs)  # before the long run
    if args.prefix is not None:
        return run_answer_quality(args, parser, inputs, say)
    if not Path(args.model).exists():
        parser.error(f"model {args.model} does not exist")
    try:
        args.model = str(model_input(args.model))
        if args.rewritten and Path(args.rewritten).is_dir():
            args.rewritten = str(model_input(args.rewritten))
    except ModelFileError as error:
        parser.error(str(error))
    kind = detect_kind(args.model) if args.kind == "auto" else args.kind
    options = {"intra_op_num_threads": args.threads} if args.threads else None
    if args.rewritten and not Path(args.rewritten).is_file():
        parser.error(f"rewritten model {args.rewritten} does not exist")
    if kind == "lm":  # the text and its windows are checked before the rewrite
        windows = _lm_windows(args, parser)
    report = None
    if args.rewritten:
        rewritten: Any = args.rewritten
    else:
        rewritten, report = rewrite_in_memory(args.model, config_from_args(args))
        say(report.summary())
    progress = not args.quiet and sys.stderr.isatty()
    code = EXIT_OK
    if kind == "lm":
        result, code = _score_lm(args, parser, rewritten, windows, options, progress)
    elif kind == "embedding":
        sentences = Path(args.sentences) if args.sentences else default_sentences()
        if not sentences.is_file():
            parser.error(f"sentence set {sentences} not found (give --sentences FILE.npz or run `ortsparse models`)")
        result = compare_embeddings(args.model, rewritten, sentences, args.batch_size, session_options=options)
        result["sentences_file"] = str(sentences)
        if args.min_cosine is not None and result["cosine_mean"] < args.min_cosine:
            code = EXIT_OVER_BUDGET
    else:
        result = compare_outputs(args.model, rewritten, args.runs, args.shape, budget=args.budget, seed=args.seed)
        if not result["passed"]:
            code = EXIT_OVER_BUDGET
    say(_format(result))
    if args.json:
        document = {"command": getattr(args, "command_line", None),
                    "model": str(args.model), "rewritten": args.rewritten or "in memory",
                    "rewrite": report.to_dict()["counts"] if report is not None else None,
                    "config": report.to_dict()["config"] if report is not None else None,
                    "versions": versions(), "result": {k: v for k, v in result.items() if k != "text"}}
        write_text_files({args.json: ("JSON report", json.dumps(document, indent=2, default=json_default) + "\n")}, inputs)
        say(f"wrote {args.json}")
    if code == EXIT_OVER_BUDGET:
        print("quality: over the given budget", file=sys.stderr)
    return code
