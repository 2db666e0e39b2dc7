"""What to rewrite and how: global settings per technique, plus per-layer overrides.

Each technique (graph_rewrite/techniques/) has its own settings dataclass and its own key in
override entries (``"kwta": {...}``, ``"tt": {...}``, ...). KWTA keeps its historical fields on
:class:`RewriteConfig` (``kwta``, ``kwta_enabled``, ``kwta_target``); the others live in
``techniques``. See docs/rewriter.md for the override file format.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tomllib

from .errors import ConfigError
from .techniques.popcount import AttentionSettings
from .targets import LAYER_CLASSES, LAYER_ROLES, TARGETS, target_includes
from .techniques import (
    KWTA_DUTY_MODES,
    KWTA_SCORES,
    TECHNIQUES,
    KwtaSettings,
    TechniqueChoice,
)


@dataclasses.dataclass(frozen=True)
class LayerOverride:
    """One entry of the override file. ``match`` is a glob on the node name, ``layer:<index>``,
    ``class:<mlp|attn|head|other>`` or ``role:<up|down|q|k|v|qkv|out|head|other>``.

    ``off`` keeps the layer dense whatever the techniques say. Per technique (``kwta``, and the
    names in ``techniques`` for the others): ``None`` (entry does not touch it), ``"off"``, or a
    mapping of its settings that also switches it on for the layer.
    """

    match: str
    off: bool = False
    kwta: Mapping[str, Any] | str | None = None
    source: str = ""
    techniques: Mapping[str, Mapping[str, Any] | str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        where = f"{self.source}: " if self.source else ""
        if not isinstance(self.match, str) or not self.match:
            raise ConfigError(f"{where}'match' must be a non-empty string")
        kind, _, arg = self.match.partition(":")
        if kind == "layer" and not (arg.isdigit()):
            raise ConfigError(f"{where}match {self.match!r}: expected layer:<index>, e.g. layer:3")
        if kind == "class" and arg not in LAYER_CLASSES:
            raise ConfigError(f"{where}match {self.match!r}: class must be one of {', '.join(LAYER_CLASSES)}")
        if kind == "role" and arg not in LAYER_ROLES:
            raise ConfigError(f"{where}match {self.match!r}: role must be one of {', '.join(LAYER_ROLES)}")
        techniques = dict(self.techniques)
        if "kwta" in techniques:
            if self.kwta is not None:
                raise ConfigError(f"{where}'kwta' given twice")
            object.__setattr__(self, "kwta", techniques.pop("kwta"))
        object.__setattr__(self, "techniques", techniques)
        for name in [*techniques, "kwta"]:
            if name not in TECHNIQUES:
                raise ConfigError(f"{where}unknown technique {name!r}; valid: {', '.join(TECHNIQUES)}")
            value = self.setting(name)
            if value is None or value == "off":
                continue
            if not isinstance(value, Mapping):
                raise ConfigError(f"{where}'{name}' must be \"off\" or a table of settings, not {value!r}")
            TECHNIQUES[name].settings_type().updated(value, where)  # fail early on bad names or values

    def setting(self, name: str) -> Mapping[str, Any] | str | None:
        """This entry's value for technique ``name``: None, "off" or a settings mapping."""
        return self.kwta if name == "kwta" else self.techniques.get(name)

    def matches(self, index: int, name: str, layer_class: str, role: str) -> bool:
        kind, _, arg = self.match.partition(":")
        if kind == "layer" and arg.isdigit():
            return index == int(arg)
        if kind == "class" and arg in LAYER_CLASSES:
            return layer_class == arg
        if kind == "role" and arg in LAYER_ROLES:
            return role == arg
        return fnmatch.fnmatchcase(name, self.match)


@dataclasses.dataclass(frozen=True)
class RewriteConfig:
    """Global settings (the CLI flags) and the per-layer overrides (the ``--config`` file).

    KWTA's choice is ``kwta`` / ``kwta_enabled`` / ``kwta_target``; every other technique's is
    ``techniques[name]`` (absent: its defaults, off). :meth:`choice` reads either uniformly."""

    kwta: KwtaSettings = dataclasses.field(default_factory=KwtaSettings)
    kwta_enabled: bool = True
    kwta_target: str = "mlp"
    overrides: tuple[LayerOverride, ...] = ()
    techniques: Mapping[str, TechniqueChoice] = dataclasses.field(default_factory=dict)
    # Attention cores -> PopcountAttention (techniques/popcount.py); None = off. Not a per-layer
    # technique: it replaces attention cores, not linear layers, so it is not in ``techniques``.
    attention: AttentionSettings | None = None
    attention_why: str = "--attn=off"

    def __post_init__(self) -> None:
        if self.attention is not None and not isinstance(self.attention, AttentionSettings):
            raise ConfigError("RewriteConfig.attention must be an AttentionSettings or None")
        if self.kwta_target not in TARGETS:
            raise ConfigError(f"kwta target {self.kwta_target!r} must be one of {', '.join(TARGETS)}")
        object.__setattr__(self, "overrides", tuple(self.overrides))
        techniques = dict(self.techniques)
        for name, choice in techniques.items():
            if name == "kwta" or name not in TECHNIQUES:
                others = ", ".join(n for n in TECHNIQUES if n != "kwta") or "none yet"
                raise ConfigError(f"unknown technique {name!r} in RewriteConfig.techniques (valid: {others}; "
                                  "KWTA has its own fields)")
            if not isinstance(choice.settings, TECHNIQUES[name].settings_type):
                raise ConfigError(f"techniques[{name!r}].settings must be a "
                                  f"{TECHNIQUES[name].settings_type.__name__}")
            if choice.target not in TARGETS:
                raise ConfigError(f"{name} target {choice.target!r} must be one of {', '.join(TARGETS)}")
        object.__setattr__(self, "techniques", techniques)

    def choice(self, name: str) -> TechniqueChoice:
        """The global choice of technique ``name`` (KeyError for an unknown name)."""
        if name == "kwta":
            return TechniqueChoice(settings=self.kwta, enabled=self.kwta_enabled, target=self.kwta_target)
        technique = TECHNIQUES[name]
        return self.techniques.get(name) or technique.default_choice()


_ENTRY_KEYS = {"match", "off"}


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
        if "match" not in raw:
            raise ConfigError(f"{where}: missing 'match'")
        off = raw.get("off", False)
        if not isinstance(off, bool):
            raise ConfigError(f"{where}: 'off' must be true or false")
        techniques = {name: raw[name] for name in TECHNIQUES if name != "kwta" and name in raw}
        entries.append(LayerOverride(match=raw["match"], off=off, kwta=raw.get("kwta"), source=where,
                                     techniques=techniques))
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
            data = tomllib.loads(text.decode("utf-8"))
        else:
            data = json.loads(text)
    except (ValueError, UnicodeDecodeError) as error:
        raise ConfigError(f"override file {path} is not valid {'TOML' if path.suffix.lower() == '.toml' else 'JSON'}: {error}") from None
    return parse_overrides(data, source=str(path))


__all__ = [
    "KWTA_DUTY_MODES", "KWTA_SCORES", "LAYER_CLASSES", "LAYER_ROLES", "TARGETS", "KwtaSettings", "LayerOverride",
    "RewriteConfig", "TechniqueChoice", "load_overrides", "parse_overrides", "target_includes",
]
