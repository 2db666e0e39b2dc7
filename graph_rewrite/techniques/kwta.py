"""KWTA: per token, keep the top-K input blocks by score -> ``KwtaBlockMatMul``.

Float32 weights and MatMulNBits' quantized ones alike (the op's quantized form takes B, scales and
zero points as stored, with K, N, bits and block_size).

As a partner of another technique on the same layer, KWTA is that op's gate (``kwta_*``
attributes of ProcSparseMatMul; the candidate prior ``kwta_k`` of EventDrivenMatMul).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar

from ... import flag_types
from .. import op_schema
from ..errors import ConfigError
from ..targets import TARGETS
from ..rules import FLOAT32
from .base import (
    ANY_WEIGHT_FORM,
    AUTO,
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

KWTA_SCORES = ("l2", "mean_abs", "l2_weighted")
KWTA_DUTY_MODES = ("dense", "hold")
_OP = op_schema.defaults("KwtaBlockMatMul")  # the op's defaults (graph_rewrite/op_schema.json, read by C++ too)


@dataclasses.dataclass(frozen=True)
class KwtaSettings(TechniqueSettings):
    """Attributes of ``KwtaBlockMatMul`` (see docs/ops.md). ``block`` defaults to 1 (single rows:
    measured best for quality), not to a vectorisation-friendly 16/32."""

    label: ClassVar[str] = "KWTA"
    float_fields: ClassVar[tuple[str, ...]] = ("k_frac", "threshold", "temp")
    always_shown: ClassVar[tuple[str, ...]] = ("block",)

    k_frac: float = _OP["k_frac"]
    k_abs: int = _OP["k_abs"]
    score: str = _OP["score"]
    threshold: float = _OP["threshold"]
    temp: float = _OP["temp"]
    duty: int = _OP["duty"]
    duty_mode: str = _OP["duty_mode"]
    renorm: int = _OP["renorm"]
    block: int = _OP["block"]
    max_gated_rows: int = _OP["max_gated_rows"]  # > 0: calls with more rows (prefill) run dense; 0: always gate

    def __post_init__(self) -> None:
        problems = []
        if not (isinstance(self.k_frac, (int, float)) and 0.0 < self.k_frac <= 1.0):
            problems.append(f"k_frac={self.k_frac!r} must be in (0, 1]")
        if not (isinstance(self.k_abs, int) and self.k_abs >= 0):
            problems.append(f"k_abs={self.k_abs!r} must be an integer >= 0")
        if self.score not in KWTA_SCORES:
            problems.append(f"score={self.score!r} must be one of {', '.join(KWTA_SCORES)}")
        if not (isinstance(self.threshold, (int, float)) and self.threshold >= 0.0):
            problems.append(f"threshold={self.threshold!r} must be >= 0")
        if not (isinstance(self.temp, (int, float)) and self.temp > 0.0 and math.isfinite(self.temp)):
            problems.append(f"temp={self.temp!r} must be a finite number > 0")
        if not (isinstance(self.duty, int) and self.duty >= 1):
            problems.append(f"duty={self.duty!r} must be an integer >= 1")
        if self.duty_mode not in KWTA_DUTY_MODES:
            problems.append(f"duty_mode={self.duty_mode!r} must be one of {', '.join(KWTA_DUTY_MODES)}")
        if self.renorm not in (0, 1) or isinstance(self.renorm, float):
            problems.append(f"renorm={self.renorm!r} must be 0 or 1")
        if not (isinstance(self.block, int) and self.block >= 1):
            problems.append(f"block={self.block!r} must be an integer >= 1")
        if not (isinstance(self.max_gated_rows, int) and self.max_gated_rows >= 0):
            problems.append(f"max_gated_rows={self.max_gated_rows!r} must be an integer >= 0")
        if problems:
            raise ConfigError("invalid KWTA settings: " + "; ".join(problems))

    def for_layer(self, k: int | None) -> KwtaSettings:
        """Settings as emitted for a layer with K inputs: the op rejects block > K."""
        return dataclasses.replace(self, block=min(self.block, k)) if k else self

    def is_exact(self, k: int) -> bool:
        """True when the op keeps every input block for a layer with K inputs (same result as a
        dense MatMul, up to float rounding)."""
        if self.threshold > 0.0:
            return False
        if self.k_abs > 0:
            return self.k_abs >= k
        return self.k_frac >= 1.0

    def attributes(self) -> dict[str, Any]:
        # Every attribute is written, defaults included: the op's defaults may move (block is to be
        # chosen from benchmarks) and a rewritten file should mean the same thing forever.
        return {
            "k_frac": float(self.k_frac), "k_abs": int(self.k_abs), "score": self.score,
            "threshold": float(self.threshold), "temp": float(self.temp), "duty": int(self.duty),
            "duty_mode": self.duty_mode, "renorm": int(self.renorm), "block": int(self.block),
            "max_gated_rows": int(self.max_gated_rows),
        }


_D = KwtaSettings()


class Kwta(Technique):
    name = "kwta"
    kind = GATE
    op_type = "KwtaBlockMatMul"
    settings_type = KwtaSettings
    weight_forms = ANY_WEIGHT_FORM
    title = "KWTA (KwtaBlockMatMul) global settings; --config entries override per layer"
    # The tool's default technique: "auto" = on for MLP layers unless another technique or
    # attention is on (RewriteConfig resolves it, for the CLI and library callers alike).
    switch = Switch("--kwta", choices=("on", "off", AUTO), default=AUTO,
                    help="rewrite with KWTA gating (default auto: on unless another technique or --attn is on)")
    flags = (
        Flag("--kwta-target", field=TARGET, choices=TARGETS, default="mlp",
             help="layers to gate: mlp, attn (q/k/v/out projections), both, down (MLP down projections), all "
                  "(also head and other) (default mlp)"),
        Flag("--kwta-k", field="k_frac", type=flag_types.fraction, default=_D.k_frac, metavar="FRAC",
             help=f"k_frac: fraction of input blocks kept per row, (0, 1] (default {_D.k_frac})"),
        Flag("--kwta-k-abs", field="k_abs", type=flag_types.non_negative_int, default=_D.k_abs, metavar="N",
             help="k_abs: input columns kept per row (overrides --kwta-k when > 0)"),
        Flag("--kwta-score", field="score", choices=KWTA_SCORES, default=_D.score, help="block score (default l2)"),
        Flag("--kwta-threshold", field="threshold", type=flag_types.non_negative_float,
             default=_D.threshold, metavar="T",
             help="keep blocks whose score >= T (capped at the top-K count when k_frac < 1)"),
        Flag("--kwta-temp", field="temp", type=flag_types.positive_float,
             default=_D.temp, metavar="T", help="softmax temperature"),
        Flag("--kwta-duty", field="duty", type=flag_types.positive_int,
             default=_D.duty, metavar="N", help="gate every N-th call"),
        Flag("--kwta-duty-mode", field="duty_mode", choices=KWTA_DUTY_MODES, default=_D.duty_mode,
             help="dense: run dense between gated calls; hold: reuse the last mask"),
        Flag("--kwta-renorm", field="renorm", type=int, choices=(0, 1), default=_D.renorm,
             help="scale the gated product by blocks_total/blocks_kept (default 0: off)"),
        Flag("--kwta-max-gated-rows", field="max_gated_rows", type=flag_types.non_negative_int,
             default=_D.max_gated_rows,
             metavar="M", help="calls with more than M rows of X (prefill) run dense; 0 = gate every call (default)"),
        Flag("--kwta-block", field="block", type=flag_types.positive_int, default=_D.block, metavar="ROWS",
             help=f"rows of W per block (default {_D.block}: single rows)"),
    )

    def build(self, layer: LayerWeights, settings: KwtaSettings, partners: Mapping[str, Any]) -> OpBuild:
        emitted = settings.for_layer(layer.k)
        notes = [f"block {settings.block} > K={layer.k}: block set to K"] if emitted.block != settings.block else []
        # A quantized weight is never "exact": >= 4 dense rows run on int8 activations.
        return OpBuild(self.op_type, [WEIGHT, BIAS], {**layer.weight_attributes, **emitted.attributes()}, notes=notes,
                       exact=emitted.is_exact(layer.k) and layer.weight_form == FLOAT32)


KWTA = Kwta()
