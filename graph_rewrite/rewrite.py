"""The rewrite pass: survey once (rules -> layer records, attention cores), decide per layer
(decide/compose), let the chosen technique build its op, and replace the matched nodes with it;
then the attention cores. Every candidate layer and core is reported."""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import numpy as np
import onnx
import onnx_ir as ir

from .attention import AttentionCore, default_opset
from .attention_event import EventAttention, event_attention, for_op
from .config import RewriteConfig
from .decide import check_overrides_match, decide_layer
from .errors import ConfigError
from .fuse import fuse_shared_input
from .layers import LinearLayer, Survey, survey
from .replace import GraphEditor, WeightPreparer, emit_attention, emit_linear
from .report import REWRITTEN, SKIPPED, AttentionRecord, LayerRecord, RewriteReport
from .rules import DOMAIN, DOMAIN_VERSION, FLOAT32
from .techniques import TECHNIQUES, LayerWeights
from .techniques.popcount import ATTENTION, AttentionSettings


def list_layers(model: onnx.ModelProto | ir.Model, config: RewriteConfig | None = None) -> RewriteReport:
    """The report a rewrite would produce, without changing anything."""
    ir_model = ir.from_proto(model) if isinstance(model, onnx.ModelProto) else model
    return _run(ir_model, config or RewriteConfig(), apply=False)


def rewrite_model(
    model: onnx.ModelProto | ir.Model,
    config: RewriteConfig | None = None,
    *,
    on_stage: Callable[[str], None] | None = None,
    calibration: Mapping[str, np.ndarray] | None = None,
    fuse: bool = True,
) -> tuple[onnx.ModelProto | ir.Model, RewriteReport]:
    """Replace the selected linear layers (and, with ``config.attention``, the attention cores) by
    ortsparse ops.

    A ``ModelProto`` is left untouched and a new ``ModelProto`` is returned; an ``ir.Model`` is
    rewritten in place and returned. ``on_stage`` is called with the name of each stage (progress).
    ``calibration`` maps layer (node) names to sample inputs X [S, K], for techniques whose build
    uses activations (e.g. TT's output gap). ``fuse``: quantized gated layers that read the same
    input with the same settings become one op (graph_rewrite/fuse.py; exact, so on by default).
    """
    if isinstance(model, onnx.ModelProto):
        ir_model = ir.from_proto(model)
        report = _run(ir_model, config or RewriteConfig(), apply=True, on_stage=on_stage, calibration=calibration,
                      fuse=fuse)
        return ir.to_proto(ir_model), report
    if isinstance(model, ir.Model):
        return model, _run(model, config or RewriteConfig(), apply=True, on_stage=on_stage,
                           calibration=calibration, fuse=fuse)
    raise TypeError(f"rewrite_model takes an onnx.ModelProto or an onnx_ir.Model, not {type(model).__name__}")


def _record(layer: LinearLayer, decision: str, reason: str, **extra) -> LayerRecord:
    return LayerRecord(index=layer.index, name=layer.name, op_type=layer.op_type,
                       layer_class=layer.layer_class, role=layer.role, k=layer.k, n=layer.n,
                       weight=layer.weight_name, rule=layer.rule, decision=decision, reason=reason,
                       near_misses=list(layer.near_misses), class_reason=layer.class_reason, **extra)


def _skip(record: LayerRecord, reason: str) -> None:
    record.decision, record.new_op, record.settings, record.partners = SKIPPED, None, None, {}
    record.attributes, record.is_exact, record.reason = None, True, reason


_INT64 = (-(2**63), 2**63 - 1)
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _check_attribute_ranges(where: str, attributes: Mapping[str, object]) -> None:
    """Settings become int64 / float32 attributes (and C++ int64s in the builders): a value out
    of their range is a user error named here, not a serialiser traceback or a silent inf later."""
    for name, value in attributes.items():
        values = value if isinstance(value, (list, tuple)) else [value]
        for item in values:
            if isinstance(item, int) and not isinstance(item, bool) and not _INT64[0] <= item <= _INT64[1]:
                raise ConfigError(f"{where}: {name}={item} does not fit in an int64 attribute")
            if isinstance(item, float) and math.isfinite(item) and abs(item) > _FLOAT32_MAX:
                raise ConfigError(f"{where}: {name}={item} does not fit in a float32 attribute (it would become inf)")


def _layer_weights(layer: LinearLayer, calibration: Mapping[str, np.ndarray] | None) -> LayerWeights:
    operands = layer.operands
    samples = calibration.get(layer.name) if calibration else None
    return LayerWeights(name=layer.name, k=operands.k, n=operands.n, weight=operands.weight.matrix,
                        bias=operands.bias_vector, calibration=samples, weight_form=operands.weight.form,
                        weight_attributes=operands.weight.attributes())


def _linear_layers(found: Survey, config: RewriteConfig, editor: GraphEditor | None, preparer: WeightPreparer | None,
                   calibration: Mapping[str, np.ndarray] | None, stage: Callable[[str], None]) -> list[LayerRecord]:
    """One record per candidate layer; with an ``editor``, each selected layer is replaced."""
    records = []
    for layer in found.layers:
        decision = decide_layer(layer, config)
        if decision.op_type is None:
            records.append(_record(layer, SKIPPED, decision.why))
            continue
        if layer.rule is None:
            records.append(_record(layer, SKIPPED, layer.blocker))
            continue
        chosen = (decision.settings, *decision.partners.values())
        # A quantized weight is never "exact" (>= 4 dense rows run on int8 activations).
        exact = all(s.for_layer(layer.k).is_exact(layer.k or 0) for s in chosen) \
            and layer.operands.weight.form == FLOAT32
        record = _record(layer, REWRITTEN, decision.why, new_op=decision.op_type,
                         settings=decision.settings.for_layer(layer.k), partners=dict(decision.partners),
                         is_exact=exact, notes=list(decision.notes))
        records.append(record)
        if editor is None:
            continue
        if not editor.alive(layer.operands.nodes):
            _skip(record, "its nodes were consumed by an overlapping rewrite")
            continue
        stage(f"build {layer.name}")
        for settings in chosen:
            _check_attribute_ranges(f"layer {layer.name}", settings.for_layer(layer.k).attributes())
        built = TECHNIQUES[decision.lead].build(_layer_weights(layer, calibration), decision.settings,
                                                decision.partners)
        record.notes.extend(built.notes)
        if built.op_type is None:  # the technique kept the layer dense (e.g. TT's gap check)
            _skip(record, f"{decision.lead}: " + ("; ".join(built.notes) or "kept dense"))
            continue
        _check_attribute_ranges(f"layer {layer.name}", built.attributes)
        record.new_op, record.is_exact, record.attributes = built.op_type, built.exact, dict(built.attributes)
        emit_linear(editor, preparer, layer.name, layer.rule, layer.operands, built)
    return records


def _attention(cores: list[AttentionCore], settings: AttentionSettings | None, why_off: str,
               editor: GraphEditor | None, opset: int, event: EventAttention | None = None) -> list[AttentionRecord]:
    """One record per candidate core; with an ``editor`` and settings, each core a rule takes is
    replaced (``event``: event-driven attention from the event flags, attention_event.py)."""
    records = []
    for index, core in enumerate(cores):
        record = AttentionRecord(index=index, anchor=core.anchor_name, form=core.form,
                                 rule=core.rule.rule_name if core.rule else None, decision=SKIPPED, reason="",
                                 near_misses=list(core.near_misses))
        records.append(record)
        if core.rule is None:
            record.reason = core.near_misses[0][1] if core.near_misses else "no attention rule matches this core"
            continue
        record.detail = core.operands.describe()
        if settings is None:
            record.reason = why_off
            continue
        op_type, form_settings, record.meaning = ATTENTION.build(core.form, settings, core.anchor_name)
        assert op_type == core.rule.new_op, (op_type, core.rule.new_op)  # the form's rule emits the technique's op
        form_settings = for_op(form_settings, op_type, event)
        record.decision, record.new_op, record.settings = REWRITTEN, op_type, form_settings
        record.reason, record.notes = f"rule {core.rule.rule_name}", list(core.operands.notes)
        if editor is None:
            continue
        if not editor.alive(core.operands.nodes[:1]):
            record.decision, record.new_op, record.settings = SKIPPED, None, None
            record.reason = "its nodes were consumed by an overlapping rewrite"
            continue
        record.node_name = emit_attention(editor, core, form_settings, opset)
    return records


def _run(model: ir.Model, config: RewriteConfig, *, apply: bool, on_stage: Callable[[str], None] | None = None,
         calibration: Mapping[str, np.ndarray] | None = None, fuse: bool = True) -> RewriteReport:
    stage = on_stage or (lambda _: None)
    stage("analyse")
    found = survey(model)
    check_overrides_match(found.layers, config)  # an entry naming no layer is an error, not ignored
    editor = GraphEditor(model) if apply else None
    preparer = WeightPreparer(model.graph) if apply else None
    layers = _linear_layers(found, config, editor, preparer, calibration, stage)
    report = RewriteReport(layers=layers, config=config, attention_cores=found.attention_cores, preview=not apply)
    if apply and fuse:
        stage("fuse")
        emitted = [r.name for r in layers if r.rewritten and r.new_op == "KwtaBlockMatMul"]
        report.fusions = fuse_shared_input(editor, preparer, default_opset(model), emitted)
    if apply and config.attention is not None:
        _check_attribute_ranges("attention", config.attention.attributes())
        stage("attention")
    # Attention last: a core's operands may be values the linear replacements took the place of
    # (the editor maps them), never the other way round.
    report.attention = _attention(found.attention.candidates, config.attention, config.attention_why, editor,
                                  default_opset(model), event_attention(config))
    if apply:
        preparer.drop_unused()
        report.added_initializers = list(preparer.added)
        report.removed_initializers = list(preparer.removed)
        if report.rewritten or any(a.rewritten for a in report.attention):
            model.opset_imports[DOMAIN] = DOMAIN_VERSION
    return report
