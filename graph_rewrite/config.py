"""What to rewrite and how: global settings per technique, plus per-layer overrides.

Each technique (today only KWTA -> ``KwtaBlockMatMul``) has its own settings dataclass and its own
key in override entries (``"kwta": {...}``), so later ops (event-driven, proc-sparse, TT) slot in
beside it without touching the KWTA code. See docs/rewriter.md for the override file format.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import json
import math
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .errors import ConfigError

LAYER_CLASSES = ("mlp", "attn", "head", "other")
LAYER_ROLES = ("up", "down", "q", "k", "v", "qkv", "out", "head", "other")
TARGETS = ("mlp", "attn", "both", "down", "all")

KWTA_SCORES = ("l2", "mean_abs", "l2_weighted")
KWTA_DUTY_MODES = ("dense", "hold")


@dataclasses.dataclass(frozen=True)
class KwtaSettings:
    """Attributes of ``KwtaBlockMatMul`` (see design/ops.md). ``block`` defaults to 1 (single rows:
    measured best for quality), not to a vectorisation-friendly 16/32."""

    k_frac: float = 0.5
    k_abs: int = 0
    score: str = "l2"
    threshold: float = 0.0
    temp: float = 1.0
    duty: int = 1
    duty_mode: str = "dense"
    renorm: int = 0
    block: int = 1
    max_gated_rows: int = 0  # > 0: calls with more rows (prefill) run dense; 0: always gate

    def __post_init__(self) -> None:
        problems = []
        if not (isinstance(self.k_frac, (int, float)) and 0.0 < self.k_frac <= 1.0):
            problems.append(f"k_frac={self.k_frac!r} must be in (0, 1]")
        if not (isinstance(self.k_abs, int) and self.k_abs >= 0):
            problems.append(f"k_abs={self.k_abs!r} must be an integer >= 0")
        if self.score not in KWTA_SCORES:
            problems.append(f"score={self.score!r} must be one of {', '.join(KWTA_SCORES)}")
        if not (isinstance(self.threshold, (int, float)) and self.threshold >= 0.0):
            problems.append(f"threshold={self.threshold!r} must be >= 0")
        if not (isinstance(self.temp, (int, float)) and self.temp > 0.0 and math.isfinite(self.temp)):
            problems.append(f"temp={self.temp!r} must be a finite number > 0")
        if not (isinstance(self.duty, int) and self.duty >= 1):
            problems.append(f"duty={self.duty!r} must be an integer >= 1")
        if self.duty_mode not in KWTA_DUTY_MODES:
            problems.append(f"duty_mode={self.duty_mode!r} must be one of {', '.join(KWTA_DUTY_MODES)}")
        if self.renorm not in (0, 1) or isinstance(self.renorm, float):
            problems.append(f"renorm={self.renorm!r} must be 0 or 1")
        if not (isinstance(self.block, int) and self.block >= 1):
            problems.append(f"block={self.block!r} must be an integer >= 1")
        if not (isinstance(self.max_gated_rows, int) and self.max_gated_rows >= 0):
            problems.append(f"max_gated_rows={self.max_gated_rows!r} must be an integer >= 0")
        if problems:
            raise ConfigError("invalid KWTA settings: " + "; ".join(problems))

    def updated(self, changes: Mapping[str, Any], where: str = "") -> KwtaSettings:
        """A copy with ``changes`` applied (names checked, bools accepted for ``renorm``)."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ConfigError(f"{where}unknown KWTA setting(s) {', '.join(unknown)}; "
                              f"valid: {', '.join(sorted(known))}")
        values = dict(changes)
        if isinstance(values.get("renorm"), bool):
            values["renorm"] = int(values["renorm"])
        for name in ("k_frac", "threshold", "temp"):
            if isinstance(values.get(name), int) and not isinstance(values[name], bool):
                values[name] = float(values[name])
        try:
            return dataclasses.replace(self, **values)
        except ConfigError as error:
            raise ConfigError(f"{where}{error}") from None

    def for_layer(self, k: int | None) -> KwtaSettings:
        """Settings as emitted for a layer with K inputs: the op rejects block > K."""
        return dataclasses.replace(self, block=min(self.block, k)) if k else self

    def is_exact(self, k: int) -> bool:
        """True when the op keeps every input block for a layer with K inputs (same result as a
        dense MatMul, up to float rounding)."""
        if self.threshold > 0.0:
            return False
        if self.k_abs > 0:
            return self.k_abs >= k
        return self.k_frac >= 1.0

    def attributes(self) -> dict[str, Any]:
        # Every attribute is written, defaults included: the op's defaults may move (block is to be
        # chosen from benchmarks) and a rewritten file should mean the same thing forever.
        return {
            "k_frac": float(self.k_frac), "k_abs": int(self.k_abs), "score": self.score,
            "threshold": float(self.threshold), "temp": float(self.temp), "duty": int(self.duty),
            "duty_mode": self.duty_mode, "renorm": int(self.renorm), "block": int(self.block),
            "max_gated_rows": int(self.max_gated_rows),
        }

    def short(self) -> str:
        """Compact text of the settings that differ from the op defaults (block always)."""
        default = KwtaSettings()
        parts = [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                 if getattr(self, f.name) != getattr(default, f.name) or f.name == "block"]
        return " ".join(parts)


@dataclasses.dataclass(frozen=True)
class LayerOverride:
    """One entry of the override file. ``match`` is a glob on the node name, ``layer:<index>``,
    ``class:<mlp|attn|head|other>`` or ``role:<up|down|q|k|v|qkv|out|head|other>``.

    ``off`` keeps the layer dense whatever the techniques say. ``kwta`` is ``None`` (entry does not
    touch KWTA), ``"off"``, or a mapping of KWTA settings that also switches KWTA on for the layer.
    """

    match: str
    off: bool = False
    kwta: Mapping[str, Any] | str | None = None
    source: str = ""

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
        if isinstance(self.kwta, str) and self.kwta != "off":
            raise ConfigError(f"{where}'kwta' must be \"off\" or a table of settings, not {self.kwta!r}")
        if isinstance(self.kwta, Mapping):
            KwtaSettings().updated(self.kwta, where)  # fail early on bad names or values

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
    """Global settings (the CLI flags) and the per-layer overrides (the ``--config`` file)."""

    kwta: KwtaSettings = dataclasses.field(default_factory=KwtaSettings)
    kwta_enabled: bool = True
    kwta_target: str = "mlp"
    overrides: tuple[LayerOverride, ...] = ()

    def __post_init__(self) -> None:
        if self.kwta_target not in TARGETS:
            raise ConfigError(f"kwta target {self.kwta_target!r} must be one of {', '.join(TARGETS)}")
        object.__setattr__(self, "overrides", tuple(self.overrides))


def target_includes(target: str, layer_class: str, role: str) -> bool:
    """Whether ``--kwta-target`` selects a layer of this class and role."""
    if target == "all":
        return True
    if target == "down":
        return layer_class == "mlp" and role == "down"
    if target == "both":
        return layer_class in ("mlp", "attn")
    return layer_class == target


_ENTRY_KEYS = {"match", "off", "kwta"}


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
        unknown = sorted(set(raw) - _ENTRY_KEYS)
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; valid: {', '.join(sorted(_ENTRY_KEYS))}")
        if "match" not in raw:
            raise ConfigError(f"{where}: missing 'match'")
        off = raw.get("off", False)
        if not isinstance(off, bool):
            raise ConfigError(f"{where}: 'off' must be true or false")
        entries.append(LayerOverride(match=raw["match"], off=off, kwta=raw.get("kwta"), source=where))
    return tuple(entries)


def load_overrides(path: str | Path) -> tuple[LayerOverride, ...]:
    """Read an override file: ``.toml`` as TOML, anything else as JSON."""
    path = Path(path)
    try:
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
