"""A rewritten model with every row computed the way a decode step computes it.

The written ops compute a call of many rows (a prompt) differently from a decode step, on purpose:
KwtaBlockMatMul runs calls of more than ``max_gated_rows`` rows dense, and the attention ops compute
a call of at least ``prefill_rows`` query rows exactly (tiled), selecting keys only in decode steps.
A quality measurement feeds teacher-forced windows as one call each, so it would see the prompt's
numerics; :func:`as_decoded` sets both attributes to 0 (gate every row; select keys row by row in
every call), so the measured loss is the one generated tokens see — an upper bound for prompt
tokens, which the written model computes more exactly.
"""
from __future__ import annotations

import onnx
from onnx import helper

from .rules import DOMAIN

ATTENTION_OPS = ("PopcountAttention", "PopcountGroupQueryAttention")


def as_decoded(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` whose ortsparse ops compute every call row by row as decode steps do
    (every ``*max_gated_rows`` attribute 0; ``prefill_rows`` 0 on the attention ops, set or added:
    their default tiles prompts); weights and every other byte as given."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for node in out.graph.node:
        if node.domain != DOMAIN:
            continue
        for attribute in node.attribute:
            if attribute.name.endswith("max_gated_rows") or attribute.name == "prefill_rows":
                attribute.i = 0
        if node.op_type in ATTENTION_OPS and not any(a.name == "prefill_rows" for a in node.attribute):
            node.attribute.append(helper.make_attribute("prefill_rows", 0))
    return out
