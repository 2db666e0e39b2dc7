"""Rewrite exported ONNX models: linear layers with constant weights -> ortsparse ops.

Library first (:func:`rewrite_model`, :func:`rewrite_file`, :func:`list_layers`); the
``rewrite-onnx`` / ``ortsparse rewrite`` CLI is a thin layer on top. See docs/rewriter.md.
"""
from __future__ import annotations

from .config import KwtaSettings, LayerOverride, RewriteConfig, load_overrides, parse_overrides
from .errors import ConfigError, ModelFileError, RewriteError
from .files import PROTOBUF_LIMIT, check_output, list_file_layers, load_model, rewrite_file
from .report import LayerRecord, RewriteReport
from .rewrite import list_layers, rewrite_model
from .rules import describe_rules

__all__ = [
    "PROTOBUF_LIMIT", "ConfigError", "KwtaSettings", "LayerOverride", "LayerRecord", "ModelFileError",
    "RewriteConfig", "RewriteError", "RewriteReport", "check_output", "describe_rules", "list_file_layers",
    "list_layers", "load_model", "load_overrides", "parse_overrides", "rewrite_file", "rewrite_model",
]
