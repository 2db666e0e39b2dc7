"""Decide, per layer, which techniques apply and with which settings (global choice, then the
override entries in order), let :func:`compose` pick the op, and prepare the initializers the op
needs ([K, N] copies of transposed weights, [N] biases, a technique's own tensors).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx_ir as ir

from .compose import compose
from .config import RewriteConfig
from .graph_utils import ValueNames
from .layers import LinearLayer
from .rules import Operands
from .targets import target_includes
from .techniques import TECHNIQUES

KWTA_OP = TECHNIQUES["kwta"].op_type


@dataclasses.dataclass(frozen=True)
class LayerDecision:
    op_type: str | None  # None: the layer stays as it is
    settings: Any  # the lead technique's settings (None when skipped)
    why: str
    lead: str | None = None
    partners: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def _choice(name: str, layer: LinearLayer, config: RewriteConfig) -> tuple[Any | None, str, bool]:
    """(settings or None, why, mentioned): ``mentioned`` is False when the technique is off
    globally and no override touches it (its reason is then noise in the report)."""
    choice = config.choice(name)
    target = choice.target
    where = f"class {layer.layer_class}" + (f"/{layer.role}" if target == "down" else "")
    if not choice.enabled:
        selected, why = False, TECHNIQUES[name].flag_summary(choice)
    elif target_includes(target, layer.layer_class, layer.role):
        selected, why = True, f"{where} selected by {TECHNIQUES[name].target_flag()}={target}"
    else:
        selected, why = False, f"{where} not in {TECHNIQUES[name].target_flag()}={target}"
        if layer.layer_class == "head":
            why += f" (heads only with {TECHNIQUES[name].target_flag()}=all or an override)"
    mentioned = choice.enabled
    settings = choice.settings
    for entry in config.overrides:
        if not entry.matches(layer.index, layer.name, layer.layer_class, layer.role):
            continue
        label = f"{entry.source or 'override'} (match {entry.match!r})"
        value = entry.setting(name)
        if entry.off or value == "off":
            selected, why = False, f"off by {label}"
            mentioned = mentioned or value == "off"
        elif isinstance(value, Mapping):
            selected, why, mentioned = True, f"set by {label}", True
            settings = settings.updated(value, f"{entry.source}: ")
    return (settings if selected else None), why, mentioned


def decide_layer(layer: LinearLayer, config: RewriteConfig) -> LayerDecision:
    chosen: dict[str, Any] = {}
    reasons: list[str] = []
    skip_reasons: list[str] = []
    for name in TECHNIQUES:
        settings, why, mentioned = _choice(name, layer, config)
        if settings is not None:
            chosen[name] = settings
            reasons.append(why)
        elif mentioned or name == "kwta":
            skip_reasons.append(why)
    if not chosen:
        return LayerDecision(None, None, "; ".join(skip_reasons))
    lead, partners = compose(layer.name, chosen)
    return LayerDecision(TECHNIQUES[lead].op_type, chosen[lead], "; ".join(reasons), lead=lead, partners=partners)


class WeightPreparer:
    """Makes (once per original initializer) the [K, N] weights and [N] biases the ops take, and
    afterwards drops originals nothing uses anymore, so the model never carries a weight twice."""

    def __init__(self, graph: ir.Graph) -> None:
        self._graph = graph
        self._names = ValueNames(graph)
        self._made: dict[int, ir.Value] = {}
        self._sources: list[ir.Value] = []
        self.added: list[str] = []
        self.removed: list[str] = []

    def _register(self, source: ir.Value, array: np.ndarray, suffix: str) -> ir.Value:
        name = self._names.new(f"{source.name}{suffix}")
        tensor = ir.tensor(np.ascontiguousarray(array, dtype=np.float32), name=name)
        value = ir.Value(name=name, shape=ir.Shape(array.shape), type=ir.TensorType(ir.DataType.FLOAT),
                         const_value=tensor)
        self._graph.register_initializer(value)
        self._made[id(source)] = value
        self._sources.append(source)
        self.added.append(name)
        return value

    def new_initializer(self, name_hint: str, array: np.ndarray) -> ir.Value:
        """A new initializer (a technique's own tensor, e.g. packed deltas or TT cores)."""
        name = self._names.new(name_hint)
        tensor = ir.tensor(np.ascontiguousarray(array), name=name)
        value = ir.Value(name=name, shape=ir.Shape(array.shape), type=ir.TensorType(tensor.dtype),
                         const_value=tensor)
        self._graph.register_initializer(value)
        self.added.append(name)
        return value

    def replaced(self, operands: Operands) -> None:
        """The layer's original weight/bias may become unused (a technique stored its own form)."""
        self._sources.append(operands.weight)
        if operands.bias is not None:
            self._sources.append(operands.bias)

    def weight(self, operands: Operands) -> ir.Value:
        source = operands.weight
        if not operands.weight_is_transposed:
            return source
        if id(source) not in self._made:
            self._register(source, source.const_value.numpy().T, "_T")
        return self._made[id(source)]

    def bias(self, operands: Operands, n: int) -> ir.Value | None:
        source = operands.bias
        if source is None or tuple(source.const_value.shape) == (n,):
            return source
        if id(source) not in self._made:
            flat = source.const_value.numpy().reshape(-1)
            self._register(source, np.broadcast_to(flat, (n,)), "_vec")
        return self._made[id(source)]

    def drop_unused(self) -> None:
        graph_io = set(map(id, self._graph.inputs)) | set(map(id, self._graph.outputs))
        candidates = self._sources + list(self._made.values())
        for value in candidates:
            if (value.name in self._graph.initializers and self._graph.initializers[value.name] is value
                    and not value.uses() and id(value) not in graph_io):
                del self._graph.initializers[value.name]
                if value.name in self.added:
                    self.added.remove(value.name)
                else:
                    self.removed.append(value.name)
