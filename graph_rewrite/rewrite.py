"""The rewrite pass: survey the layers, decide per layer, let the onnxscript rules replace the
selected ones, and report every candidate layer."""
from __future__ import annotations

from collections.abc import Callable

import onnx
import onnx_ir as ir
from onnxscript.rewriter import RewriteRuleSet

from .config import RewriteConfig
from .layers import LinearLayer, survey
from .plan import WeightPreparer, decide_layer
from .report import REWRITTEN, SKIPPED, LayerRecord, RewriteReport
from .rules import DOMAIN, DOMAIN_VERSION, LayerPlan, make_rules


def _record(layer: LinearLayer, decision: str, reason: str, **extra) -> LayerRecord:
    return LayerRecord(index=layer.index, name=layer.name, op_type=layer.op_type,
                       layer_class=layer.layer_class, role=layer.role, k=layer.k, n=layer.n,
                       weight=layer.weight_name, rule=layer.rule, decision=decision, reason=reason,
                       near_misses=list(layer.near_misses), class_reason=layer.class_reason, **extra)


def list_layers(model: onnx.ModelProto | ir.Model, config: RewriteConfig | None = None) -> RewriteReport:
    """The report a rewrite would produce, without changing anything."""
    ir_model = ir.from_proto(model) if isinstance(model, onnx.ModelProto) else model
    return _plan_and_apply(ir_model, config or RewriteConfig(), apply=False)


def rewrite_model(
    model: onnx.ModelProto | ir.Model,
    config: RewriteConfig | None = None,
    *,
    on_stage: Callable[[str], None] | None = None,
) -> tuple[onnx.ModelProto | ir.Model, RewriteReport]:
    """Replace the selected linear layers by ortsparse ops.

    A ``ModelProto`` is left untouched and a new ``ModelProto`` is returned; an ``ir.Model`` is
    rewritten in place and returned. ``on_stage`` is called with the name of each stage (progress).
    """
    if isinstance(model, onnx.ModelProto):
        ir_model = ir.from_proto(model)
        report = _plan_and_apply(ir_model, config or RewriteConfig(), apply=True, on_stage=on_stage)
        return ir.to_proto(ir_model), report
    if isinstance(model, ir.Model):
        return model, _plan_and_apply(model, config or RewriteConfig(), apply=True, on_stage=on_stage)
    raise TypeError(f"rewrite_model takes an onnx.ModelProto or an onnx_ir.Model, not {type(model).__name__}")


def _plan_and_apply(model: ir.Model, config: RewriteConfig, *, apply: bool,
                    on_stage: Callable[[str], None] | None = None) -> RewriteReport:
    stage = on_stage or (lambda _: None)
    stage("analyse")
    found = survey(model)
    layers = found.layers
    records: dict[int, LayerRecord] = {}
    plans: dict[int, LayerPlan] = {}
    preparer = WeightPreparer(model.graph)
    for layer in layers:
        decision = decide_layer(layer, config)
        if decision.op_type is None:
            records[layer.index] = _record(layer, SKIPPED, decision.why)
            continue
        if layer.rule is None:
            records[layer.index] = _record(layer, SKIPPED, layer.blocker)
            continue
        settings = decision.settings.for_layer(layer.k)
        notes = []
        if settings.block != decision.settings.block:
            notes.append(f"block {decision.settings.block} > K={layer.k}: block set to K")
        records[layer.index] = _record(layer, REWRITTEN, decision.why, new_op=decision.op_type,
                                       settings=settings, notes=notes)
        if apply:
            operands = layer.operands
            plans[id(layer.node)] = LayerPlan(
                rule=layer.rule, op_type=decision.op_type, node_name=layer.name,
                weight=preparer.weight(operands), bias=preparer.bias(operands, layer.n),
                attributes=settings.attributes())

    report = RewriteReport(layers=[records[layer.index] for layer in layers], config=config,
                           attention_cores=found.attention_cores, preview=not apply)
    if not apply or not plans:
        return report

    stage("rewrite")
    RewriteRuleSet([rule for _, rule in make_rules(plans)]).apply_to_model(model)
    for layer in layers:
        record = records[layer.index]
        if record.rewritten and layer.node.graph is not None:
            # The survey matched, so this means another rewrite consumed part of the pattern.
            record.decision, record.new_op, record.settings = SKIPPED, None, None
            record.reason = "pattern no longer matched at rewrite time (overlapping rewrite)"
    preparer.drop_unused()
    if report.rewritten:
        model.opset_imports[DOMAIN] = DOMAIN_VERSION
    report.added_initializers = list(preparer.added)
    report.removed_initializers = list(preparer.removed)
    return report
