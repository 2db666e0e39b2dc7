"""The registry of techniques, in the order the CLI lists them. Adding a technique = one module
with its settings, flags (as data) and build (see base.py) + one line here + its composition rules
in ``graph_rewrite/compose.py``."""
from __future__ import annotations

from .base import (
    AUTO,
    BIAS,
    GATE,
    TARGET,
    WEIGHT,
    WEIGHTS,
    Flag,
    FlagGroup,
    LayerWeights,
    OpBuild,
    Switch,
    Technique,
    TechniqueChoice,
    TechniqueSettings,
)
from .event import EVENT, EVENT_AXES, EventSettings
from .kwta import KWTA, KWTA_DUTY_MODES, KWTA_SCORES, KwtaSettings
from .pack import PACK, PACK_MODES, PackSettings
from .popcount import ATTENTION, ATTENTION_FLAGS, CORES
from .proc import PROC, ProcSettings
from .quant import QUANT, QUANT_DTYPES, QuantSettings
from .tt import TT_TECHNIQUE, TTSettings

# Per linear layer (override keys), then per attention core.
TECHNIQUES: dict[str, Technique] = {t.name: t for t in (KWTA, EVENT, PACK, PROC, TT_TECHNIQUE, QUANT)}
CORE_TECHNIQUES = {ATTENTION.name: ATTENTION}


def technique(name: str) -> Technique:
    return TECHNIQUES[name]


def flag_groups() -> list[FlagGroup]:
    """Every rewrite flag, one group per technique (registry order, the core techniques last): the
    CLI builds its argparse groups from these."""
    return [t.flag_group() for t in (*TECHNIQUES.values(), *CORE_TECHNIQUES.values())]


__all__ = [
    "ATTENTION", "ATTENTION_FLAGS", "AUTO", "CORE_TECHNIQUES", "CORES", "BIAS", "EVENT", "EVENT_AXES",
    "EventSettings", "Flag", "FlagGroup", "GATE", "KWTA", "KWTA_DUTY_MODES", "KWTA_SCORES", "PACK", "PACK_MODES",
    "PROC", "QUANT", "QUANT_DTYPES", "Switch", "TARGET", "TECHNIQUES", "WEIGHT", "WEIGHTS", "KwtaSettings",
    "LayerWeights", "OpBuild", "PackSettings", "ProcSettings", "QuantSettings", "Technique", "TechniqueChoice",
    "TechniqueSettings", "TTSettings", "TT_TECHNIQUE", "flag_groups", "technique",
]
