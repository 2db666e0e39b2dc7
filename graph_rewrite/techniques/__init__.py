"""The registry of techniques, in the order the CLI lists them. Adding a technique = one module
with its settings, flags and build (see base.py) + one line here + its composition rules in
``graph_rewrite/compose.py``."""
from __future__ import annotations

from .base import (
    BIAS,
    GATE,
    WEIGHT,
    WEIGHTS,
    LayerWeights,
    OpBuild,
    Technique,
    TechniqueChoice,
    TechniqueSettings,
)
from .event import EVENT, EVENT_AXES, EventSettings
from .kwta import KWTA, KWTA_DUTY_MODES, KWTA_SCORES, KwtaSettings
from .pack import PACK, PACK_MODES, PackSettings
from .proc import PROC, ProcSettings
from .tt import TT_TECHNIQUE, TTSettings

TECHNIQUES: dict[str, Technique] = {t.name: t for t in (KWTA, EVENT, PACK, PROC, TT_TECHNIQUE)}


def technique(name: str) -> Technique:
    return TECHNIQUES[name]


__all__ = [
    "BIAS", "EVENT", "EVENT_AXES", "EventSettings", "GATE", "KWTA", "KWTA_DUTY_MODES", "KWTA_SCORES", "PACK",
    "PACK_MODES", "PROC", "TECHNIQUES", "WEIGHT", "WEIGHTS", "KwtaSettings", "LayerWeights", "OpBuild", "PackSettings",
    "ProcSettings", "Technique", "TechniqueChoice", "TechniqueSettings", "TTSettings", "TT_TECHNIQUE", "technique",
]
