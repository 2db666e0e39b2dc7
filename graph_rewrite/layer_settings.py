"""Per-layer settings keyed by the rewriter's own layer records, for callers that choose them
(calibrate, allocation, tune, head placement, the TT sweep).

Before: a caller matched MatMul / Gemm / Transpose / MatMulNBits on the protobuf a second time and
wrote each choice as a glob-escaped node name that the rewriter fnmatched back.
After: :func:`selected_layers` hands out the survey's :class:`~.layers.LinearLayer` records (node,
class, role, the weight operands the rewrite will take) of the layers a technique's target selects;
the caller keys its choices by those records and hands them to the rewriter as a
:class:`~.config.NodePlan` (node name -> settings: :func:`rewritten_with`, ``RewriteConfig.plan``);
only a command that writes an override file turns a plan into entries with an exact ``node`` key
(:meth:`~.config.NodePlan.entries`, no glob). Override files users write with ``match`` globs read as
before (graph_rewrite/config.py).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import onnx
import onnx_ir as ir

from .config import NodePlan, RewriteConfig
from .decide import decide_layer
from .layers import LinearLayer, survey
from .rewrite import rewrite_model
from .techniques import TECHNIQUES, KwtaSettings, TechniqueChoice


def selected_layers(model: onnx.ModelProto | ir.Model | None, technique: str = "kwta", target: str = "both",
                    surveyed: Sequence[LinearLayer] | None = None) -> list[LinearLayer]:
    """The survey's linear layers (graph order) that ``technique`` on ``target`` would rewrite: a rule
    fits and the decision takes them (what ``list_layers`` reports as rewritten for that config).
    ``surveyed``: the survey's layers of ``model`` when the caller has them (it is then not surveyed
    again; ``model`` may be None)."""
    if surveyed is None:
        surveyed = survey(ir.from_proto(model) if isinstance(model, onnx.ModelProto) else model).layers
    choice = TechniqueChoice(TECHNIQUES[technique].settings_type(), enabled=True, target=target)
    config = RewriteConfig(techniques={technique: choice})
    return [layer for layer in surveyed if layer.rule is not None and decide_layer(layer, config).op_type is not None]


def override_entries(technique: str, per_layer: Iterable[tuple[str, Mapping[str, Any]]],
                     rest: str | None = "off") -> list[dict[str, Any]]:
    """Override entries (``{"layers": entries}`` is a ``rewrite-onnx --config`` file) of the plan
    ``per_layer`` (node name, settings) with ``rest`` for every other layer: :meth:`NodePlan.entries`."""
    return NodePlan(technique, dict(per_layer), rest).entries()


def rewritten_with(model: onnx.ModelProto, plan: NodePlan) -> onnx.ModelProto:
    """``model`` rewritten with the per-node ``plan`` alone: KWTA off globally (every layer the plan
    does not select stays dense), the other techniques at their defaults."""
    config = RewriteConfig(techniques={"kwta": TechniqueChoice(KwtaSettings(), enabled=False, target="all")}, plan=plan)
    return rewrite_model(model, config)[0]
