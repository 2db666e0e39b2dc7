"""What every technique module provides, so the pass, the override file and the CLI treat them alike.

A technique = a settings dataclass (attributes of its op, validated on construction), a key in
override entries (its ``name``), its command-line flags *as data* (:class:`Switch` + :class:`Flag`
entries: the CLI builds argparse from them, :meth:`Technique.choice_from_flags` reads them back),
and :meth:`Technique.build`, which turns one layer (its weight, its bias) plus the settings of
every technique chosen for that layer into the op node to emit. Which techniques may share a layer
is decided in ``graph_rewrite/compose.py``.
"""
from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from ..errors import ConfigError
from ..rules import DOMAIN, FLOAT32, NBITS_FORMS

GATE = "gate"  # decides which inputs take part (kwta, event, state-pack bitmap)
WEIGHTS = "weights"  # replaces the weight representation (proc-sparse, TT); exclusive per layer

# TechniqueChoice.enabled: on unless another technique or attention is on (resolved by RewriteConfig).
AUTO = "auto"
# Flag.field of the flag that sets a technique's target (``--kwta-target``...).
TARGET = "<target>"


@dataclasses.dataclass(frozen=True)
class Flag:
    """One command-line flag, as data. ``field`` is the settings field it sets (``TARGET``: the
    technique's target; None: accepted for compatibility, sets nothing). The other fields are
    argparse's ``add_argument`` options of the same names."""

    name: str  # "--kwta-k"
    help: str
    field: str | None = None
    type: Callable[[str], Any] | None = None
    choices: Sequence[Any] | None = None
    default: Any = None
    metavar: str | None = None
    action: str | None = None

    @property
    def dest(self) -> str:
        """The attribute argparse stores the value under (``--kwta-k`` -> ``kwta_k``)."""
        return self.name.lstrip("-").replace("-", "_")

    def argparse_options(self) -> dict[str, Any]:
        """Keyword arguments of ``parser.add_argument(self.name, **options)``."""
        if self.action is not None:
            return {"action": self.action, "help": self.help}
        options = {"type": self.type, "choices": tuple(self.choices) if self.choices else None,
                   "default": self.default, "metavar": self.metavar, "help": self.help}
        return {key: value for key, value in options.items() if value is not None or key == "default"}


@dataclasses.dataclass(frozen=True)
class Switch(Flag):
    """The flag that switches a technique on: ``off`` is the value meaning off, ``auto`` (when a
    choice) defers to :class:`RewriteConfig` (on unless another technique or attention is on), any
    other value means on and, when ``field`` is set, is also that setting (``--state-pack=ternary``
    -> mode ternary)."""

    off: str = "off"

    def enabled(self, value: Any) -> bool | str:
        if value == AUTO:
            return AUTO
        return value is not None and value != self.off

    def spelled(self, enabled: bool | str, settings: Any) -> str:
        """How this flag spells a choice, for reasons in the report (``--state-pack=binary``)."""
        if enabled == AUTO:
            return f"{self.name}={AUTO}"
        if not enabled:
            return f"{self.name}={self.off}"
        return f"{self.name}={getattr(settings, self.field) if self.field else 'on'}"


@dataclasses.dataclass(frozen=True)
class FlagGroup:
    """The flags of one technique (or of attention), in help order, under one help title."""

    title: str
    flags: tuple[Flag, ...]


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
    """A technique's global settings: on/off (or ``AUTO``), which layers (``target``), the settings."""

    settings: Any
    enabled: bool | str = False
    target: str = "mlp"


@dataclasses.dataclass
class LayerWeights:
    """What a build sees of one layer: the weight as a [K, N] float32 matrix and the bias as [N]
    (or None), plus calibration inputs X [S, K] of this layer when the caller supplied them.

    ``weight_form`` names the stored form (``"float32"``: a float initializer; ``"int8"`` /
    ``"int4"``: MatMulNBits' packed B, scales and zero points). For a quantized form ``weight()``
    dequantizes, and ``weight_attributes`` are what an op needs to read the stored form (K, N,
    bits, block_size): a technique that gates it emits ``WEIGHT`` plus those attributes, and the
    replacement passes the initializers through."""

    name: str
    k: int
    n: int
    weight: Callable[[], np.ndarray]
    bias: Callable[[], np.ndarray | None]
    calibration: np.ndarray | None = None
    weight_form: str = FLOAT32
    weight_attributes: dict[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class OpBuild:
    """The node a technique emits for a layer: ``op_type(X, *inputs)`` with ``attributes``.

    An entry of ``inputs`` is ``WEIGHT`` (the layer's weight as stored: for a float32 weight one
    [K, N] initializer, shared with other layers that use the same one; a quantized form expands to
    its own initializers, unchanged), ``BIAS`` (its [N] bias, or an omitted input when it has
    none), ``None`` (an omitted optional input) or a new array stored as an initializer named after
    the layer. ``metadata`` goes to the node's metadata_props; ``notes`` to the report. ``op_type``
    None: the technique keeps the layer dense after all (``notes`` say why). ``domain``: the op's
    (ortsparse's unless said otherwise). ``quantize``: the settings that turn a float weight into
    the quantized form ``WEIGHT`` then stands for (one quantized copy per original initializer,
    made by the replacement; see techniques/quant.py)."""

    op_type: str | None
    inputs: list[Any]
    attributes: dict[str, Any]
    metadata: dict[str, str] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)
    exact: bool = False
    domain: str = DOMAIN
    quantize: Any = None


WEIGHT = "<weight>"
BIAS = "<bias>"
ANY_WEIGHT_FORM = frozenset({FLOAT32, *NBITS_FORMS})  # KwtaBlockMatMul reads float and MatMulNBits weights


class Technique(abc.ABC):
    """One technique; subclasses are singletons registered in ``techniques/__init__.py``.

    ``switch`` and ``flags`` are its command-line flags as data (``flags`` holds the target flag,
    ``field=TARGET``, and one flag per settings field it exposes).

    ``weight_forms``: the weight forms its op takes. A layer whose weight has another form (a
    MatMulNBits layer for a float-only op) stays as it is, with the reason in the report: it is
    never dequantized behind the user's back. ``quantizes``: the technique makes a quantized form
    out of float weights (it has nothing to do on an already quantized layer, which keeps the
    other techniques chosen for it). ``turns_off_auto``: switching it on turns ``auto`` techniques
    (KWTA) off."""

    name: ClassVar[str]  # override-file key, e.g. "kwta"
    kind: ClassVar[str]  # GATE or WEIGHTS
    op_type: ClassVar[str]  # the op it emits when it leads the layer
    settings_type: ClassVar[type]
    title: ClassVar[str]  # CLI help group title
    switch: ClassVar[Switch]
    flags: ClassVar[tuple[Flag, ...]]
    weight_forms: ClassVar[frozenset[str]] = frozenset({FLOAT32})
    quantizes: ClassVar[bool] = False
    turns_off_auto: ClassVar[bool] = True

    def flag_group(self) -> FlagGroup:
        return FlagGroup(self.title, (self.switch, *self.flags))

    def _target(self) -> Flag:
        return next(flag for flag in self.flags if flag.field == TARGET)

    def default_choice(self) -> TechniqueChoice:
        """The choice when nothing is said: the flags' defaults."""
        return TechniqueChoice(settings=self.settings_type(), enabled=self.switch.enabled(self.switch.default),
                               target=self._target().default)

    def choice_from_flags(self, values: Mapping[str, Any]) -> TechniqueChoice:
        """The global choice that flag values describe (``values``: flag dest -> value, e.g.
        ``vars(args)``; a flag not in ``values`` takes its default)."""
        def value(flag: Flag) -> Any:
            return values.get(flag.dest, flag.default)

        fields = {flag.field: value(flag) for flag in self.flags if flag.field not in (None, TARGET)}
        switched = value(self.switch)
        enabled = self.switch.enabled(switched)
        if self.switch.field and enabled is True:
            fields[self.switch.field] = switched
        return TechniqueChoice(settings=self.settings_type(**fields), enabled=enabled, target=value(self._target()))

    def flag_summary(self, choice: TechniqueChoice) -> str:
        """How the CLI spells this technique's on/off state, for reasons in the report."""
        return self.switch.spelled(choice.enabled, choice.settings)

    def target_flag(self) -> str:
        return self._target().name

    def op_type_with(self, partners: Mapping[str, Any]) -> str:
        """The op it emits when it leads a layer with these partners."""
        return self.op_type

    @abc.abstractmethod
    def build(self, layer: LayerWeights, settings: Any, partners: Mapping[str, Any]) -> OpBuild:
        """The op node for ``layer``; ``partners`` holds the settings of the other techniques
        composed into this node (e.g. KWTA as the gate of a weight technique)."""
