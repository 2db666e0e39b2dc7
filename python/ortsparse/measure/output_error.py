"""Output error of a rewritten model on generated inputs (any model): every output's worst max abs
and relative L2 error against a budget — 1e-4 when every gated layer is exact, else verify's
default (0.5). The comparison itself is ``ortsparse.verify``'s."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from onnx import helper

from ..runtime import load_proto
from ..verify import DEFAULT_BUDGET, EXACT_BUDGET, parse_shape_overrides, verify_models


def gated_layers_exact(model: Any) -> bool:
    """True when every KwtaBlockMatMul of the model keeps all its inputs (k_frac >= 1 or k_abs >= K,
    threshold 0), i.e. the model must match its dense original up to float rounding."""
    proto = load_proto(model)
    dims = {init.name: tuple(init.dims) for init in proto.graph.initializer}
    for node in proto.graph.node:
        if node.op_type != "KwtaBlockMatMul":
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if float(attrs.get("threshold", 0.0)) > 0.0:
            return False
        k_abs = int(attrs.get("k_abs", 0))
        if k_abs > 0:
            shape = dims.get(node.input[1])
            if shape is None or k_abs < shape[0]:
                return False
        elif float(attrs.get("k_frac", 0.5)) < 1.0:
            return False
    return True


def compare_outputs(dense: Any, rewritten: Any, runs: int = 4, shapes: Any = None, *, budget: float | None = None,
                    seed: int = 0) -> dict[str, Any]:
    """Every output on ``runs`` generated input sets (``ortsparse.verify.verify_models``): per output
    the worst max abs and relative L2 error. ``budget`` None: 1e-4 when every gated layer is exact,
    else verify's default (0.5)."""
    if budget is None:
        exact = gated_layers_exact(rewritten)
        budget = EXACT_BUDGET if exact else DEFAULT_BUDGET
        reason = "every gated layer is exact" if exact else "approximate layers present"
    else:
        reason = "given"
    overrides = shapes if isinstance(shapes, Mapping) else parse_shape_overrides(shapes)
    result = verify_models(dense, rewritten, runs=runs, budget=budget, budget_reason=reason, shapes=overrides,
                           seed=seed)
    return {"kind": "generic", "runs": result.runs, "budget": result.budget, "budget_reason": result.budget_reason,
            "passed": result.passed, "input_shapes": {k: list(v) for k, v in result.input_shapes.items()},
            "outputs": [dataclasses.asdict(o) | {"shape": list(o.shape)} for o in result.outputs],
            "text": result.format()}
