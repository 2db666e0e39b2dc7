"""Which techniques may share one layer, and which of them emits the op.

Rules (seeds + docs/ops.md): a layer has at most one weight technique (TT, proc-sparse or weight
quantization: the weight backend is exclusive); a weight technique leads and the gates chosen with it become its
op's gate; without one, the gate techniques lead in ``GATE_LEAD_ORDER`` (event-driven takes KWTA
as its candidate prior, one ordering in one op, never two ops). ``PARTNERS`` lists what each lead
can absorb; anything else is a clear error naming the layer and the techniques, never a silent
choice.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .errors import ConfigError
from .techniques import GATE, TECHNIQUES, WEIGHTS
from .techniques.popcount import check_composition

GATE_LEAD_ORDER: tuple[str, ...] = ("event", "pack", "kwta")

# lead technique -> techniques its op can take as partners (e.g. KWTA as the gate of a weight op).
PARTNERS: dict[str, frozenset[str]] = {
    "kwta": frozenset(),
    "event": frozenset({"kwta"}),
    "proc": frozenset({"kwta"}),
    "pack": frozenset({"kwta"}),  # bitmap then KWTA on the survivors, one KwtaBlockMatMul
    "tt": frozenset(),  # TTMatMul runs the dense gate only (a core mixes every row: gating saves nothing)
    "quant": frozenset({"kwta", "pack"}),  # quantized weights, gated by KwtaBlockMatMul's quantized form
}


def compose(layer_name: str, chosen: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """(lead technique, {partner: settings}) for the techniques ``chosen`` for one layer."""
    weights = [name for name in chosen if TECHNIQUES[name].kind == WEIGHTS]
    if len(weights) > 1:
        raise ConfigError(f"layer '{layer_name}': {' and '.join(weights)} are both selected, but a layer has one "
                          "weight backend; separate them with --<technique>-target or a per-layer override")
    if weights:
        lead = weights[0]
    else:
        gates = [name for name in GATE_LEAD_ORDER if name in chosen]
        gates += [name for name in chosen if TECHNIQUES[name].kind == GATE and name not in gates]
        lead = gates[0]
    partners = {name: settings for name, settings in chosen.items() if name != lead}
    refused = sorted(set(partners) - PARTNERS.get(lead, frozenset()))
    if refused:
        raise ConfigError(f"layer '{layer_name}': {TECHNIQUES[lead].op_type} ({lead}) cannot be combined with "
                          f"{', '.join(refused)} on the same layer; separate them with --<technique>-target or a "
                          "per-layer override")
    return lead, partners


def check_attention(config) -> None:
    """Popcount-approximate attention scores (no exact refine) and event-driven on
    attention must not share a score. ``config`` is a RewriteConfig (which runs this once, when it
    is made); event-driven is the registry's ``event`` technique when it exists."""
    event = config.choice("event") if "event" in TECHNIQUES else None
    on_attention = bool(event and event.enabled and event.target in ("attn", "both", "all"))
    check_composition(config.attention, on_attention)
