"""Command line: ``rewrite-onnx IN.onnx -o OUT.onnx [flags]`` and ``ortsparse <command> ...``.

Exit codes: 0 ok (also when no layer matched: the output is then the unchanged model, with a
note), 1 ``--verify`` found an error over budget, 2 usage or input errors, one line each (bad file
or flag, an output that aliases an input or is a device/FIFO, external data outside the model's
folder, unwritable output, invalid override file, missing native library for --verify), 128 + N
interrupted by signal N (nothing moved into place). File rules: graph_rewrite/output_paths.py.
Every command runs under :func:`_execute`: whatever the user's files raise from the libraries below
(OSError, ValueError, onnx's and onnxruntime's refusals), wherever in the command and also after
its long part, is one line and exit 2; outputs are staged, so nothing is left half-written.

New subcommands (models, quality, bench, validate, sweep, calibrate) are one entry in
``SUBCOMMANDS``: a help line, a function adding the arguments and a function running them.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from . import flag_types
from .rewrite_flags import add_technique_arguments, config_from_args

EXIT_OK = 0
EXIT_VERIFY_FAILED = 1
EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line (the usage block is behind --help), exit 2."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _version() -> str:
    from . import __version__

    return f"ortsparse {__version__}"


def add_rewrite_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", nargs="?", metavar="IN.onnx",
                        help="model to rewrite (never modified); an onnxruntime-genai folder (or its model.onnx "
                             "with a folder as -o) gives a new runnable genai folder")
    parser.add_argument("-o", "--output", metavar="OUT.onnx", help="where to write the rewritten model (or folder)")
    add_technique_arguments(parser)

    check = parser.add_argument_group("checking")
    check.add_argument("--verify", type=flag_types.non_negative_int, default=0, metavar="N",
                       help="run original and rewritten in onnxruntime on N generated input sets")
    flag_types.add_input_arguments(check, prefix="verify-")
    check.add_argument("--no-self-check", action="store_true",
                       help="skip the one-input comparison an approximate rewrite without --config runs to print "
                            "what its (uncalibrated) settings cost")
    check.add_argument("--no-check", action="store_true",
                       help="skip onnx.checker.check_model(full_check=True) on the output")
    check.add_argument("--no-fuse", action="store_true",
                       help="keep one node per layer (default: quantized gated layers reading the same input "
                            "with the same settings become one op; exact)")

    info = parser.add_argument_group("information")
    info.add_argument("--list-rules", action="store_true", help="print the rewrite rules and exit")
    info.add_argument("--list-layers", action="store_true",
                      help="print the linear layers, their class and what a rewrite would do, and exit")
    info.add_argument("--report", metavar="FILE", help="also write the per-layer report as JSON")
    info.add_argument("-q", "--quiet", action="store_true", help="print only errors")
    info.add_argument("--version", action="version", version=_version())


def _print_rules() -> None:
    from .graph_rewrite import describe_rules
    from .graph_rewrite.attention_rules import (
        describe_rules as describe_attention_rules,
    )

    print("Rewrite rules (a layer takes the first that matches):")
    for name, before_after, _ in describe_rules():
        print(f"  {name:26s} {before_after}")
    print("Attention rules (--attn; an attention core takes the first that matches):")
    for name, before_after, _ in describe_attention_rules():
        print(f"  {name:26s} {before_after}")


def _read_by_flags(args: argparse.Namespace):
    """What the rewrite reads besides the model file (no output may be, hold or lie in one of
    them): the config file, and the folder when the model was named by its genai folder."""
    from .graph_rewrite.output_paths import Inputs

    inputs = Inputs().add(getattr(args, "config", None), "the config file")
    if args.input and Path(args.input).is_dir():
        inputs.add_folder(args.input, "the source folder")
    return inputs


def _verify(args: argparse.Namespace, report, say: Callable[[str], None], progress: bool, shapes,
            original=None, rewritten=None) -> int:
    from .verify import DEFAULT_BUDGET, EXACT_BUDGET, verify_models

    original, rewritten = original or args.input, rewritten or args.output
    if report.exact:
        budget, reason = EXACT_BUDGET, "tight: every rewritten layer keeps all inputs (k=1, threshold=0)"
    else:
        budget = DEFAULT_BUDGET if args.verify_budget is None else args.verify_budget
        reason = "approximate layers present; set with --verify-budget"
    try:
        result = verify_models(original, rewritten, runs=args.verify, budget=budget, budget_reason=reason,
                               shapes=shapes, seed=args.verify_seed, progress=progress)
    except Exception as error:
        if not type(error).__module__.startswith("onnxruntime"):
            raise
        print(f"verify failed: onnxruntime could not run the models: {error}", file=sys.stderr)
        return EXIT_VERIFY_FAILED
    say(result.format())
    if not result.passed:
        worst = max(result.outputs, key=lambda o: o.rel_l2)
        print(f"verify failed: output {worst.name!r} relative L2 error {worst.rel_l2:.3e} > budget {budget:g}; "
              f"the rewritten model was kept at {rewritten}", file=sys.stderr)
        return EXIT_VERIFY_FAILED
    return EXIT_OK


def _self_check(args: argparse.Namespace, report, say: Callable[[str], None], original, rewritten,
                shapes) -> None:
    """An approximate rewrite without --config uses settings nobody measured on the user's data: run
    original and rewritten on one generated input (ortsparse.verify, fixed seed) and print what they
    cost, pointing at `ortsparse tune`. Informative: it never fails the rewrite."""
    if args.quiet or args.no_self_check or args.config or report.exact:
        return
    from .verify import verify_models

    try:
        result = verify_models(original, rewritten, runs=1, shapes=shapes, seed=0)
    except Exception as error:  # a model verify cannot feed (or no native library) keeps its rewrite
        say(f"self-check skipped: {(str(error).splitlines() or [type(error).__name__])[0]}")
        return
    worst = max(result.outputs, key=lambda o: o.rel_l2)
    agreement = [o.top1 for o in result.outputs if o.top1 is not None]
    ids = result.input_shapes.get("input_ids")
    on = f"{ids[-1]} generated tokens" if ids else "one generated input"
    top1 = f", top-1 agreement {min(agreement):.2f}" if agreement else ""
    say(f"self-check: uncalibrated settings; on {on} output {worst.name!r} differs from the original by relative "
        f"L2 {worst.rel_l2:.3g} (max abs {worst.max_abs:.3g}){top1}")
    say("  for settings measured on your text within a quality budget: ortsparse tune MODEL --text FILE -o OUT "
        "(--verify N checks more inputs; --no-self-check skips this)")


def _genai_shapes(folder, shapes) -> dict:
    """Generated-input sizes of a genai decoder (its symbolic K/V sizes come from its config), then
    the user's ``--verify-shape``."""
    from .graph_rewrite.genai import generated_input_sizes

    return {**generated_input_sizes(folder), **(shapes or {})}


def _rewrite_genai_folder(args: argparse.Namespace, config, say: Callable[[str], None], progress: bool,
                          shapes) -> int:
    """``rewrite-onnx GENAI_DIR -o OUT_DIR``: a new runnable onnxruntime-genai folder, and the report,
    moved into place together after every check."""
    from .graph_rewrite.genai import model_input, read_genai_folder, rewrite_genai_folder, written_by_ortsparse
    from .graph_rewrite.output_paths import OutputFiles

    source = read_genai_folder(args.input).folder
    with OutputFiles(_read_by_flags(args)) as outputs:
        outputs.read(source, "the source folder")
        outputs.add_folder(args.output, "output", replaceable=written_by_ortsparse)
        report_target = outputs.add(args.report, "report") if args.report else None
        result = rewrite_genai_folder(source, args.output, config, check=not args.no_check, fuse=not args.no_fuse,
                                      outputs=outputs)
        if report_target is not None:
            outputs.write_text(report_target, json.dumps(result.report.to_dict(), indent=2) + "\n")
        outputs.commit()
    library = ", op library copied in" if result.library else ""
    say(f"wrote {result.folder} (onnxruntime-genai folder, decoder {result.model_file.name}{library})")
    say(result.report.summary())
    if not args.verify:
        _self_check(args, result.report, say, model_input(args.input), result.model_file,
                    _genai_shapes(result.folder, shapes))
        return EXIT_OK
    return _verify(args, result.report, say, progress, _genai_shapes(result.folder, shapes), model_input(args.input),
                   result.model_file)


def run_rewrite(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .graph_rewrite.files import list_file_layers, rewrite_file
    from .graph_rewrite.genai import is_folder_rewrite, model_input

    say = (lambda text: None) if args.quiet else print
    if args.list_rules:
        _print_rules()
        return EXIT_OK
    if not args.input:
        parser.error("the input model IN.onnx is required")
    config = config_from_args(args)
    if args.list_layers:
        report = list_file_layers(model_input(args.input), config, report_path=args.report,
                                  inputs=_read_by_flags(args))
        print(report.layer_table())
        if report.attention:
            print(report.attention_table())
        print(report.summary())
        return EXIT_OK
    if not args.output:
        parser.error("-o/--output OUT.onnx is required (the input file is never modified)")
    progress = not args.quiet and sys.stderr.isatty()
    shapes = None
    if args.verify:
        from .verify import parse_shape_overrides

        shapes = parse_shape_overrides(args.verify_shape)  # a bad spec is a usage error before anything is written
    if is_folder_rewrite(args.input, args.output):
        return _rewrite_genai_folder(args, config, say, progress, shapes)
    report = rewrite_file(args.input, args.output, config, progress=progress, check=not args.no_check,
                          report_path=args.report, inputs=_read_by_flags(args), fuse=not args.no_fuse)
    say(f"wrote {args.output}" + (f" and {args.report}" if args.report else ""))
    say(report.summary())
    if args.verify:
        return _verify(args, report, say, progress, shapes)
    _self_check(args, report, say, args.input, args.output, shapes)
    return EXIT_OK


def add_genai_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("folder", metavar="DIR", help="an onnxruntime-genai folder written by rewrite-onnx")
    parser.add_argument("--check", action="store_true",
                        help="only report; exit 1 when the folder needs the op library and its copy is missing, "
                             "not configured, or differs from the installed one")


def run_genai_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .graph_rewrite.genai import library_state, refresh_genai_library

    state = library_state(args.folder) if args.check else refresh_genai_library(args.folder)
    if not state["needs_library"]:
        print(f"{state['folder']}: the decoder uses no ortsparse op; no library needed")
        return EXIT_OK
    ok = state["present"] and state["current"] and bool(state["configured"])
    if args.check:
        hint = "" if ok else f" ({state['problem']}); `ortsparse genai-config {args.folder}` refreshes it"
        print(f"{state['folder']}: op library {'up to date' if ok else 'missing or out of date'} "
              f"(installed: {state['installed']}){hint}")
        return EXIT_OK if ok else EXIT_VERIFY_FAILED
    print(f"{state['folder']}: op library {'refreshed from' if state['changed'] else 'already matches'} "
          f"{state['installed']}; genai_config.json custom_ops_library = {state['configured']}")
    return EXIT_OK


@dataclasses.dataclass(frozen=True)
class Subcommand:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, argparse.ArgumentParser], int]


def _module_path(module_name: str) -> str:
    """``ortsparse.<name>`` (``tuning.command``, ``commands.bench``)."""
    return f"ortsparse.{module_name}"


def _module_command(module_name: str, help_text: str) -> Subcommand:
    """A subcommand implemented by the module ``_module_path(module_name)`` (add_arguments / run),
    imported only when the parser is built, so heavy imports stay inside its functions."""
    import importlib

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        importlib.import_module(_module_path(module_name)).add_arguments(parser)

    def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
        return importlib.import_module(_module_path(module_name)).run(args, parser)

    return Subcommand(help_text, add_arguments, run)


def _available(module_name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(_module_path(module_name)) is not None


SUBCOMMANDS: dict[str, Subcommand] = {
    "rewrite": Subcommand("replace linear layers by ortsparse ops (same as rewrite-onnx)",
                          add_rewrite_arguments, run_rewrite),
    "genai-config": Subcommand("refresh the op library copy of a rewritten onnxruntime-genai folder",
                               add_genai_config_arguments, run_genai_config),
}
for _name, _module, _help in [
    ("tune", "tuning.command", "tune MODEL on your text: calibrated gating (+ attention at long contexts) within a "
                     "held-out quality budget, verified, with its decode speed"),
    ("models", "zoo.models", "fetch and export the real models into the cache (idempotent)"),
    ("quality", "commands.quality", "perplexity / embedding cosine / output error, dense vs rewritten"),
    ("bench", "commands.bench", "decode tokens/s in a real loop (text, growing KV cache): models side by side"),
    ("validate", "commands.validate", "rewrite, check, load and compare every model of a zoo"),
    ("sweep", "commands.sweep", "grid of op settings on a model: JSON + speedup-vs-quality PNG"),
    ("calibrate", "commands.calibrate", "per-layer KWTA settings that meet a quality budget"),
]:
    if _available(_module):
        SUBCOMMANDS[_name] = _module_command(_module, _help)


from .benchmarking import command_line  # noqa: E402 (cli is the top layer)


def _execute(parser: argparse.ArgumentParser, argv: Sequence[str] | None,
             run: Callable[[argparse.Namespace], int]) -> int:
    from .graph_rewrite.errors import RewriteError
    from .graph_rewrite.output_paths import Terminated, terminate_cleanly
    from .verify import VerifyInputError

    try:
        with terminate_cleanly():  # SIGTERM/SIGHUP unwind like Ctrl-C: staged outputs are removed
            args = parser.parse_args(argv)
            # The command line reports quote: the arguments this call was given (the one home of it).
            args.command_line = command_line(parser.prog, list(argv) if argv is not None else sys.argv[1:])
            return run(args)
    except (KeyboardInterrupt, Terminated) as stop:
        name = stop.name if isinstance(stop, Terminated) else "SIGINT"
        print(f"{parser.prog}: interrupted by {name}; outputs not yet in place were not written", file=sys.stderr)
        return 128 + (stop.signum if isinstance(stop, Terminated) else 2)
    except SystemExit as exit_request:  # argparse: --help/--version (0) or a usage error (2)
        code = exit_request.code
        return code if isinstance(code, int) else (EXIT_OK if code is None else EXIT_USAGE)
    except (RewriteError, VerifyInputError) as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except FileNotFoundError as error:  # e.g. the native op library, needed by --verify
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # `... --list-layers | head`: the reader left, not an error
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except _user_file_errors() as error:
        # The net under the commands' own checks: what the user's files raise anywhere in a command,
        # also after its long part (a disk that fills, a model onnx or onnxruntime cannot read).
        # Outputs are staged, so the `with OutputFiles` blocks this unwound left nothing behind.
        print(f"{parser.prog}: error: {_one_line(error)}", file=sys.stderr)
        return EXIT_USAGE


def _user_file_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that user files (models, data, texts, output places) raise from the libraries
    under the commands: OSError (disk full, quota, a name too long, permissions), ValueError (numpy,
    json, onnx's external data loader), onnx's checker and protobuf's decoder, onnxruntime's
    refusals of a model."""
    import onnx
    from google.protobuf.message import DecodeError
    from onnxruntime.capi import onnxruntime_pybind11_state as ort_errors

    return (OSError, ValueError, onnx.checker.ValidationError, onnx.shape_inference.InferenceError, DecodeError,
            ort_errors.Fail, ort_errors.InvalidArgument, ort_errors.InvalidGraph, ort_errors.InvalidProtobuf,
            ort_errors.NoSuchFile, ort_errors.NotImplemented)


def _one_line(error: BaseException) -> str:
    """An exception as one line: an OSError as its reason and file, anything else as the first line
    of its message, prefixed with its type when that is not ours (onnxruntime's messages name none)."""
    if isinstance(error, OSError) and error.strerror:
        return f"{error.strerror}: {error.filename}" if error.filename else error.strerror
    lines = str(error).strip().splitlines()
    text = lines[0] if lines else ""
    kind = type(error).__name__
    return text if type(error).__module__.startswith("ortsparse") else f"{kind}: {text}".rstrip(": ")


def rewrite_onnx_main(argv: Sequence[str] | None = None) -> int:
    """``rewrite-onnx IN.onnx -o OUT.onnx``."""
    parser = _Parser(
        prog="rewrite-onnx",
        description="Replace linear layers of an ONNX model by ortsparse ops (KwtaBlockMatMul).",
        epilog="Exit codes: 0 ok, 1 --verify over budget, 2 usage or input error.")
    add_rewrite_arguments(parser)
    return _execute(parser, argv, lambda args: run_rewrite(args, parser))


def build_parser() -> argparse.ArgumentParser:
    """The ``ortsparse`` parser with one subparser per entry of ``SUBCOMMANDS``."""
    parser = _Parser(prog="ortsparse", description="ortsparse tools",
                     epilog="Exit codes: 0 ok, 1 check over budget, 2 usage or input error.")
    parser.add_argument("--version", action="version", version=_version())
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, command in SUBCOMMANDS.items():
        sub = commands.add_parser(name, help=command.help, description=command.help)
        command.add_arguments(sub)
        sub.set_defaults(_run=command.run, _parser=sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``ortsparse <command> ...``."""
    return _execute(build_parser(), argv, lambda args: args._run(args, args._parser))


if __name__ == "__main__":
    sys.exit(main())
