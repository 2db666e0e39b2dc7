"""``ortsparse tune MODEL --text FILE [--max-dppl 0.02] [--context N] -o OUT``: the command line of
:func:`ortsparse.tuning.tune.tune`.

Exit status: 0 written; 1 nothing written (the budget cannot be met with confidence, or the check
missed it); 2 bad input (a one-line error, e.g. a text too short, saying how long it must be);
3 written, but the tuned model decoded slower than MODEL on this machine (the last line says so).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from .. import flag_types
from ..measure.source import open_model
from ..measure.text import check_vocabulary, resolve_bos, tokenize_file


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = ("exit status: 0 written; 1 nothing written (the budget cannot be met with confidence, or the "
                     "check missed it); 2 bad input; 3 written, but it decoded slower than MODEL here")
    parser.add_argument("model", metavar="MODEL", help="an ONNX decoder (.onnx) or an onnxruntime-genai folder")
    parser.add_argument("--text", metavar="FILE", required=True,
                        help="a UTF-8 text like the model's real inputs (>= ~20k tokens writes reliably)")
    parser.add_argument("--tokenizer", metavar="PATH", help="tokenizer.json (or its folder); default: beside MODEL")
    parser.add_argument("--bos", default="auto", metavar="auto|none|ID",
                        help="the token every window starts with: auto (default) = BOS when the tokenizer adds one "
                             "(tokenizer_config.json add_bos_token, else tokenizer.json's template), none, or an id")
    parser.add_argument("-o", "--output", metavar="OUT", required=True,
                        help="the tuned model (.onnx), or a new folder for a genai MODEL")
    parser.add_argument("--max-dppl", type=flag_types.finite_float(0.0, 10.0, min_open=True, max_open=True),
                        default=0.02,
                        help="perplexity budget on the check windows (default 0.02)")
    parser.add_argument("--margin", type=flag_types.fraction, default=None,
                        help="also keep the calibration bound within margin x budget (default: the bound's own "
                             "margin, from the measured window-to-window spread)")
    parser.add_argument("--context", type=flag_types.positive_int, default=None,
                        help="the context the model will run at; >= 2048 also rewrites attention selection, "
                             "checked on answer tokens after prompts of this length from the held-out parts")
    parser.add_argument("--reference", metavar="MODEL", help="measure dppl against this model, e.g. the fp32 model of "
                        "a quantized MODEL (the budget then covers quantization and gating together)")
    parser.add_argument("--method", choices=["allocated", "uniform"], default="allocated",
                        help="per-layer sparsities from measured sensitivities (default), or one for every layer")
    parser.add_argument("--threads", type=flag_types.threads, default=1,
                        help="intra-op threads of the layer speed measurement and the speed check (default 1)")
    parser.add_argument("--no-speed-aware", dest="speed_aware", action="store_false",
                        help="value every skipped weight byte alike (gating each layer from 10%% sparsity) instead "
                             "of by the time gating that layer measurably saves on this machine")
    parser.add_argument("--gate-head", action="store_true",
                        help="make the LM head a candidate unit like any layer, gated where its measured loss and "
                             "speed say it pays (a large-vocabulary head is much of the bytes: Gemma-3's is 63%%)")
    parser.add_argument("--windows", type=flag_types.int_in(1, 256), default=None, metavar="N",
                        help="calibration windows, and at most as many check windows (default: every window the "
                             "text gives, within ~15 min of loss passes)")
    parser.add_argument("--report", metavar="STEM", help="report files STEM.json/.md/.png (default: OUT.tune)")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .tune import tune, tune_outputs

    if not Path(args.model).exists():
        parser.error(f"model {args.model} does not exist")
    source = open_model(args.model, args.tokenizer)
    protected = {Path(args.text): "the text", source.tokenizer: "the tokenizer"}
    tune_outputs(args.model, args.output, args.report, protected, args.reference)  # before reading the text
    tokens = tokenize_file(args.text, source.tokenizer)
    check_vocabulary(tokens, source.vocabulary, tokenizer=source.tokenizer)
    bos = resolve_bos(args.bos, args.model, args.tokenizer, source.vocabulary)
    result = tune(source, tokens, args.output, max_dppl=args.max_dppl, margin=args.margin, context=args.context,
                  threads=args.threads, report_stem=args.report, reference=args.reference, method=args.method,
                  windows=args.windows, command=getattr(args, "command_line", None), bos=bos, protected=protected,
                  speed_aware=args.speed_aware, gate_head=args.gate_head)
    return result.exit_status
