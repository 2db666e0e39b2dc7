"""The rewrite pass: survey the layers, decide per layer, let the onnxscript rules replace the
selected ones, and report every candidate layer."""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import numpy as np
import onnx
import onnx_ir as ir
from onnxscript.rewriter import RewriteRuleSet

from .attention_rules import list_attention, rewrite_attention
from .compose import check_attention
from .config import RewriteConfig
from .errors import ConfigError
from .layers import LinearLayer, survey
from .plan import WeightPreparer, decide_layer
from .report import REWRITTEN, SKIPPED, LayerRecord, RewriteReport
from .rules import DOMAIN, DOMAIN_VERSION, LayerPlan, make_rules
from .techniques import BIAS, TECHNIQUES, WEIGHT, LayerWeights


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
    calibration: Mapping[str, np.ndarray] | None = None,
) -> tuple[onnx.ModelProto | ir.Model, RewriteReport]:
    """Replace the selected linear layers by ortsparse ops.

    A ``ModelProto`` is left untouched and a new ``ModelProto`` is returned; an ``ir.Model`` is
    rewritten in place and returned. ``on_stage`` is called with the name of each stage (progress).
    ``calibration`` maps layer (node) names to sample inputs X [S, K], for techniques whose build
    uses activations (e.g. TT's output gap).
    """
    if isinstance(model, onnx.ModelProto):
        ir_model = ir.from_proto(model)
        report = _plan_and_apply(ir_model, config or RewriteConfig(), apply=True, on_stage=on_stage,
                                 calibration=calibration)
        return ir.to_proto(ir_model), report
    if isinstance(model, ir.Model):
        return model, _plan_and_apply(model, config or RewriteConfig(), apply=True, on_stage=on_stage,
                                      calibration=calibration)
    raise TypeError(f"rewrite_model takes an onnx.ModelProto or an onnx_ir.Model, not {type(model).__name__}")


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


def _layer_weights(layer: LinearLayer, operands, calibration) -> LayerWeights:
    def weight() -> np.ndarray:
        array = operands.weight.const_value.numpy()
        return np.ascontiguousarray(array.T if operands.weight_is_transposed else array, dtype=np.float32)

    def bias() -> np.ndarray | None:
        if operands.bias is None:
            return None
        flat = operands.bias.const_value.numpy().reshape(-1).astype(np.float32)
        return np.ascontiguousarray(np.broadcast_to(flat, (layer.n,)))

    samples = calibration.get(layer.name) if calibration else None
    return LayerWeights(name=layer.name, k=layer.k, n=layer.n, weight=weight, bias=bias, calibration=samples)


def _plan_and_apply(model: ir.Model, config: RewriteConfig, *, apply: bool,
                    on_stage: Callable[[str], None] | None = None,
                    calibration: Mapping[str, np.ndarray] | None = None) -> RewriteReport:
    stage = on_stage or (lambda _: None)
    check_attention(config)
    stage("analyse")
    found = survey(model)
    layers = found.layers
    records: dict[int, LayerRecord] = {}
    metadata: dict[str, dict[str, str]] = {}
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
        technique = TECHNIQUES[decision.lead]
        exact = all(s.for_layer(layer.k).is_exact(layer.k or 0)
                    for s in (decision.settings, *decision.partners.values()))
        record = _record(layer, REWRITTEN, decision.why, new_op=decision.op_type,
                         settings=decision.settings.for_layer(layer.k), partners=dict(decision.partners),
                         is_exact=exact)
        records[layer.index] = record
        if not apply:
            continue
        stage(f"build {layer.name}")
        for settings in (decision.settings, *decision.partners.values()):
            _check_attribute_ranges(f"layer {layer.name}", settings.for_layer(layer.k).attributes())
        operands = layer.operands
        built = technique.build(_layer_weights(layer, operands, calibration), decision.settings,
                                decision.partners)
        record.notes.extend(built.notes)
        if built.op_type is None:  # the technique kept the layer dense (e.g. TT's gap check)
            record.decision, record.new_op, record.settings, record.partners = SKIPPED, None, None, {}
            record.is_exact = True
            record.reason = f"{decision.lead}: " + ("; ".join(built.notes) or "kept dense")
            continue
        _check_attribute_ranges(f"layer {layer.name}", built.attributes)
        record.new_op, record.is_exact, record.attributes = built.op_type, built.exact, dict(built.attributes)
        inputs = []
        for position, entry in enumerate(built.inputs):
            if isinstance(entry, str) and entry == WEIGHT:
                inputs.append(preparer.weight(operands))
            elif isinstance(entry, str) and entry == BIAS:
                inputs.append(preparer.bias(operands, layer.n))
            elif entry is None:
                inputs.append(None)
            else:
                inputs.append(preparer.new_initializer(f"{layer.name or 'layer'}_{built.op_type}_{position}", entry))
        if WEIGHT not in [e for e in built.inputs if isinstance(e, str)]:
            preparer.replaced(operands)
        plans[id(layer.node)] = LayerPlan(rule=layer.rule, op_type=built.op_type, node_name=layer.name,
                                          inputs=tuple(inputs), attributes=built.attributes)
        if built.metadata:
            metadata[layer.name] = built.metadata

    report = RewriteReport(layers=[records[layer.index] for layer in layers], config=config,
                           attention_cores=found.attention_cores, preview=not apply)
    if apply and plans:
        _apply_plans(model, layers, records, plans, metadata, preparer, report, stage)
    # Attention last: the linear rules never touch attention cores, and the cores' survey must see
    # the q/k/v values as the linear rewrite left them.
    if apply:
        if config.attention is not None:
            _check_attribute_ranges("attention", config.attention.attributes())
            stage("attention")
        report.attention = rewrite_attention(model, config.attention, config.attention_why)
    else:
        report.attention = list_attention(model, config.attention, config.attention_why)
    return report


def _apply_plans(model, layers, records, plans, metadata, preparer, report, stage) -> None:

    stage("rewrite")
    RewriteRuleSet([rule for _, rule in make_rules(plans)]).apply_to_model(model)
    for layer in layers:
        record = records[layer.index]
        if record.rewritten and layer.node.graph is not None:
            # The survey matched, so this means another rewrite consumed part of the pattern.
            record.decision, record.new_op, record.settings, record.partners = SKIPPED, None, None, {}
            record.attributes, record.is_exact = None, True
            record.reason = "pattern no longer matched at rewrite time (overlapping rewrite)"
    for node in model.graph:
        if node.domain == DOMAIN and node.name in metadata:
            node.metadata_props.update(metadata[node.name])
    preparer.drop_unused()
    if report.rewritten:
        model.opset_imports[DOMAIN] = DOMAIN_VERSION
    report.added_initializers = list(preparer.added)
    report.removed_initializers = list(preparer.removed)
