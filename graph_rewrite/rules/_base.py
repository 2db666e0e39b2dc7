"""What every linear-layer rule shares: weight/bias checks and the replacement node.

A rule instance is built either without a plan (survey: only the structure is checked, so
near-misses explain themselves) or with the pass's plan (apply: a match is rewritten only when the
plan selected this layer for this rule, with the plan's weight, bias and attributes).
"""
from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRuleClassBase

from ..graph_utils import constant_tensor, dims_of, why_not_constant

DOMAIN = "ai.ortsparse"
DOMAIN_VERSION = 1


@dataclasses.dataclass(frozen=True)
class Operands:
    """Where a matched layer's operands are in the original graph."""

    x: ir.Value
    weight: ir.Value  # the original initializer
    weight_is_transposed: bool  # True: stored [N, K], the op needs a [K, N] copy
    bias: ir.Value | None  # the original bias initializer, any shape broadcastable to [N]


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """How the pass wants one layer replaced (values already prepared in the graph)."""

    rule: str
    op_type: str
    node_name: str
    inputs: tuple[ir.Value | None, ...]  # after X; None = an omitted optional input
    attributes: Mapping[str, Any]


def weight_dims(weight: ir.Value, transposed: bool) -> tuple[MatchResult, int, int]:
    """Check that ``weight`` is a constant 2-D float32 initializer; return (result, K, N)."""
    result = MatchResult()
    tensor = constant_tensor(weight)
    if tensor is None:
        return result.fail(why_not_constant(weight, "weight"), weight), 0, 0
    if tensor.dtype != ir.DataType.FLOAT:
        return result.fail(f"weight '{weight.name}' has dtype {tensor.dtype.name}; the ortsparse ops "
                           "take float32 weights", weight), 0, 0
    shape = tuple(int(d) for d in tensor.shape)
    if len(shape) != 2:
        return result.fail(f"weight '{weight.name}' has shape {list(shape)}; a linear layer needs a 2-D weight",
                           weight), 0, 0
    k, n = (shape[1], shape[0]) if transposed else shape
    if k == 0 or n == 0:
        return result.fail(f"weight '{weight.name}' is empty (shape {list(shape)})", weight), 0, 0
    return result, k, n


def check_activation(x: ir.Value) -> MatchResult:
    result = MatchResult()
    if x.dtype is not None and x.dtype != ir.DataType.FLOAT:
        return result.fail(f"input '{x.name}' has dtype {x.dtype.name}; the ortsparse ops take float32 activations", x)
    return result


def check_bias(bias: ir.Value, n: int, output_rank: int | None, what: str = "bias") -> MatchResult:
    """A bias is folded into the op only if it is a constant float32 initializer that broadcasts
    to ``[N]`` without changing the output's shape."""
    result = MatchResult()
    tensor = constant_tensor(bias)
    if tensor is None:
        return result.fail(why_not_constant(bias, what), bias)
    if tensor.dtype != ir.DataType.FLOAT:
        return result.fail(f"{what} '{bias.name}' has dtype {tensor.dtype.name}, not float32", bias)
    shape = tuple(int(d) for d in tensor.shape)
    if shape and (shape[-1] not in (n, 1) or any(d != 1 for d in shape[:-1])):
        return result.fail(f"{what} '{bias.name}' has shape {list(shape)}, not broadcastable to [{n}] "
                           "(a per-row bias is not a layer bias)", bias)
    if len(shape) > 1 and (output_rank is None or len(shape) > output_rank):
        # Add(y, b) with b of higher rank than y would raise y's rank; the op's output would not.
        return result.fail(f"{what} '{bias.name}' of shape {list(shape)} could broadcast the output to a "
                           "higher rank (input rank unknown or lower)", bias)
    return result


def output_rank(x: ir.Value) -> int | None:
    dims = dims_of(x)
    return None if dims is None else max(len(dims), 1)


class LinearRule(RewriteRuleClassBase, abc.ABC):
    """Base of the rules that turn one linear layer into an ortsparse op.

    Subclasses name the layer's output ``linear_out`` in their pattern, and implement
    :meth:`check_structure` and :meth:`operands`.
    """

    rule_name: ClassVar[str]
    before_after: ClassVar[str]

    def __init__(self, plan: Mapping[int, LayerPlan] | None = None) -> None:
        super().__init__(name=self.rule_name)
        self._plan = plan

    @abc.abstractmethod
    def check_structure(self, linear: ir.Node, **bindings: Any) -> MatchResult:
        """Whether the matched layer can become the op at all (constants, dtypes, attributes)."""

    @abc.abstractmethod
    def operands(self, linear: ir.Node, bindings: Mapping[str, Any]) -> Operands:
        """Operands of a match that passed :meth:`check_structure`."""

    def check(self, context, linear_out: ir.Value, **bindings: Any) -> MatchResult:
        linear = linear_out.producer()
        result = self.check_structure(linear, linear_out=linear_out, **bindings)
        if not result or self._plan is None:
            return result
        plan = self._plan.get(id(linear))
        if plan is None or plan.rule != self.rule_name:
            return MatchResult().fail(f"layer '{linear.name}' is not selected for rule {self.rule_name}", linear)
        return result

    def rewrite(self, op, linear_out: ir.Value, x: ir.Value, **_: Any):
        plan = self._plan[id(linear_out.producer())]
        inputs = [x, *plan.inputs]
        while inputs and inputs[-1] is None:  # trailing optional inputs are simply left out
            inputs.pop()
        return op.op(plan.op_type, *inputs, _domain=DOMAIN, _version=DOMAIN_VERSION,
                     _name=plan.node_name or None, **plan.attributes)
