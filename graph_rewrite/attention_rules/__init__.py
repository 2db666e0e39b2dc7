"""Attention rules: one module per attention form, each turning a core of that form into
``ai.ortsparse.PopcountAttention`` (or, for ``com.microsoft.GroupQueryAttention``, its GQA form
``ai.ortsparse.PopcountGroupQueryAttention``). The recogniser (graph_rewrite/attention.py) finds the cores
and asks these rules, in order, to analyze them; the replacement (graph_rewrite/replace.py) emits.

Adding a form = one module with an :class:`AttentionRule` (``takes``, ``analyze``, ``emit``) + one
line in ``RULES`` (and its q/k/v slots in ``attention.FUSED_ATTENTION`` for classification).
"""
from __future__ import annotations

import sys

from ..report import AttentionRecord
from ._base import AttentionRule, Core, Mask, Operand
from .eager import EagerAttention
from .ms_attention import MsAttention, MsMultiHeadAttention
from .ms_group_query_attention import MsGroupQueryAttention
from .onnx_attention import OnnxAttention

RULES: tuple[AttentionRule, ...] = (OnnxAttention(), MsAttention(), MsMultiHeadAttention(), MsGroupQueryAttention(),
                                    EagerAttention())
RULE_CLASSES: tuple[type[AttentionRule], ...] = tuple(type(rule) for rule in RULES)


def describe_rules() -> list[tuple[str, str, str]]:
    """(name, Before -> After, module docstring) of every attention rule, in priority order."""
    return [(r.rule_name, r.before_after, sys.modules[type(r).__module__].__doc__ or "") for r in RULES]


__all__ = ["RULES", "RULE_CLASSES", "AttentionRecord", "AttentionRule", "Core", "Mask", "Operand", "describe_rules"]
