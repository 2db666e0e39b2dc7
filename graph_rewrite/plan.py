"""Decide, per layer, which technique (op) replaces it and with which settings; prepare the
weights the chosen op needs ([K, N] copies of transposed weights, [N] biases).

Today there is one technique (KWTA -> KwtaBlockMatMul). Each technique decides on its own from its
target and its override key; a layer ends with at most one op, and composition rules between
techniques (shared gates, exclusive weight backends) belong in :func:`decide_layer`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np
import onnx_ir as ir

from .config import KwtaSettings, RewriteConfig, target_includes
from .graph_utils import ValueNames
from .layers import LinearLayer
from .rules import Operands

KWTA_OP = "KwtaBlockMatMul"


@dataclasses.dataclass(frozen=True)
class LayerDecision:
    op_type: str | None  # None: the layer stays as it is
    settings: KwtaSettings | None
    why: str


def _kwta_choice(layer: LinearLayer, config: RewriteConfig) -> tuple[KwtaSettings | None, str]:
    target = config.kwta_target
    where = f"class {layer.layer_class}" + (f"/{layer.role}" if target == "down" else "")
    if not config.kwta_enabled:
        selected, why = False, "--kwta=off"
    elif target_includes(target, layer.layer_class, layer.role):
        selected, why = True, f"{where} selected by --kwta-target={target}"
    else:
        selected, why = False, f"{where} not in --kwta-target={target}"
        if layer.layer_class == "head":
            why += " (heads only with --kwta-target=all or an override)"
    settings = config.kwta
    for entry in config.overrides:
        if not entry.matches(layer.index, layer.name, layer.layer_class, layer.role):
            continue
        label = f"{entry.source or 'override'} (match {entry.match!r})"
        if entry.off or entry.kwta == "off":
            selected, why = False, f"off by {label}"
        elif isinstance(entry.kwta, Mapping):
            selected, why = True, f"set by {label}"
            settings = settings.updated(entry.kwta, f"{entry.source}: ")
    return (settings if selected else None), why


def decide_layer(layer: LinearLayer, config: RewriteConfig) -> LayerDecision:
    settings, why = _kwta_choice(layer, config)
    if settings is None:
        return LayerDecision(None, None, why)
    return LayerDecision(KWTA_OP, settings, why)


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
