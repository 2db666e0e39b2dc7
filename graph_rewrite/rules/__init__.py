"""The linear-layer rules, most specific first (a layer takes the first rule that matches it).

Adding a form (e.g. ``com.microsoft.MatMulNBits``: a quantized weight) = one module here whose
``operands`` yield that weight form (see ``_base.FloatWeight``) + one line in ``RULES``."""
from __future__ import annotations

import sys
import warnings

from ._base import (
    DOMAIN,
    DOMAIN_VERSION,
    FloatWeight,
    LayerWeight,
    LinearOperands,
    LinearRule,
    RuleMatch,
)
from .gemm import GemmRule
from .matmul import MatMulRule
from .matmul_add import MatMulAddRule
from .matmul_transposed_weight import MatMulTransposedWeightRule

RULES: tuple[LinearRule, ...] = (
    GemmRule(),
    MatMulAddRule(),
    MatMulTransposedWeightRule(),
    MatMulRule(),
)


def describe_rules() -> list[tuple[str, str, str]]:
    """(name, Before -> After, module docstring) of every rule, in priority order."""
    return [(r.rule_name, r.before_after, sys.modules[type(r).__module__].__doc__ or "") for r in RULES]


# Names before the rules were named for what they match (they emit any technique's op).
_RENAMED = {"GemmToKwta": GemmRule, "MatMulAddToKwta": MatMulAddRule,
            "MatMulTransposedWeightToKwta": MatMulTransposedWeightRule, "MatMulToKwta": MatMulRule}


def __getattr__(name: str):
    if name in _RENAMED:
        warnings.warn(f"{name} is deprecated and will be removed in the next release; use "
                      f"{_RENAMED[name].__name__}", DeprecationWarning, stacklevel=2)
        return _RENAMED[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DOMAIN", "DOMAIN_VERSION", "RULES", "FloatWeight", "GemmRule", "LayerWeight", "LinearOperands", "LinearRule",
    "MatMulAddRule", "MatMulRule", "MatMulTransposedWeightRule", "RuleMatch", "describe_rules",
]
