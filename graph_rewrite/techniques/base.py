"""What every technique module provides, so the pass, the override file and the CLI treat them alike.

A technique = a settings dataclass (attributes of its op, validated on construction), a key in
override entries (its ``name``), CLI flags, and :meth:`Technique.build`, which turns one layer
(its [K, N] weight, its bias) plus the settings of every technique chosen for that layer into the
op node to emit. Which techniques may share a layer is decided in ``graph_rewrite/compose.py``.
"""
from __future__ import annotations

import abc
import argparse
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import numpy as np

from ..errors import ConfigError

GATE = "gate"  # decides which inputs take part (kwta, event, state-pack bitmap)
WEIGHTS = "weights"  # replaces the weight representation (proc-sparse, TT); exclusive per layer


class TechniqueSettings:
    """Mixin for the frozen settings dataclasses: name-checked updates and compact text."""

    label: ClassVar[str] = "technique"
    float_fields: ClassVar[tuple[str, ...]] = ()

    def updated(self, changes: Mapping[str, Any], where: str = ""):
        """A copy with ``changes`` applied (unknown names rejected; ints accepted for floats,
        bools for 0/1 ints)."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ConfigError(f"{where}unknown {self.label} setting(s) {', '.join(unknown)}; "
                              f"valid: {', '.join(sorted(known))}")
        values = dict(changes)
        for f in dataclasses.fields(self):
            value = values.get(f.name)
            if isinstance(value, bool) and isinstance(getattr(self, f.name), int) and not isinstance(
                    getattr(self, f.name), bool):
                values[f.name] = int(value)
            elif f.name in self.float_fields and isinstance(value, int) and not isinstance(value, bool):
                values[f.name] = float(value)
        try:
            return dataclasses.replace(self, **values)
        except ConfigError as error:
            raise ConfigError(f"{where}{error}") from None

    def short(self) -> str:
        """The settings that differ from the defaults, as ``name=value`` text."""
        default = type(self)()
        always = getattr(self, "always_shown", ())
        return " ".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                        if getattr(self, f.name) != getattr(default, f.name) or f.name in always)

    def for_layer(self, k: int | None):
        """Settings as emitted for a layer with K inputs (e.g. a block larger than K shrinks)."""
        return self

    def is_exact(self, k: int) -> bool:
        """True when the op computes the same result as the dense layer (up to float rounding)."""
        return False

    def attributes(self) -> dict[str, Any]:
        """The settings as the op's attributes (reports show these)."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class TechniqueChoice:
    """A technique's global settings: on/off, which layers (``target``), the settings."""

    settings: Any
    enabled: bool = False
    target: str = "mlp"


@dataclasses.dataclass
class LayerWeights:
    """What a build sees of one layer: the weight as [K, N] float32 and the bias as [N] (or None),
    plus calibration inputs X [S, K] of this layer when the caller supplied them."""

    name: str
    k: int
    n: int
    weight: Callable[[], np.ndarray]
    bias: Callable[[], np.ndarray | None]
    calibration: np.ndarray | None = None


@dataclasses.dataclass
class OpBuild:
    """The node a technique emits for a layer: ``op_type(X, *inputs)`` with ``attributes``.

    An entry of ``inputs`` is ``WEIGHT`` (the layer's [K, N] weight initializer, shared with other
    layers that use the same one), ``BIAS`` (its [N] bias, or an omitted input when it has none),
    ``None`` (an omitted optional input) or a new array stored as an initializer named after the
    layer. ``metadata`` goes to the node's metadata_props; ``notes`` to the report. ``op_type``
    None: the technique keeps the layer dense after all (``notes`` say why)."""

    op_type: str | None
    inputs: list[Any]
    attributes: dict[str, Any]
    metadata: dict[str, str] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)
    exact: bool = False


WEIGHT = "<weight>"
BIAS = "<bias>"


class Technique(abc.ABC):
    """One technique; subclasses are singletons registered in ``techniques/__init__.py``."""

    name: ClassVar[str]  # override-file key, e.g. "kwta"
    kind: ClassVar[str]  # GATE or WEIGHTS
    op_type: ClassVar[str]  # the op it emits when it leads the layer
    settings_type: ClassVar[type]
    title: ClassVar[str]  # CLI help group title

    def default_choice(self) -> TechniqueChoice:
        return TechniqueChoice(settings=self.settings_type(), enabled=False, target="mlp")

    @abc.abstractmethod
    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add this technique's flags (an argument group) to ``parser``."""

    @abc.abstractmethod
    def choice_from_args(self, args: argparse.Namespace) -> TechniqueChoice:
        """The global choice the parsed flags describe."""

    def flag_summary(self, choice: TechniqueChoice) -> str:
        """How the CLI spells this technique's on/off state, for reasons in the report."""
        return f"--{self.name}={'on' if choice.enabled else 'off'}"

    def target_flag(self) -> str:
        return f"--{self.name}-target"

    @abc.abstractmethod
    def build(self, layer: LayerWeights, settings: Any, partners: Mapping[str, Any]) -> OpBuild:
        """The op node for ``layer``; ``partners`` holds the settings of the other techniques
        composed into this node (e.g. KWTA as the gate of a weight technique)."""
