"""Weight quantization (``--weights int8|int4``): a float32 layer's weight -> MatMulNBits'
block-quantized form, made by onnxruntime's own quantizer (``DefaultWeightOnlyQuantizer``, the
code behind ``onnxruntime.quantization.matmul_nbits_quantizer``). The defaults are the settings
onnxruntime-genai's model builder uses for its CPU models: block_size 32, symmetric (no zero
points), accuracy_level 4.

A weight technique (one per layer: not with proc-sparse or TT). Alone it emits
``com.microsoft.MatMulNBits`` (quantized, not gated); with KWTA or the bitmap gate chosen for the
same layer, that gate's ``KwtaBlockMatMul`` on the quantized form: quantized and gated in one
rewrite. The default target is ``all``: the head (lm_head) is quantized like every other layer.
An already quantized layer (a MatMulNBits of the input) is left to the other techniques.

Before -> After (the rule that matched stays what it was; one quantized copy per original
initializer, named as onnxruntime's quantizer names it, the float original dropped when nothing
else reads it)::

    Y = MatMul(X, W) [+ b]      (any float rule: Gemm, MatMul+Add, MatMul(X, Transpose(E)), MatMul)
    ->
    Y = com.microsoft.MatMulNBits(X, W_Q8, W_scales[, W_zero_points], , b?, K, N, bits, block_size,
                                  accuracy_level)                                  (not gated)
    Y = ai.ortsparse.KwtaBlockMatMul(X, W_Q8, W_scales, W_zero_points?, b?, K, N, bits, block_size,
                                     accuracy_level, <gate settings>)              (gated)
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from ..errors import ConfigError
from ..graph_utils import MS_DOMAIN
from ..rules import FLOAT32, dequantize_nbits
from ..rules.matmul_nbits import ACCURACY_LEVELS, BLOCK_SIZES
from ..rules.matmul_nbits import OP_TYPE as MATMUL_NBITS
from ..targets import TARGETS
from .base import BIAS, TARGET, WEIGHT, WEIGHTS, Flag, LayerWeights, OpBuild, Switch, Technique, TechniqueSettings
from .kwta import KWTA
from .pack import PACK

QUANT_DTYPES = ("int8", "int4")
_GATES = {"pack": PACK, "kwta": KWTA}  # the gates that take a quantized weight, in lead order


@dataclasses.dataclass(frozen=True)
class QuantSettings(TechniqueSettings):
    """How float32 weights are quantized (onnxruntime's block quantizer) and the attributes of the
    ``MatMulNBits`` nodes emitted for layers no gate takes."""

    label: ClassVar[str] = "weights"
    always_shown: ClassVar[tuple[str, ...]] = ("dtype", "block_size")

    dtype: str = "int8"
    block_size: int = 32
    symmetric: int = 1  # 0: per-block zero points (asymmetric)
    accuracy_level: int = 4  # of the emitted MatMulNBits nodes (KwtaBlockMatMul has no such attribute)

    def __post_init__(self) -> None:
        problems = []
        if self.dtype not in QUANT_DTYPES:
            problems.append(f"dtype={self.dtype!r} must be one of {', '.join(QUANT_DTYPES)}")
        if self.block_size not in BLOCK_SIZES or isinstance(self.block_size, bool):
            problems.append(f"block_size={self.block_size!r} must be one of {', '.join(map(str, BLOCK_SIZES))}")
        if self.symmetric not in (0, 1) or isinstance(self.symmetric, float):
            problems.append(f"symmetric={self.symmetric!r} must be 0 or 1")
        if self.accuracy_level not in ACCURACY_LEVELS or isinstance(self.accuracy_level, (bool, float)):
            problems.append(f"accuracy_level={self.accuracy_level!r} must be one of 0, 1, 2, 3, 4")
        if problems:
            raise ConfigError("invalid weights settings: " + "; ".join(problems))

    @property
    def bits(self) -> int:
        return 8 if self.dtype == "int8" else 4

    def quantize(self, w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(B, scales, zero points or None) of W [K, N], exactly as onnxruntime's quantizer makes
        them for a MatMulNBits node (its C++ block quantizer)."""
        from onnxruntime.quantization.matmul_nbits_quantizer import (
            DefaultWeightOnlyQuantConfig,
            DefaultWeightOnlyQuantizer,
        )

        config = DefaultWeightOnlyQuantConfig(block_size=self.block_size, is_symmetric=bool(self.symmetric),
                                              accuracy_level=self.accuracy_level, bits=self.bits)
        packed, scales, zero_points = DefaultWeightOnlyQuantizer(config).qbits_block_quant(
            np.ascontiguousarray(w, dtype=np.float32))
        return packed, scales, (None if self.symmetric else zero_points)

    def node_attributes(self, k: int, n: int) -> dict[str, int]:
        """K, N, bits, block_size of the quantized form (what an op needs to read it), and its
        accuracy_level when not 0 (a gated op computes as the MatMulNBits it replaces would)."""
        level = {"accuracy_level": int(self.accuracy_level)} if self.accuracy_level else {}
        return {"K": int(k), "N": int(n), "bits": self.bits, "block_size": int(self.block_size), **level}

    def is_exact(self, k: int) -> bool:
        return False  # quantization changes the weights


_D = QuantSettings()


class Quant(Technique):
    name = "quant"
    kind = WEIGHTS
    op_type = MATMUL_NBITS
    settings_type = QuantSettings
    quantizes = True
    turns_off_auto = False  # --weights int8 quantizes *and* KWTA (auto) gates, in one rewrite
    title = ("weights: quantize float32 layers to MatMulNBits int8/int4 with onnxruntime's quantizer (gated by "
             "KWTA where KWTA is on); --config entries ('quant') override per layer")
    switch = Switch("--weights", field="dtype", choices=("none",) + QUANT_DTYPES, default="none", off="none",
                    help="quantize float32 weights (block-wise, symmetric, as onnxruntime-genai's CPU models); the "
                         "layers KWTA or the bitmap gate selects are gated on the quantized weights, the others "
                         "become com.microsoft.MatMulNBits (default none)")
    flags = (
        Flag("--weights-block-size", field="block_size", type=int, choices=BLOCK_SIZES, default=_D.block_size,
             help=f"K rows per quantization block (default {_D.block_size})"),
        Flag("--weights-target", field=TARGET, choices=TARGETS, default="all",
             help="layers to quantize (default all: the head too)"),
    )

    def op_type_with(self, partners: Mapping[str, Any]) -> str:
        gate = next((name for name in _GATES if name in partners), None)
        return _GATES[gate].op_type if gate else self.op_type

    def build(self, layer: LayerWeights, settings: QuantSettings, partners: Mapping[str, Any]) -> OpBuild:
        if layer.weight_form != FLOAT32:  # decide.py never chooses it for such a layer
            raise ConfigError(f"layer '{layer.name}': its weight is already {layer.weight_form}")
        attributes = settings.node_attributes(layer.k, layer.n)

        def dequantized() -> np.ndarray:
            return dequantize_nbits(*settings.quantize(layer.weight()), layer.k, layer.n, settings.bits,
                                    settings.block_size)

        quantized = dataclasses.replace(layer, weight=dequantized, weight_form=settings.dtype,
                                        weight_attributes=attributes)
        gate = next((name for name in _GATES if name in partners), None)
        if gate is not None:
            others = {name: value for name, value in partners.items() if name != gate}
            built = _GATES[gate].build(quantized, partners[gate], others)
        else:
            built = OpBuild(MATMUL_NBITS, [WEIGHT, None, BIAS],  # None: MatMulNBits' g_idx
                            {**attributes, "accuracy_level": int(settings.accuracy_level)}, domain=MS_DOMAIN)
        built.quantize, built.exact = settings, False
        return built


QUANT = Quant()
