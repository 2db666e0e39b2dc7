"""The rewrite flags every command that rewrites a model takes (``--config``, ``--kwta-*``,
``--tt-*``, ``--proc-*``, ``--event-*``, ``--state-pack-*``, ``--weights*``, ``--attn*``) and the
RewriteConfig they make.

``rewrite-onnx`` / ``ortsparse rewrite`` (ortsparse.cli) and the harness commands (quality, bench,
validate) share them from here, below both, so neither imports the other. The flags themselves are
data declared by each technique (graph_rewrite/techniques); defaults such as ``--kwta=auto`` are
resolved by the library's config, as for any caller of ``rewrite_model``.
"""
from __future__ import annotations

import argparse

from .graph_rewrite.config import RewriteConfig, config_from_flags, load_overrides
from .graph_rewrite.techniques import flag_groups


def add_technique_arguments(parser: argparse.ArgumentParser) -> None:
    """--config and every technique's flags (--kwta-*, ...), built from the flags each technique
    declares."""
    parser.add_argument("--config", metavar="FILE", help="per-layer override file (JSON, or TOML by extension)")
    for group in flag_groups():
        arguments = parser.add_argument_group(group.title)
        for flag in group.flags:
            arguments.add_argument(flag.name, **flag.argparse_options())


def config_from_args(args: argparse.Namespace) -> RewriteConfig:
    """The RewriteConfig of the flags added by add_technique_arguments."""
    overrides = load_overrides(args.config) if args.config else ()
    return config_from_flags(vars(args), overrides=overrides)
