"""State-pack bitmap gate (MLP side): per token, skip the input blocks whose activations
are all |x| <= eps -> ``KwtaBlockMatMul`` with ``pack_*`` attributes and k_frac = 1 (exact when
eps = 0). Default target: MLP down-projections, whose inputs are the ones that can be sparse.

With KWTA on the same layer, both live in one ``KwtaBlockMatMul``: the bitmap drops the all-small
blocks, then KWTA's top-K runs on the survivors (one ordering; see docs/ops.md).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar

from ... import flag_types
from .. import op_schema
from ..errors import ConfigError
from ..rules import FLOAT32
from ..targets import TARGETS
from .base import (
    ANY_WEIGHT_FORM,
    BIAS,
    GATE,
    TARGET,
    WEIGHT,
    Flag,
    LayerWeights,
    OpBuild,
    Switch,
    Technique,
    TechniqueSettings,
)

PACK_MODES = ("binary", "ternary")
_OP = op_schema.defaults("KwtaBlockMatMul")  # the op's defaults (graph_rewrite/op_schema.json, read by C++ too)


@dataclasses.dataclass(frozen=True)
class PackSettings(TechniqueSettings):
    """The ``pack_*`` attributes of ``KwtaBlockMatMul`` (ortsparse additions, docs/ops.md). ``mode`` and
    ``eps`` are the technique's own defaults: the op's (pack_mode none, pack_eps 0) mean no bitmap and
    an exact one."""

    label: ClassVar[str] = "state-pack"
    float_fields: ClassVar[tuple[str, ...]] = ("eps", "density_max")
    always_shown: ClassVar[tuple[str, ...]] = ("mode",)

    mode: str = "binary"
    eps: float = 1e-4
    density_max: float = _OP["pack_density_max"]  # active-block density of a call above this: the bitmap is off for it
    block: int = _OP["block"]
    max_gated_rows: int = _OP["max_gated_rows"]

    def __post_init__(self) -> None:
        problems = []
        if self.mode not in PACK_MODES:
            problems.append(f"mode={self.mode!r} must be one of {', '.join(PACK_MODES)}")
        if not (isinstance(self.eps, (int, float)) and math.isfinite(self.eps) and self.eps >= 0.0):
            problems.append(f"eps={self.eps!r} must be a finite number >= 0")
        if not (isinstance(self.density_max, (int, float)) and 0.0 < self.density_max <= 1.0):
            problems.append(f"density_max={self.density_max!r} must be in (0, 1]")
        if not (isinstance(self.block, int) and self.block >= 1):
            problems.append(f"block={self.block!r} must be an integer >= 1")
        if not (isinstance(self.max_gated_rows, int) and self.max_gated_rows >= 0):
            problems.append(f"max_gated_rows={self.max_gated_rows!r} must be an integer >= 0")
        if problems:
            raise ConfigError("invalid state-pack settings: " + "; ".join(problems))

    def is_exact(self, k: int) -> bool:
        # eps = 0 drops only blocks that are exactly zero; auto-off runs dense.
        return self.eps == 0.0

    def attributes(self) -> dict[str, Any]:
        return {"pack_mode": self.mode, "pack_eps": float(self.eps), "pack_density_max": float(self.density_max)}


_D = PackSettings()


class Pack(Technique):
    name = "pack"
    kind = GATE
    op_type = "KwtaBlockMatMul"
    settings_type = PackSettings
    weight_forms = ANY_WEIGHT_FORM
    title = "State-pack bitmap gate (KwtaBlockMatMul pack_*); --config entries ('pack') override per layer"
    switch = Switch("--state-pack", field="mode", choices=("none",) + PACK_MODES, default="none", off="none",
                    help="skip input blocks whose activations are all |x| <= eps (binary and ternary skip the same "
                         "blocks; default none)")
    flags = (
        Flag("--state-pack-eps", field="eps", type=flag_types.non_negative_float, default=_D.eps, metavar="EPS",
             help=f"activity threshold; 0 = exact (default {_D.eps})"),
        Flag("--state-pack-density-max", field="density_max", type=flag_types.fraction,
             default=_D.density_max, metavar="RHO",
             help=f"a call whose active-block density is above RHO runs without the bitmap (default "
                  f"{_D.density_max}; 1 = never)"),
        Flag("--state-pack-popcnt", action="store_true",
             help="accepted for compatibility: the popcount path (VPOPCNTDQ, POPCNT, portable) is always "
                  "chosen at run time; ORTSPARSE_POPCNT forces one"),
        Flag("--state-pack-block", field="block", type=flag_types.positive_int, default=_D.block, metavar="ROWS",
             help=f"rows of W per block (default {_D.block}; with KWTA on the layer, KWTA's block is used)"),
        Flag("--state-pack-max-gated-rows", field="max_gated_rows", type=flag_types.non_negative_int,
             default=_D.max_gated_rows,
             metavar="M", help="calls with more than M rows (prefill) run dense; 0 = gate every call"),
        Flag("--state-pack-target", field=TARGET, choices=TARGETS, default="down",
             help="layers to gate (default down: MLP down-projections)"),
    )

    def build(self, layer: LayerWeights, settings: PackSettings, partners: Mapping[str, Any]) -> OpBuild:
        kwta = partners.get("kwta")
        notes = []
        if kwta is not None:
            if kwta.duty != 1:
                raise ConfigError(f"layer '{layer.name}': state-pack composes with KWTA only at duty=1 "
                                  f"(got duty={kwta.duty})")
            emitted = kwta.for_layer(layer.k)
            attributes = emitted.attributes()
            exact = settings.is_exact(layer.k) and emitted.is_exact(layer.k)
            notes.append("bitmap then KWTA top-K on the surviving blocks (one KwtaBlockMatMul)")
        else:
            block = min(settings.block, layer.k)
            if block != settings.block:
                notes.append(f"block {settings.block} > K={layer.k}: block set to K")
            attributes = {"k_frac": 1.0, "block": int(block), "max_gated_rows": int(settings.max_gated_rows)}
            exact = settings.is_exact(layer.k)
        attributes.update(settings.attributes())
        return OpBuild(self.op_type, [WEIGHT, BIAS], {**layer.weight_attributes, **attributes}, notes=notes,
                       exact=exact and layer.weight_form == FLOAT32)


PACK = Pack()
