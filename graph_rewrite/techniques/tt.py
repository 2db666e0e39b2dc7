"""TT / low-rank factors: W [K, N] -> TT-matrix cores -> ``TTMatMul``.

A weight technique (exclusive per layer: TT xor proc-sparse). Per layer, at build time:
``rank > 0`` factors at that rank; ``rank = 0`` autotunes (the smallest rank whose output gap on the
layer's calibration inputs is <= ``gap``). Either way the layer stays dense (the node is not
rewritten, the report says why) when the gap exceeds ``gap`` or the FLOP ratio is below
``min_flop_ratio`` (no speed benefit). Without calibration inputs the gap is measured with X = I,
i.e. it is the relative weight error ||W - W~||_F / ||W||_F (the report says so).
"""
from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from ortsparse import tt

from ... import flag_types
from .. import op_schema
from ..errors import ConfigError
from ..targets import TARGETS
from .base import (
    BIAS,
    TARGET,
    WEIGHT,
    WEIGHTS,
    Flag,
    LayerWeights,
    OpBuild,
    Switch,
    Technique,
    TechniqueSettings,
)

TT_LAYOUTS = ("lowrank", "balanced")
TT_METHODS = ("auto", "svd", "svd-whitened", "cross")
# "auto" uses TT-cross above this many weight entries (a full SVD of a 4096 x 4096 matrix is
# already ~1 minute here) and TT-SVD below it; the whitened SVD when calibration inputs exist.
CROSS_MIN_ENTRIES = 1 << 24
_OP = op_schema.defaults("TTMatMul")  # the op's defaults (graph_rewrite/op_schema.json, read by C++ too)


@dataclasses.dataclass(frozen=True)
class TTSettings(TechniqueSettings):
    """Build settings of ``TTMatMul`` layers. Only the cores' modes/ranks, the measured gap and
    nan_guard become node attributes; the rest steers the offline factorisation."""

    label: ClassVar[str] = "TT"
    float_fields: ClassVar[tuple[str, ...]] = ("gap", "min_flop_ratio")
    always_shown: ClassVar[tuple[str, ...]] = ("rank",)

    rank: int = 4  # 0: autotune by gap
    maxvol_k: int = 8  # extra fibres per interface of TT-cross (index sets of rank + maxvol_k)
    gap: float = 0.02  # output-gap tolerance on calibration inputs; 0: no gap check
    layout: str = "lowrank"  # lowrank (d = 2, in [K, 1] out [1, N]) | balanced
    d: int = 2  # cores (balanced layout)
    method: str = "auto"
    min_flop_ratio: float = 1.5  # dense / TT multiply-adds a layer must reach; 0: no check
    nan_guard: int = _OP["nan_guard"]
    keep_dense: int = 0  # 1: keep W as the NaN guard's dense fallback (W_dense input; costs memory)

    def __post_init__(self) -> None:
        problems = []
        if not (isinstance(self.rank, int) and self.rank >= 0):
            problems.append(f"rank={self.rank!r} must be an integer >= 0 (0: autotune)")
        if not (isinstance(self.maxvol_k, int) and self.maxvol_k >= 0):
            problems.append(f"maxvol_k={self.maxvol_k!r} must be an integer >= 0")
        if not (isinstance(self.gap, (int, float)) and self.gap >= 0 and math.isfinite(self.gap)):
            problems.append(f"gap={self.gap!r} must be a finite number >= 0")
        if self.layout not in TT_LAYOUTS:
            problems.append(f"layout={self.layout!r} must be one of {', '.join(TT_LAYOUTS)}")
        if not (isinstance(self.d, int) and self.d >= 2):
            problems.append(f"d={self.d!r} must be an integer >= 2")
        elif self.layout == "lowrank" and self.d != 2:
            problems.append(f"d={self.d} needs layout=balanced (lowrank has d = 2)")
        if self.method not in TT_METHODS:
            problems.append(f"method={self.method!r} must be one of {', '.join(TT_METHODS)}")
        if self.method == "svd-whitened" and self.layout != "lowrank":
            problems.append("method=svd-whitened needs layout=lowrank")
        if not (isinstance(self.min_flop_ratio, (int, float)) and self.min_flop_ratio >= 0):
            problems.append(f"min_flop_ratio={self.min_flop_ratio!r} must be >= 0")
        for name in ("nan_guard", "keep_dense"):
            if getattr(self, name) not in (0, 1) or isinstance(getattr(self, name), float):
                problems.append(f"{name}={getattr(self, name)!r} must be 0 or 1")
        if self.rank == 0 and self.gap == 0:
            problems.append("rank=0 (autotune) needs a gap tolerance > 0")
        if problems:
            raise ConfigError("invalid TT settings: " + "; ".join(problems))

    def method_for(self, k: int, n: int, calibrated: bool) -> str:
        if self.method != "auto":
            return self.method
        if self.layout == "lowrank" and calibrated:
            return "svd-whitened"
        return "cross" if k * n > CROSS_MIN_ENTRIES else "svd"

    def attributes(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_D = TTSettings()


class TT(Technique):
    name = "tt"
    kind = WEIGHTS
    op_type = "TTMatMul"
    settings_type = TTSettings
    title = "TT / low-rank factors (TTMatMul) global settings; --config entries override per layer"
    switch = Switch("--tt", choices=("on", "off"), default="off",
                    help="replace weights by TT-matrix / low-rank cores (default off)")
    flags = (
        Flag("--tt-target", field=TARGET, choices=TARGETS, default="mlp", help="layers to factor (default mlp)"),
        Flag("--tt-rank", field="rank", type=flag_types.non_negative_int, default=_D.rank, metavar="R",
             help=f"max TT rank; 0 = autotune the smallest rank meeting --tt-gap (default {_D.rank})"),
        Flag("--tt-maxvol-k", field="maxvol_k", type=flag_types.non_negative_int, default=_D.maxvol_k, metavar="K",
             help=f"TT-cross: extra fibres per interface beyond the rank, chosen by maxvol (default {_D.maxvol_k})"),
        Flag("--tt-gap", field="gap", type=flag_types.non_negative_float, default=_D.gap, metavar="TOL",
             help="output-gap tolerance ||XW - XW~|| / ||XW + b|| on calibration inputs; a layer over it stays "
                  f"dense; 0 = no check (default {_D.gap})"),
        Flag("--tt-layout", field="layout", choices=TT_LAYOUTS, default=_D.layout,
             help="lowrank: W = U V (d = 2); balanced: K and N split into --tt-d modes"),
        Flag("--tt-d", field="d", type=flag_types.int_in(2),
             default=_D.d, metavar="D", help="cores of the balanced layout"),
        Flag("--tt-method", field="method", choices=TT_METHODS, default=_D.method,
             help="auto: whitened SVD with calibration inputs (lowrank), TT-cross for matrices over 2^24 entries, "
                  "else TT-SVD"),
        Flag("--tt-min-flop-ratio", field="min_flop_ratio", type=flag_types.non_negative_float,
             default=_D.min_flop_ratio, metavar="X",
             help=f"layers whose dense/TT multiply-add ratio is below X stay dense (default {_D.min_flop_ratio}; "
                  "the kernel reaches >= 0.7 x the FLOP ratio)"),
        Flag("--tt-keep-dense", field="keep_dense", type=int, choices=(0, 1), default=_D.keep_dense,
             help="keep W as the NaN guard's dense fallback (memory!) (default 0)"),
    )

    def build(self, layer: LayerWeights, settings: TTSettings, partners: Mapping[str, Any]) -> OpBuild | None:
        w = layer.weight()
        bias = layer.bias()
        x = layer.calibration
        notes = []
        if x is None:
            x = np.eye(layer.k, dtype=np.float32)
            bias_for_gap = None
            notes.append("no calibration inputs: gap = relative weight error (X = I)")
        else:
            x = np.asarray(x, dtype=np.float32).reshape(-1, layer.k)
            bias_for_gap = bias
        method = settings.method_for(layer.k, layer.n, layer.calibration is not None)
        if settings.rank == 0:
            result = tt.autotune(w, x, settings.gap, name=layer.name, bias=bias_for_gap, layout=settings.layout,
                                 d=settings.d, method=method, maxvol_k=settings.maxvol_k,
                                 min_flop_ratio=settings.min_flop_ratio)
        else:
            result = tt.build(w, settings.rank, name=layer.name, layout=settings.layout, d=settings.d, method=method,
                              x=x, bias=bias_for_gap, maxvol_k=settings.maxvol_k)
            if settings.gap > 0 and result.gap > settings.gap:
                result.decision = "dense"
                result.reason = f"gap {result.gap:.4f} > {settings.gap} at rank {settings.rank}"
            elif result.flop_ratio < settings.min_flop_ratio:
                result.decision = "dense"
                result.reason = (f"FLOP ratio {result.flop_ratio:.2f} < {settings.min_flop_ratio} at rank "
                                 f"{settings.rank}: no speed benefit")
        meta = {key: value for key, value in result.metadata().items() if key != "tried"}
        if result.decision != "tt":
            return OpBuild(None, [], {}, notes=[f"kept dense: {result.reason}", *notes],
                           metadata={"ortsparse.tt": json.dumps(meta, default=float)})
        notes.insert(0, f"TT {result.method} modes {result.in_modes}x{result.out_modes} ranks {result.ranks} "
                        f"gap {result.gap:.4f} FLOP ratio {result.flop_ratio:.2f} memory {result.mem_ratio:.1%}")
        return OpBuild(self.op_type, [tt.concat_cores(result.cores), BIAS, WEIGHT if settings.keep_dense else None],
                       tt.node_attributes(result, settings.nan_guard),
                       metadata={"ortsparse.tt": json.dumps(meta, default=float)}, notes=notes, exact=False)


TT_TECHNIQUE = TT()
