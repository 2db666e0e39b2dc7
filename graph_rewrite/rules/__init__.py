"""The linear-layer rules, most specific first (a layer takes the first rule that matches it).

Adding a form = one module here whose ``operands`` yield one of the weight forms of ``_base``
(``FloatWeight``, ``NBitsWeight``; a new form is a sibling dataclass there) + one line in ``RULES``."""
from __future__ import annotations

import sys

from ._base import (
    DOMAIN,
    DOMAIN_VERSION,
    FLOAT32,
    NBITS_FORMS,
    FloatWeight,
    LayerWeight,
    LinearOperands,
    LinearRule,
    NBitsWeight,
    RuleMatch,
    dequantize_nbits,
)
from .gemm import GemmRule
from .matmul import MatMulRule
from .matmul_add import MatMulAddRule
from .matmul_nbits import MatMulNBitsRule
from .matmul_nbits_add import MatMulNBitsAddRule
from .matmul_transposed_weight import MatMulTransposedWeightRule

RULES: tuple[LinearRule, ...] = (
    GemmRule(),
    MatMulAddRule(),
    MatMulTransposedWeightRule(),
    MatMulRule(),
    MatMulNBitsAddRule(),
    MatMulNBitsRule(),
)


def describe_rules() -> list[tuple[str, str, str]]:
    """(name, Before -> After, module docstring) of every rule, in priority order."""
    return [(r.rule_name, r.before_after, sys.modules[type(r).__module__].__doc__ or "") for r in RULES]


__all__ = [
    "DOMAIN", "DOMAIN_VERSION", "FLOAT32", "NBITS_FORMS", "RULES", "FloatWeight", "GemmRule", "LayerWeight",
    "LinearOperands", "LinearRule", "MatMulAddRule", "MatMulNBitsAddRule", "MatMulNBitsRule", "MatMulRule",
    "MatMulTransposedWeightRule", "NBitsWeight", "RuleMatch", "dequantize_nbits", "describe_rules",
]
