"""What to rewrite and how: global settings per technique, plus per-layer overrides.

Each technique (graph_rewrite/techniques/) has its own settings dataclass, its own key in
override entries (``"kwta": {...}``, ``"tt": {...}``, ...) and its global choice in
``RewriteConfig.techniques[name]``; KWTA is one of them, and so is weight quantization
(``"quant"``: ``--weights``). ``TechniqueChoice.enabled`` may be ``"auto"`` (KWTA's default): on
unless another technique (weight quantization excepted) or attention is on, resolved here for the
CLI and library callers alike. See docs/rewriter.md for the override file format.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: JSON override files only
    tomllib = None

from .compose import check_attention
from .errors import ConfigError
from .targets import LAYER_CLASSES, LAYER_ROLES, TARGETS, target_includes
from .techniques import (
    AUTO,
    KWTA_DUTY_MODES,
    KWTA_SCORES,
    TECHNIQUES,
    KwtaSettings,
    TechniqueChoice,
)
from .techniques.popcount import ATTENTION, AttentionSettings

@dataclasses.dataclass(frozen=True)
class LayerOverride:
    """One entry of the override file. ``match`` is a glob on the node name, ``layer:<index>``,
    ``class:<mlp|attn|head|other>`` or ``role:<up|down|q|k|v|qkv|out|head|other>``; ``node`` (instead
    of ``match``) is one node's exact name, no glob (what the harness writes: graph_rewrite/layer_settings.py).

    ``off`` keeps the layer dense whatever the techniques say. ``techniques[name]`` per technique
    (``kwta`` included): absent (entry does not touch it), ``"off"``, or a mapping of its settings
    that also switches it on for the layer.
    """

    match: str = ""
    off: bool = False
    source: str = ""
    techniques: Mapping[str, Mapping[str, Any] | str] = dataclasses.field(default_factory=dict)
    node: str | None = None

    def __post_init__(self) -> None:
        where = f"{self.source}: " if self.source else ""
        object.__setattr__(self, "techniques", dict(self.techniques or {}))
        if self.node is not None:
            if self.match:
                raise ConfigError(f"{where}give 'match' (a pattern) or 'node' (one exact node name), not both")
            if not isinstance(self.node, str) or not self.node:
                raise ConfigError(f"{where}'node' must be a non-empty string")
        match = self.match if self.node is None else "node"
        if not isinstance(match, str) or not match:
            raise ConfigError(f"{where}'match' must be a non-empty string")
        kind, _, arg = match.partition(":")
        if kind == "layer" and not (arg.isdigit()):
            raise ConfigError(f"{where}match {match!r}: expected layer:<index>, e.g. layer:3")
        if kind == "class" and arg not in LAYER_CLASSES:
            raise ConfigError(f"{where}match {match!r}: class must be one of {', '.join(LAYER_CLASSES)}")
        if kind == "role" and arg not in LAYER_ROLES:
            raise ConfigError(f"{where}match {match!r}: role must be one of {', '.join(LAYER_ROLES)}")
        for name, value in self.techniques.items():
            if name not in TECHNIQUES:
                raise ConfigError(f"{where}unknown technique {name!r}; valid: {', '.join(TECHNIQUES)}")
            if value is None or value == "off":
                continue
            if not isinstance(value, Mapping):
                raise ConfigError(f"{where}'{name}' must be \"off\" or a table of settings, not {value!r}")
            TECHNIQUES[name].settings_type().updated(value, where)  # fail early on bad names or values

    def setting(self, name: str) -> Mapping[str, Any] | str | None:
        """This entry's value for technique ``name``: None, "off" or a settings mapping."""
        return self.techniques.get(name)

    @property
    def label(self) -> str:
        """How the report names what this entry selects."""
        return f"node {self.node!r}" if self.node is not None else f"match {self.match!r}"

    def matches(self, index: int, name: str, layer_class: str, role: str) -> bool:
        if self.node is not None:
            return name == self.node
        kind, _, arg = self.match.partition(":")
        if kind == "layer" and arg.isdigit():
            return index == int(arg)
        if kind == "class" and arg in LAYER_CLASSES:
            return layer_class == arg
        if kind == "role" and arg in LAYER_ROLES:
            return role == arg
        return fnmatch.fnmatchcase(name, self.match)


@dataclasses.dataclass(frozen=True)
class NodePlan:
    """A caller's per-node decision for one technique (what an allocation, a calibration or a
    measurement chose), handed to the rewriter as data: ``nodes[name]`` (an exact node name) holds
    the settings that update ``technique``'s global ones on that node and switch it on there; every
    other node has ``technique`` off (``rest="off"``) or as the global choice and the overrides say
    (``rest=None``). Applied after the override entries. :meth:`entries` is the same decision as an
    override file's entries (what ``calibrate -o`` writes and ``rewrite-onnx --config`` reads)."""

    technique: str
    nodes: Mapping[str, Mapping[str, Any]]
    rest: str | None = "off"

    def __post_init__(self) -> None:
        if self.technique not in TECHNIQUES:
            raise ConfigError(f"plan: unknown technique {self.technique!r}; valid: {', '.join(TECHNIQUES)}")
        if self.rest not in ("off", None):
            raise ConfigError(f"plan: rest must be 'off' or None, not {self.rest!r}")
        nodes = {name: dict(settings) for name, settings in self.nodes.items()}
        for name, settings in nodes.items():
            TECHNIQUES[self.technique].settings_type().updated(settings, f"plan node {name!r}: ")  # fail early
        object.__setattr__(self, "nodes", nodes)

    def entries(self) -> list[dict[str, Any]]:
        """The override file's entries of this plan (``{"layers": entries}``): ``technique`` ``rest``
        for every layer (absent when ``rest`` is None), then one entry per node, in the plan's order."""
        entries: list[dict[str, Any]] = [{"match": "*", self.technique: self.rest}] if self.rest is not None else []
        return entries + [{"node": name, self.technique: dict(settings)} for name, settings in self.nodes.items()]


@dataclasses.dataclass(frozen=True)
class RewriteConfig:
    """Global settings (the CLI flags) and the per-layer overrides (the ``--config`` file).

    ``techniques[name]`` is technique ``name``'s global choice (absent: its defaults, i.e. its
    flags' defaults: KWTA ``auto``, the others off); :meth:`choice` reads it with ``auto``
    resolved. ``attention``: attention cores -> PopcountAttention (techniques/popcount.py), None =
    off; not a per-layer technique (it replaces attention cores, not linear layers). ``plan``: a
    caller's per-node decision (:class:`NodePlan`), applied after the overrides.
    """

    techniques: Mapping[str, TechniqueChoice] = dataclasses.field(default_factory=dict)
    overrides: tuple[LayerOverride, ...] = ()
    attention: AttentionSettings | None = None
    attention_why: str = "--attn=off"
    plan: NodePlan | None = None

    def __post_init__(self) -> None:
        techniques = dict(self.techniques or {})
        if self.attention is not None and not isinstance(self.attention, AttentionSettings):
            raise ConfigError("RewriteConfig.attention must be an AttentionSettings or None")
        if self.plan is not None and not isinstance(self.plan, NodePlan):
            raise ConfigError("RewriteConfig.plan must be a NodePlan or None")
        for name, choice in techniques.items():
            if name not in TECHNIQUES:
                raise ConfigError(f"unknown technique {name!r} in RewriteConfig.techniques (valid: "
                                  f"{', '.join(TECHNIQUES)})")
            if not isinstance(choice, TechniqueChoice):
                raise ConfigError(f"techniques[{name!r}] must be a TechniqueChoice")
            if not isinstance(choice.settings, TECHNIQUES[name].settings_type):
                raise ConfigError(f"techniques[{name!r}].settings must be a "
                                  f"{TECHNIQUES[name].settings_type.__name__}")
            if choice.target not in TARGETS:
                raise ConfigError(f"{name} target {choice.target!r} must be one of {', '.join(TARGETS)}")
            if choice.enabled not in (True, False, AUTO):
                raise ConfigError(f"techniques[{name!r}].enabled must be True, False or {AUTO!r}")
            if choice.enabled != AUTO:
                techniques[name] = dataclasses.replace(choice, enabled=bool(choice.enabled))
        object.__setattr__(self, "techniques", techniques)
        object.__setattr__(self, "overrides", tuple(self.overrides))
        check_attention(self)  # the one composition check of attention, however the config is made

    def _given(self, name: str) -> TechniqueChoice:
        return self.techniques.get(name) or TECHNIQUES[name].default_choice()

    def _switched_on(self, but: str) -> list[str]:
        """What is explicitly on besides technique ``but`` and turns ``auto`` off, as the CLI spells
        it (weight quantization does not: ``--weights int8`` quantizes and KWTA still gates)."""
        on = [TECHNIQUES[name].flag_summary(self._given(name)) for name in TECHNIQUES
              if name != but and self._given(name).enabled is True and TECHNIQUES[name].turns_off_auto]
        if self.attention is not None:
            on.append(ATTENTION.flag_summary(self.attention))
        return on

    def choice(self, name: str) -> TechniqueChoice:
        """The global choice of technique ``name`` with ``auto`` resolved (KeyError for an
        unknown name): ``auto`` is on unless another technique or attention is on."""
        choice = self._given(name)
        if choice.enabled == AUTO:
            choice = dataclasses.replace(choice, enabled=not self._switched_on(but=name))
        return choice

    def switched_on(self, name: str) -> bool:
        """Whether technique ``name`` was switched on or left to ``auto`` (as opposed to off): its
        reasons are then worth reporting for every layer."""
        return self._given(name).enabled in (True, AUTO)

    def off_reason(self, name: str) -> str:
        """Why technique ``name`` is off globally, as the CLI would say it (``--kwta=off``,
        ``--kwta=auto (off: --tt=on)``)."""
        given = self._given(name)
        summary = TECHNIQUES[name].flag_summary(given)
        if given.enabled == AUTO:
            return f"{summary} (off: {', '.join(self._switched_on(but=name))})"
        return summary


def config_from_flags(values: Mapping[str, Any], overrides: Sequence[LayerOverride] = ()) -> RewriteConfig:
    """The config that command-line flag values describe (``values``: flag dest -> value, e.g.
    ``vars(args)`` of a parser built from ``techniques.flag_groups()``; absent flags take their
    defaults).

    ``--attn`` not given: ``--kwta-target=attn|both`` with KWTA on means ``--attn=energy`` (KWTA's
    attention side, low-energy keys dropped; KWTA then stays on next to the attention it implies)."""
    choices = {name: technique.choice_from_flags(values) for name, technique in TECHNIQUES.items()}
    kwta = None
    if values.get(ATTENTION.switch.dest) is None:  # --kwta-target=attn|both may imply attention
        kwta = RewriteConfig(techniques=choices, overrides=overrides).choice("kwta")
    attention, why = ATTENTION.choice_from_flags(values, kwta)
    if attention is not None and kwta is not None:
        choices["kwta"] = kwta  # KWTA stays on next to the attention it implies
    return RewriteConfig(techniques=choices, overrides=overrides, attention=attention, attention_why=why)


_ENTRY_KEYS = {"match", "node", "off"}


def parse_overrides(data: Any, source: str = "overrides") -> tuple[LayerOverride, ...]:
    """Entries from decoded JSON/TOML: a list of entries, or a table with a ``layers`` list."""
    if isinstance(data, Mapping):
        extra = sorted(set(data) - {"layers"})
        if extra:
            raise ConfigError(f"{source}: unknown top-level key(s) {', '.join(extra)}; expected 'layers'")
        data = data.get("layers", [])
    if not isinstance(data, Sequence) or isinstance(data, (str, bytes)):
        raise ConfigError(f"{source}: expected a list of entries (or {{\"layers\": [...]}})")
    entries = []
    for position, raw in enumerate(data):
        where = f"{source} entry {position}"
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{where}: expected a table with 'match', got {type(raw).__name__}")
        unknown = sorted(set(raw) - _ENTRY_KEYS - set(TECHNIQUES))
        if unknown:
            valid = sorted(_ENTRY_KEYS | set(TECHNIQUES))
            raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; valid: {', '.join(valid)}")
        if ("match" in raw) == ("node" in raw):
            raise ConfigError(f"{where}: " + ("give 'match' or 'node', not both" if "match" in raw else "missing 'match'"))
        off = raw.get("off", False)
        if not isinstance(off, bool):
            raise ConfigError(f"{where}: 'off' must be true or false")
        techniques = {name: raw[name] for name in TECHNIQUES if name in raw}
        entries.append(LayerOverride(match=raw.get("match", ""), off=off, source=where, techniques=techniques,
                                     node=raw.get("node")))
    return tuple(entries)


def load_overrides(path: str | Path) -> tuple[LayerOverride, ...]:
    """Read an override file: ``.toml`` as TOML, anything else as JSON."""
    path = Path(path)
    try:
        if path.exists() and not path.is_file():  # a FIFO or device would block or never end
            raise ConfigError(f"override file {path} is not a regular file")
        text = path.read_bytes()
    except OSError as error:
        raise ConfigError(f"cannot read override file {path}: {error.strerror or error}") from None
    try:
        if path.suffix.lower() == ".toml":
            if tomllib is None:
                raise ConfigError(f"override file {path}: TOML needs Python >= 3.11 (tomllib); write it as JSON")
            data = tomllib.loads(text.decode("utf-8"))
        else:
            data = json.loads(text)
    except (ValueError, UnicodeDecodeError) as error:
        raise ConfigError(f"override file {path} is not valid {'TOML' if path.suffix.lower() == '.toml' else 'JSON'}: {error}") from None
    return parse_overrides(data, source=str(path))


__all__ = [
    "KWTA_DUTY_MODES", "KWTA_SCORES", "LAYER_CLASSES", "LAYER_ROLES", "TARGETS", "KwtaSettings", "LayerOverride",
    "NodePlan", "RewriteConfig", "TechniqueChoice", "config_from_flags", "load_overrides", "parse_overrides", "target_includes",
]
