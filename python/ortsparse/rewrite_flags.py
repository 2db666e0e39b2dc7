"""The rewrite flags every command that rewrites a model takes (``--config``, ``--kwta-*``,
``--tt-*``, ``--proc-*``, ``--event-*``, ``--pack-*``, ``--attn*``) and the RewriteConfig they make.

``rewrite-onnx`` / ``ortsparse rewrite`` (ortsparse.cli) and the harness commands (quality, bench,
validate) share them from here, below both, so neither imports the other.
"""
from __future__ import annotations

import argparse

from .graph_rewrite.config import RewriteConfig, load_overrides
from .graph_rewrite.techniques import TECHNIQUES, popcount


def add_technique_arguments(parser: argparse.ArgumentParser) -> None:
    """--config and every technique's flags (--kwta-*, ...): every command that rewrites a model
    takes these."""
    parser.add_argument("--config", metavar="FILE", help="per-layer override file (JSON, or TOML by extension)")
    for technique in TECHNIQUES.values():
        technique.add_arguments(parser)
    popcount.add_arguments(parser)


def config_from_args(args: argparse.Namespace) -> RewriteConfig:
    """The RewriteConfig of the flags added by add_technique_arguments.

    ``--kwta`` defaults to ``auto``: on (the tool's default technique) unless another technique
    is switched on, so ``--tt=on`` alone does not also gate the same layers with KWTA."""
    choices = {name: technique.choice_from_args(args) for name, technique in TECHNIQUES.items()}
    kwta = choices.pop("kwta")
    kwta_enabled = kwta.enabled
    attn_explicit = getattr(args, "attn", None) not in (None, "off")
    if getattr(args, "kwta", "on") == "auto":
        kwta_enabled = not any(choice.enabled for choice in choices.values()) and not attn_explicit
    overrides = load_overrides(args.config) if args.config else ()
    attention, attention_why = popcount.settings_from_args(args, kwta_on=kwta_enabled, kwta_target=kwta.target)
    return RewriteConfig(kwta=kwta.settings, kwta_enabled=kwta_enabled, kwta_target=kwta.target,
                         overrides=overrides, techniques=choices, attention=attention,
                         attention_why=attention_why)
