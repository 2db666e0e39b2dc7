"""Rewrite exported ONNX models: linear layers with constant weights (and attention cores) ->
ortsparse ops.

Library first (:func:`rewrite_model`, :func:`rewrite_file`, :func:`list_layers`); the
``rewrite-onnx`` / ``ortsparse rewrite`` CLI is a thin layer on top. See docs/rewriter.md.
"""
from __future__ import annotations

from .config import (KwtaSettings, LayerOverride, NodePlan, RewriteConfig, config_from_flags, load_overrides,
                     parse_overrides)
from .errors import ConfigError, ModelFileError, RewriteError
from .files import PROTOBUF_LIMIT, check_output, list_file_layers, load_model, rewrite_file
from .report import AttentionRecord, LayerRecord, RewriteReport
from .rewrite import list_layers, rewrite_model
from .rules import describe_rules
from .techniques import QuantSettings, TechniqueChoice

__all__ = [
    "PROTOBUF_LIMIT", "AttentionRecord", "ConfigError", "KwtaSettings", "LayerOverride", "LayerRecord",
    "ModelFileError", "NodePlan", "QuantSettings", "RewriteConfig", "RewriteError", "RewriteReport", "TechniqueChoice",
    "check_output", "config_from_flags", "describe_rules", "list_file_layers", "list_layers", "load_model",
    "load_overrides", "parse_overrides", "rewrite_file", "rewrite_model",
]
