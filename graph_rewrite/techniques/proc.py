"""Proc-sparse: W -> hash base + per output unit the deltas of its top-`fanout` K-blocks
-> ``ProcSparseMatMul``. A weight technique (exclusive per layer); KWTA chosen for the same layer
becomes the op's gate (``kwta_*`` attributes, the composed mode).

Before -> After: ``MatMul(X, W) [+ B]`` -> ``ProcSparseMatMul(X, indices, deltas, B?)`` with the
builder's packed ``indices`` (uint16 [N, F]) and ``deltas`` (float16/float32 [N, F, block]); W is
dropped when nothing else uses it.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar

from ortsparse.proc_sparse import block_importance, build_proc_sparse

from ... import flag_types
from .. import op_schema
from ..errors import ConfigError
from ..targets import TARGETS
from .base import BIAS, TARGET, WEIGHTS, Flag, LayerWeights, OpBuild, Switch, Technique, TechniqueSettings

PROC_SCORES = ("delta", "wanda")
PROC_DELTA_DTYPES = ("float16", "float32")
_OP = op_schema.defaults("ProcSparseMatMul")  # the op's defaults (graph_rewrite/op_schema.json, read by C++ too)


@dataclasses.dataclass(frozen=True)
class ProcSettings(TechniqueSettings):
    """Builder settings of ``ProcSparseMatMul`` (docs/ops.md#procsparsematmul).

    fanout: kept K-blocks per output unit; fanout_frac > 0 overrides it with a fraction of the
    layer's blocks (ceil). base_scale defaults to 0 (pure block-sparse): the hash base does not
    correlate with trained weights and costs ~4x kernel time (docs/ops.md). score: ``delta`` =
    ||W_b - base_b||; ``wanda`` = ||W_b - base_b|| * E||x_b|| over calibration inputs (falls
    back to ``delta`` for a layer without them, with a note).
    """

    label: ClassVar[str] = "proc-sparse"
    float_fields: ClassVar[tuple[str, ...]] = ("fanout_frac", "base_scale", "shed_eps")
    always_shown: ClassVar[tuple[str, ...]] = ("block",)

    fanout: int = 64
    fanout_frac: float = 0.0
    block: int = _OP["block"]
    base_scale: float = _OP["base_scale"]
    seed: int = _OP["seed"]
    shed_eps: float = 1e-3
    watermark: int = 4096
    score: str = "delta"
    delta_dtype: str = "float16"

    def __post_init__(self) -> None:
        problems = []
        if not (isinstance(self.fanout, int) and self.fanout >= 1):
            problems.append(f"fanout={self.fanout!r} must be an integer >= 1")
        if not (isinstance(self.fanout_frac, (int, float)) and 0.0 <= self.fanout_frac <= 1.0):
            problems.append(f"fanout_frac={self.fanout_frac!r} must be in [0, 1] (0: use fanout)")
        if not (isinstance(self.block, int) and self.block >= 1):
            problems.append(f"block={self.block!r} must be an integer >= 1")
        if not (isinstance(self.base_scale, (int, float)) and math.isfinite(self.base_scale)):
            problems.append(f"base_scale={self.base_scale!r} must be a finite number")
        if not (isinstance(self.seed, int) and 0 <= self.seed < 2 ** 63):
            problems.append(f"seed={self.seed!r} must be an integer in [0, 2^63)")
        if not (isinstance(self.shed_eps, (int, float)) and self.shed_eps >= 0.0):
            problems.append(f"shed_eps={self.shed_eps!r} must be >= 0")
        if not (isinstance(self.watermark, int) and self.watermark >= 0):
            problems.append(f"watermark={self.watermark!r} must be an integer >= 0 (0: no cap)")
        if self.score not in PROC_SCORES:
            problems.append(f"score={self.score!r} must be one of {', '.join(PROC_SCORES)}")
        if self.delta_dtype not in PROC_DELTA_DTYPES:
            problems.append(f"delta_dtype={self.delta_dtype!r} must be one of {', '.join(PROC_DELTA_DTYPES)}")
        if problems:
            raise ConfigError("invalid proc-sparse settings: " + "; ".join(problems))

    def for_layer(self, k: int | None) -> ProcSettings:
        return dataclasses.replace(self, block=min(self.block, k)) if k else self

    def fanout_for(self, k: int) -> int:
        nb = math.ceil(k / self.block)
        if self.fanout_frac > 0:
            return max(1, min(nb, math.ceil(self.fanout_frac * nb - 1e-9)))
        return min(self.fanout, nb)

    def is_exact(self, k: int) -> bool:
        return (self.fanout_for(k) == math.ceil(k / self.block) and self.base_scale == 0.0 and self.shed_eps == 0.0
                and self.watermark == 0 and self.delta_dtype == "float32")

    def attributes(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def kwta_gate_attributes(kwta: Any, k: int) -> dict[str, Any]:
    """KWTA settings as ProcSparseMatMul's kwta_* gate attributes."""
    return {f"kwta_{name}": value for name, value in kwta.for_layer(k).attributes().items()}


_D = ProcSettings()
PROC_MAX_BLOCKS = 65536  # ProcSparseMatMul stores block indices as uint16


class Proc(Technique):
    name = "proc"
    kind = WEIGHTS
    op_type = "ProcSparseMatMul"
    settings_type = ProcSettings
    title = "proc-sparse (ProcSparseMatMul) global settings; --config entries (key \"proc\") override per layer"
    switch = Switch("--proc-sparse", choices=("on", "off"), default="off",
                    help="replace weights by hash base + top-fanout block deltas (default off)")
    flags = (
        Flag("--proc-target", field=TARGET, choices=TARGETS, default="mlp", help="layers to replace (default mlp)"),
        Flag("--proc-fanout", field="fanout", type=flag_types.positive_int, default=_D.fanout, metavar="BLOCKS",
             help=f"K-blocks kept per output unit (default {_D.fanout}; clamped to the layer's blocks)"),
        Flag("--proc-fanout-frac", field="fanout_frac", type=flag_types.unit_interval,
             default=_D.fanout_frac, metavar="FRAC",
             help="if > 0: fraction of each layer's blocks kept per unit (overrides --proc-fanout)"),
        Flag("--proc-block", field="block", type=flag_types.positive_int, default=_D.block, metavar="ROWS",
             help=f"rows per block (default {_D.block})"),
        Flag("--proc-base-scale", field="base_scale", type=flag_types.any_finite, default=_D.base_scale, metavar="S",
             help="hash base amplitude (default 0: pure block-sparse)"),
        Flag("--proc-seed", field="seed", type=flag_types.int_in(0, 2**63 - 1),
             default=_D.seed, help="hash seed (default 0)"),
        Flag("--proc-shed-eps", field="shed_eps", type=flag_types.non_negative_float,
             default=_D.shed_eps, metavar="EPS",
             help=f"soft shedding: deltas with |d| < EPS are dropped (default {_D.shed_eps})"),
        Flag("--proc-watermark", field="watermark", type=flag_types.non_negative_int, default=_D.watermark, metavar="N",
             help=f"hard cap of stored nonzero deltas per unit, 0 = none (default {_D.watermark})"),
        Flag("--proc-score", field="score", choices=PROC_SCORES, default=_D.score,
             help="block selection: delta (seed: ||W_b - base_b||) or wanda (x E||x_b||, needs calibration)"),
        Flag("--proc-delta-dtype", field="delta_dtype", choices=PROC_DELTA_DTYPES, default=_D.delta_dtype,
             help="stored delta precision (default float16: half the bytes)"),
    )

    def build(self, layer: LayerWeights, settings: ProcSettings, partners: Mapping[str, Any]) -> OpBuild:
        s = settings.for_layer(layer.k)
        blocks = math.ceil(layer.k / s.block)
        if blocks > PROC_MAX_BLOCKS:  # the op's block indices are uint16
            raise ConfigError(f"proc-sparse on layer {layer.name}: K={layer.k} in blocks of {s.block} rows gives {blocks} "
                              f"blocks, more than the {PROC_MAX_BLOCKS} ProcSparseMatMul can index; use a block of "
                              f">= {math.ceil(layer.k / PROC_MAX_BLOCKS)} rows (--proc-block)")
        notes = [f"block {settings.block} > K={layer.k}: block set to K"] if s.block != settings.block else []
        importance = None
        if s.score == "wanda":
            if layer.calibration is None:
                notes.append("score wanda without calibration inputs for this layer: seed rule (delta) used")
            else:
                importance = block_importance(layer.calibration, s.block)
        packed = build_proc_sparse(layer.weight(), block=s.block, fanout=s.fanout_for(layer.k),
                                   base_scale=s.base_scale, seed=s.seed, shed_eps=s.shed_eps,
                                   watermark=s.watermark, delta_dtype=s.delta_dtype, importance=importance)
        attributes = packed.attributes()
        if "kwta" in partners:
            attributes.update(kwta_gate_attributes(partners["kwta"], layer.k))
        stats = packed.stats()
        notes.append(f"proc: fanout {packed.fanout}/{stats['blocks']} blocks, mem_ratio {packed.mem_ratio:.3f}, "
                     f"trims soft {packed.soft_trims} hard {packed.hard_trims}")
        exact = s.is_exact(layer.k) and "kwta" not in partners
        metadata = {"ortsparse.proc.mem_ratio": f"{packed.mem_ratio:.6f}",
                    "ortsparse.proc.trims": str(packed.soft_trims + packed.hard_trims)}
        return OpBuild(self.op_type, [packed.indices, packed.deltas, BIAS], attributes, metadata=metadata,
                       notes=notes, exact=exact)


PROC = Proc()

__all__ = ["PROC", "PROC_DELTA_DTYPES", "PROC_SCORES", "ProcSettings", "kwta_gate_attributes"]
