"""The linear-layer rules, most specific first (a layer takes the first rule that matches it)."""
from __future__ import annotations

from collections.abc import Mapping

from onnxscript.rewriter import RewriteRule

from ._base import DOMAIN, DOMAIN_VERSION, LayerPlan, LinearRule, Operands
from .gemm import GemmToKwta
from .matmul import MatMulToKwta
from .matmul_add import MatMulAddToKwta
from .matmul_transposed_weight import MatMulTransposedWeightToKwta

RULE_CLASSES: tuple[type[LinearRule], ...] = (
    GemmToKwta,
    MatMulAddToKwta,
    MatMulTransposedWeightToKwta,
    MatMulToKwta,
)


def make_rules(plan: Mapping[int, LayerPlan] | None = None) -> list[tuple[type[LinearRule], RewriteRule]]:
    """One onnxscript ``RewriteRule`` per pattern variant (Add is tried both ways round), paired
    with the rule class it came from, in priority order."""
    rules = []
    for rule_class in RULE_CLASSES:
        for variant in rule_class.rule(plan).commute():
            rules.append((rule_class, variant))
    return rules


def describe_rules() -> list[tuple[str, str, str]]:
    """(name, Before -> After, module docstring) of every rule, in priority order."""
    import sys

    return [(c.rule_name, c.before_after, sys.modules[c.__module__].__doc__ or "") for c in RULE_CLASSES]


__all__ = [
    "DOMAIN", "DOMAIN_VERSION", "RULE_CLASSES", "GemmToKwta", "LayerPlan", "LinearRule",
    "MatMulAddToKwta", "MatMulToKwta", "MatMulTransposedWeightToKwta", "Operands", "describe_rules",
    "make_rules",
]
