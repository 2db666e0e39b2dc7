"""Attention rules: every attention core -> ``ai.ortsparse.PopcountAttention`` (one rule per form).

:func:`list_attention` surveys (nothing changes); :func:`rewrite_attention` replaces the cores with
the given settings and removes the nodes that only fed them. Both return one
:class:`AttentionRecord` per candidate core, with near-miss explanations for those no rule takes.
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Any

import onnx_ir as ir
from onnxscript.rewriter import MatchingTracer, MatchStatus, RewriteRuleSet

from ..graph_utils import MS_DOMAIN, op_name
from ..techniques.popcount import OP_TYPE, AttentionSettings
from ._base import DOMAIN, DOMAIN_VERSION, NOT_ATTENTION, AttentionRule, Core, Rewritten
from .eager import EagerAttention
from .ms_attention import MsAttention, MsMultiHeadAttention
from .onnx_attention import OnnxAttention

RULE_CLASSES: tuple[type[AttentionRule], ...] = (OnnxAttention, MsAttention, MsMultiHeadAttention, EagerAttention)
# Fused attention ops no rule takes yet: reported as cores with a reason.
_UNSUPPORTED_FUSED = frozenset({
    f"{MS_DOMAIN}.GroupQueryAttention", f"{MS_DOMAIN}.PackedMultiHeadAttention", f"{MS_DOMAIN}.PackedAttention",
    f"{MS_DOMAIN}.DecoderMaskedMultiHeadAttention", f"{MS_DOMAIN}.DecoderMaskedSelfAttention",
    f"{MS_DOMAIN}.SparseAttention",
})
_FUSED = frozenset({"Attention", f"{MS_DOMAIN}.Attention", f"{MS_DOMAIN}.MultiHeadAttention"}) | _UNSUPPORTED_FUSED

REWRITTEN, SKIPPED = "rewritten", "skipped"


@dataclasses.dataclass
class AttentionRecord:
    index: int
    anchor: str  # name of the node the rule is rooted at (context MatMul or fused op)
    form: str  # "eager" or the fused op's name
    rule: str | None
    decision: str
    reason: str
    new_op: str | None = None
    node_name: str | None = None
    settings: AttentionSettings | None = None
    detail: str = ""
    near_misses: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def rewritten(self) -> bool:
        return self.decision == REWRITTEN

    @property
    def exact(self) -> bool:
        return not self.rewritten or self.settings is None or self.settings.exact

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["settings"] = self.settings.attributes() if self.settings else None
        data["near_misses"] = [{"rule": r, "reason": why} for r, why in self.near_misses]
        data["exact"] = self.exact
        return data


class _LastResult(MatchingTracer):
    def __init__(self) -> None:
        super().__init__()
        self.status: MatchStatus | None = None
        self.result = None

    def log(self, rule, container, node, match_result, status) -> None:
        self.status, self.result = status, match_result


class _NodeNames:
    def __init__(self, graph: ir.Graph) -> None:
        self._taken = {node.name for node in graph if node.name}

    def new(self, wanted: str) -> str:
        name, suffix = wanted, 0
        while name in self._taken:
            suffix += 1
            name = f"{wanted}_{suffix}"
        self._taken.add(name)
        return name


def _opset(model: ir.Model) -> int:
    return model.opset_imports.get("", model.opset_imports.get("ai.onnx", 17))


def _is_candidate(node: ir.Node) -> bool:
    if op_name(node) in _FUSED:
        return True
    from .eager import _softmax_of

    return node.op_type == "MatMul" and node.domain in ("", "ai.onnx") and node.inputs[0] is not None \
        and _softmax_of(node.inputs[0], []) is not None


@dataclasses.dataclass
class _Candidate:
    node: ir.Node
    rule: type[AttentionRule] | None
    core: Core | None
    near_misses: list[tuple[str, str]]


def _survey(model: ir.Model) -> list[_Candidate]:
    opset = _opset(model)
    rules = [(cls, cls(opset=opset), cls.rule(opset=opset)) for cls in RULE_CLASSES]
    found = []
    for node in model.graph:
        if not _is_candidate(node):
            continue
        candidate = _Candidate(node, None, None, [])
        if op_name(node) in _UNSUPPORTED_FUSED:
            candidate.near_misses.append(("-", f"{op_name(node)} is not rewritten yet"))
        for cls, rule, compiled in rules:
            tracer = _LastResult()
            match = compiled.match(model, model.graph, node, tracer=tracer)
            if match:
                candidate.rule = cls
                bindings = dict(match.bindings)
                candidate.core = rule.analyze(rule.anchor_of(**bindings), **bindings)[1]
                break
            reason = tracer.result.reason if tracer.result is not None else ""
            if tracer.status in (MatchStatus.CONDITION_FAILED, MatchStatus.REPLACEMENT_FAILED) and reason \
                    and not reason.startswith(NOT_ATTENTION):
                candidate.near_misses.append((cls.rule_name, reason))
        found.append(candidate)
    return found


def _form(node: ir.Node) -> str:
    return "eager" if node.op_type == "MatMul" else op_name(node)


def _records(candidates: list[_Candidate], settings: AttentionSettings | None, why_off: str) -> list[AttentionRecord]:
    records = []
    for index, c in enumerate(candidates):
        record = AttentionRecord(index=index, anchor=c.node.name or "", form=_form(c.node),
                                 rule=c.rule.rule_name if c.rule else None, decision=SKIPPED, reason="",
                                 near_misses=list(c.near_misses))
        if c.rule is None:
            record.reason = c.near_misses[0][1] if c.near_misses else "no attention rule matches this core"
        elif settings is None:
            record.reason = why_off
            record.detail = c.core.describe() if c.core else ""
        else:
            record.decision, record.new_op, record.settings = REWRITTEN, OP_TYPE, settings
            record.reason = f"rule {c.rule.rule_name}"
            record.detail = c.core.describe() if c.core else ""
            record.notes = list(c.core.notes) if c.core else []
        records.append(record)
    return records


def list_attention(model: ir.Model, settings: AttentionSettings | None,
                   why_off: str = "--attn=off") -> list[AttentionRecord]:
    """What :func:`rewrite_attention` would do, without changing anything."""
    return _records(_survey(model), settings, why_off)


def _remove_dead(graph: ir.Graph, seeds: list[ir.Node]) -> None:
    """Remove the seed nodes and their producers once nothing uses their outputs."""
    outputs = set(map(id, graph.outputs))
    work = list(seeds)
    while work:
        node = work.pop()
        if node.graph is not graph:
            continue
        if any(out.uses() or id(out) in outputs for out in node.outputs):
            continue
        inputs = [v for v in node.inputs if v is not None]
        graph.remove(node, safe=True)
        for value in inputs:
            if value.producer() is not None:
                work.append(value.producer())
            elif value.is_initializer() and not value.uses() and not value.is_graph_input() \
                    and graph.initializers.get(value.name) is value:
                del graph.initializers[value.name]


def rewrite_attention(model: ir.Model, settings: AttentionSettings | None,
                      why_off: str = "--attn=off") -> list[AttentionRecord]:
    """Replace every attention core a rule takes by PopcountAttention with ``settings`` (None:
    nothing changes). ``model`` is changed in place."""
    candidates = _survey(model)
    records = _records(candidates, settings, why_off)
    if settings is None or not any(c.rule for c in candidates):
        return records
    done: list[Rewritten] = []
    names = _NodeNames(model.graph)
    opset = _opset(model)
    rules = [cls.rule(settings, done, names, opset) for cls in RULE_CLASSES]
    RewriteRuleSet(rules).apply_to_model(model)
    by_anchor = {id(c.node): r for c, r in zip(candidates, records)}
    rewritten_anchors = set()
    for item in done:
        rewritten_anchors.add(id(item.core.nodes[0]))
        record = by_anchor.get(id(item.core.nodes[0]))
        if record is not None:
            record.node_name = item.node_name
    for c, record in zip(candidates, records):
        if record.rewritten and id(c.node) not in rewritten_anchors:
            record.decision, record.new_op, record.settings = SKIPPED, None, None
            record.reason = "pattern no longer matched at rewrite time (overlapping rewrite)"
    _remove_dead(model.graph, [n for item in done for n in item.core.nodes[1:]])
    if done:
        model.opset_imports[DOMAIN] = DOMAIN_VERSION
    return records


def describe_rules() -> list[tuple[str, str, str]]:
    return [(c.rule_name, c.before_after, sys.modules[c.__module__].__doc__ or "") for c in RULE_CLASSES]


__all__ = ["RULE_CLASSES", "AttentionRecord", "describe_rules", "list_attention", "rewrite_attention"]
