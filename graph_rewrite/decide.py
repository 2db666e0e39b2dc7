"""Decide, per layer, which techniques apply and with which settings (global choice, then the
override entries in order), and let :func:`compose` pick the technique whose op the layer becomes.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from .compose import compose
from .config import RewriteConfig
from .layers import LinearLayer
from .targets import target_includes
from .techniques import TECHNIQUES


@dataclasses.dataclass(frozen=True)
class LayerDecision:
    op_type: str | None  # None: the layer stays as it is
    settings: Any  # the lead technique's settings (None when skipped)
    why: str
    lead: str | None = None
    partners: Mapping[str, Any] = dataclasses.field(default_factory=dict)


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
        label = f"{entry.source or 'override'} (match {entry.match!r})"
        value = entry.setting(name)
        if entry.off or value == "off":
            selected, why = False, f"off by {label}"
            mentioned = mentioned or value == "off"
        elif isinstance(value, Mapping):
            selected, why, mentioned = True, f"set by {label}", True
            settings = settings.updated(value, f"{entry.source}: ")
    return (settings if selected else None), why, mentioned


def decide_layer(layer: LinearLayer, config: RewriteConfig) -> LayerDecision:
    chosen: dict[str, Any] = {}
    reasons: list[str] = []
    skip_reasons: list[str] = []
    defaults_off: list[str] = []  # why the techniques that are on by default are off
    for name in TECHNIQUES:
        settings, why, mentioned = _choice(name, layer, config)
        if settings is not None:
            chosen[name] = settings
            reasons.append(why)
        elif mentioned:
            skip_reasons.append(why)
        elif TECHNIQUES[name].default_choice().enabled:
            defaults_off.append(why)
    if not chosen:
        return LayerDecision(None, None, "; ".join(skip_reasons or defaults_off) or "no technique is on")
    lead, partners = compose(layer.name, chosen)
    return LayerDecision(TECHNIQUES[lead].op_type, chosen[lead], "; ".join(reasons), lead=lead, partners=partners)
