"""Decide, per layer, which techniques apply and with which settings (global choice, then the
override entries in order), and let :func:`compose` pick the technique whose op the layer becomes.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from .compose import compose
from .config import LayerOverride, RewriteConfig
from .errors import ConfigError
from .layers import LinearLayer
from .rules import FLOAT32
from .targets import target_includes
from .techniques import TECHNIQUES


@dataclasses.dataclass(frozen=True)
class LayerDecision:
    op_type: str | None  # None: the layer stays as it is
    settings: Any  # the lead technique's settings (None when skipped)
    why: str
    lead: str | None = None
    partners: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    notes: tuple[str, ...] = ()  # for the report, beside the op (e.g. why a quantized layer is not gated)


def _choice(name: str, layer: LinearLayer, config: RewriteConfig) -> tuple[Any | None, str, bool]:
    """(settings or None, why, mentioned): ``mentioned`` is False when the technique is off
    globally and no override touches it (its reason is then noise in the report)."""
    choice = config.choice(name)
    technique = TECHNIQUES[name]
    target = choice.target
    where = f"class {layer.layer_class}" + (f"/{layer.role}" if target == "down" else "")
    if not choice.enabled:
        selected, why = False, config.off_reason(name)
    elif target_includes(target, layer.layer_class, layer.role):
        selected, why = True, f"{where} selected by {technique.target_flag()}={target}"
    else:
        selected, why = False, f"{where} not in {technique.target_flag()}={target}"
        if layer.layer_class == "head":
            why += f" (heads only with {technique.target_flag()}=all or an override)"
    mentioned = bool(choice.enabled)
    settings = choice.settings
    for entry in config.overrides:
        if not entry.matches(layer.index, layer.name, layer.layer_class, layer.role):
            continue
        label = f"{entry.source or 'override'} ({entry.label})"
        value = entry.setting(name)
        if entry.off or value == "off":
            selected, why = False, f"off by {label}"
            mentioned = mentioned or value == "off"
        elif isinstance(value, Mapping):
            selected, why, mentioned = True, f"set by {label}", True
            settings = settings.updated(value, f"{entry.source}: ")
    plan = config.plan
    if plan is not None and plan.technique == name:
        if layer.name in plan.nodes:
            selected, why, mentioned = True, "set by the plan", True
            settings = settings.updated(plan.nodes[layer.name], f"plan node {layer.name!r}: ")
        elif plan.rest == "off":
            selected, why, mentioned = False, "off: not in the plan", True
    return (settings if selected else None), why, mentioned


def _weight_form_conflict(layer: LinearLayer, chosen: dict[str, tuple[Any, str]]) -> tuple[str | None, list[str]]:
    """For a layer whose weight is already quantized: drop the techniques that quantize (nothing to
    do; noted) and return why the layer stays as it is when another chosen technique's op needs a
    form it does not have (a float-only op is never fed a silently dequantized weight)."""
    form = layer.operands.weight.form if layer.operands is not None else FLOAT32
    if form == FLOAT32:
        return None, []
    notes = []
    for name in [name for name in chosen if TECHNIQUES[name].quantizes]:
        settings, _ = chosen.pop(name)
        notes.append(f"{TECHNIQUES[name].switch.spelled(True, settings)}: the weight is already {form}, kept as is")
    for name in chosen:
        technique = TECHNIQUES[name]
        if form not in technique.weight_forms:
            return (f"{name}: {technique.op_type} takes {' or '.join(sorted(technique.weight_forms))} weights, this "
                    f"layer's are {form} (MatMulNBits); left as it is rather than dequantized"), notes
    return None, notes


def _names_layers(entry: LayerOverride) -> bool:
    """Whether ``entry`` names layers rather than describing a kind of layer: ``node``,
    ``layer:<index>``, or a ``match`` without glob characters (a node name)."""
    if entry.node is not None:
        return True
    kind, _, _ = entry.match.partition(":")
    return kind == "layer" or (kind not in ("class", "role") and not any(c in entry.match for c in "*?["))


def check_overrides_match(layers: Sequence[LinearLayer], config: RewriteConfig) -> None:
    """Every override entry that names layers (:func:`_names_layers`) selects at least one of
    ``layers``: a typo, or a file written for another model, would otherwise be silently ignored.
    A pattern or a class / role may select none (a file shared by several models). ConfigError
    naming the first such entry."""
    for entry in config.overrides:
        if _names_layers(entry) and not any(entry.matches(layer.index, layer.name, layer.layer_class, layer.role)
                                            for layer in layers):
            raise ConfigError(f"{entry.source or 'override'}: {entry.label} names no linear layer of this model "
                              f"({len(layers)} layers; `rewrite-onnx MODEL --list-layers` lists them)")
    names = {layer.name for layer in layers}
    missing = [name for name in (config.plan.nodes if config.plan is not None else ()) if name not in names]
    if missing:
        raise ConfigError(f"plan: node {missing[0]!r} is no linear layer of this model ({len(layers)} layers)")


def decide_layer(layer: LinearLayer, config: RewriteConfig) -> LayerDecision:
    chosen: dict[str, tuple[Any, str]] = {}
    skip_reasons: list[str] = []
    defaults_off: list[str] = []  # why the techniques that are on by default are off
    for name in TECHNIQUES:
        settings, why, mentioned = _choice(name, layer, config)
        if settings is not None:
            chosen[name] = (settings, why)
        elif mentioned:
            skip_reasons.append(why)
        elif TECHNIQUES[name].default_choice().enabled:
            defaults_off.append(why)
    conflict, notes = _weight_form_conflict(layer, chosen)
    if conflict is not None:
        return LayerDecision(None, None, "; ".join([conflict, *notes]))
    if not chosen:
        return LayerDecision(None, None, "; ".join((skip_reasons or defaults_off) + notes) or "no technique is on")
    lead, partners = compose(layer.name, {name: settings for name, (settings, _) in chosen.items()})
    if TECHNIQUES[lead].quantizes and not partners and skip_reasons:
        notes.append("not gated: " + "; ".join(skip_reasons))
    why = "; ".join(why for _, why in chosen.values())
    return LayerDecision(TECHNIQUES[lead].op_type_with(partners), chosen[lead][0], why, lead=lead, partners=partners,
                         notes=tuple(notes))
