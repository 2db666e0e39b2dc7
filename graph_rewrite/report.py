"""What a rewrite did, per layer, and its text/JSON renderings."""
from __future__ import annotations

import dataclasses
import re
from collections import Counter
from typing import Any

from .config import LAYER_CLASSES, RewriteConfig

REWRITTEN = "rewritten"
SKIPPED = "skipped"


@dataclasses.dataclass
class LayerRecord:
    index: int
    name: str
    op_type: str
    layer_class: str
    role: str
    k: int | None
    n: int | None
    weight: str
    rule: str | None  # the rule whose pattern fits the layer (None: none fits)
    decision: str  # "rewritten" | "skipped"
    reason: str  # why selected / why skipped
    new_op: str | None = None
    settings: Any = None  # the lead technique's settings (KwtaSettings, ...)
    partners: dict[str, Any] = dataclasses.field(default_factory=dict)  # techniques folded into the op
    attributes: dict[str, Any] | None = None  # the emitted node's attributes (after a rewrite)
    is_exact: bool = True  # rewritten with settings that compute the dense result
    notes: list[str] = dataclasses.field(default_factory=list)
    near_misses: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    class_reason: str = ""

    @property
    def rewritten(self) -> bool:
        return self.decision == REWRITTEN

    @property
    def exact(self) -> bool:
        """Rewritten with settings that keep every input block (or not rewritten at all)."""
        return not self.rewritten or self.is_exact

    def detail(self) -> str:
        if self.rewritten:
            text = f"{self.new_op} {self.settings.short() if self.settings else ''}".rstrip()
            text += "".join(f" + {name}({settings.short()})" for name, settings in self.partners.items())
            overridden = [self.reason] if self.reason.startswith("set by") else []
            return "; ".join([text, *overridden, *self.notes])
        return self.reason

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["settings"] = self.settings.attributes() if self.settings else None
        data["partners"] = {name: settings.attributes() for name, settings in self.partners.items()}
        data["near_misses"] = [{"rule": r, "reason": why} for r, why in self.near_misses]
        data["exact"] = self.exact
        return data


@dataclasses.dataclass
class AttentionRecord:
    """One attention core: the rule that can replace it and what the rewrite did (or why not)."""

    index: int
    anchor: str  # name of the node the rule replaces (context MatMul or fused op)
    form: str  # "eager" or the fused op's name
    rule: str | None
    decision: str
    reason: str
    new_op: str | None = None
    node_name: str | None = None
    settings: Any = None  # AttentionSettings when rewritten
    meaning: str = ""  # what the flags mean on this core's form, when not the settings as given
    detail: str = ""
    near_misses: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def rewritten(self) -> bool:
        return self.decision == REWRITTEN

    @property
    def exact(self) -> bool:
        return not self.rewritten or self.settings is None or self.settings.exact

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["settings"] = self.settings.attributes() if self.settings else None
        data["near_misses"] = [{"rule": r, "reason": why} for r, why in self.near_misses]
        data["exact"] = self.exact
        return data


@dataclasses.dataclass
class RewriteReport:
    layers: list[LayerRecord]
    config: RewriteConfig
    attention_cores: int = 0
    added_initializers: list[str] = dataclasses.field(default_factory=list)
    removed_initializers: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    attention: list[AttentionRecord] = dataclasses.field(default_factory=list)  # per candidate core
    preview: bool = False  # True: a plan (``--list-layers``), nothing was changed
    fusions: list[Any] = dataclasses.field(default_factory=list)  # fuse.Fusion: same-input layers in one op

    @property
    def rewritten(self) -> list[LayerRecord]:
        return [r for r in self.layers if r.rewritten]

    @property
    def skipped(self) -> list[LayerRecord]:
        return [r for r in self.layers if not r.rewritten]

    @property
    def exact(self) -> bool:
        """True when every rewritten layer keeps all its inputs: the rewritten model must then
        match the original up to float rounding."""
        return all(r.exact for r in self.layers) and all(a.exact for a in self.attention)

    def counts(self) -> dict[str, dict[str, int]]:
        """{class: {"layers": n, "rewritten": n, "skipped": n}} for the classes present."""
        result: dict[str, dict[str, int]] = {}
        for record in self.layers:
            row = result.setdefault(record.layer_class, {"layers": 0, "rewritten": 0, "skipped": 0})
            row["layers"] += 1
            row["rewritten" if record.rewritten else "skipped"] += 1
        return {c: result[c] for c in LAYER_CLASSES if c in result}

    def layer_table(self) -> str:
        header = ("#", "name", "op", "class", "role", "K", "N", "decision", "detail")
        def decision(r: LayerRecord) -> str:
            return ("rewrite" if r.rewritten else "skip") if self.preview else r.decision

        rows = [(str(r.index), r.name or "<unnamed>", r.op_type, r.layer_class, r.role,
                 "?" if r.k is None else str(r.k), "?" if r.n is None else str(r.n), decision(r),
                 r.detail()) for r in self.layers]
        return _table(header, rows)

    def attention_table(self) -> str:
        header = ("#", "anchor", "form", "rule", "decision", "detail")
        rows = [(str(a.index), a.anchor or "<unnamed>", a.form, a.rule or "-",
                 ("rewrite" if a.rewritten else "skip") if self.preview else a.decision,
                 "; ".join(x for x in (a.detail, *a.notes) if x) if a.rewritten else a.reason)
                for a in self.attention]
        return _table(header, rows)

    def attention_summary(self) -> list[str]:
        if not self.attention:
            return []
        verb = "to rewrite" if self.preview else "rewritten"
        done = [a for a in self.attention if a.rewritten]
        ops = Counter(a.new_op for a in done)
        targets = ", ".join(f"{n} -> {op}" for op, n in ops.items()) if len(ops) > 1 else \
            (f"-> {next(iter(ops))}" if ops else "")
        lines = [f"{len(self.attention)} attention core(s), {len(done)} {verb} {targets}".rstrip()
                 + (f" ({done[0].settings.short()})" if done and done[0].settings else "")]
        lines.extend(f"  {meaning}" for meaning in dict.fromkeys(a.meaning for a in done if a.meaning))
        reasons = Counter(_generic(a.reason) for a in self.attention if not a.rewritten)
        lines.extend(f"  attention skipped {count:4d}  {reason}" for reason, count in reasons.most_common())
        return lines

    def summary(self) -> str:
        if not self.layers:
            return "\n".join(["no linear layers found (nothing to rewrite)", *self.attention_summary()])
        counts = self.counts()
        ops = Counter(r.new_op for r in self.rewritten)
        done = ", ".join(f"{n} -> {op}" for op, n in ops.items()) or "none"
        verb = "to rewrite" if self.preview else "rewritten"
        lines = [f"{len(self.layers)} linear layers, {len(self.rewritten)} {verb} ({done}); "
                 f"{self.attention_cores} attention core(s) found"]
        rows = [(c, str(v["layers"]), str(v["rewritten"]), str(v["skipped"])) for c, v in counts.items()]
        lines.append(_table(("class", "layers", verb, "skipped"), rows))
        reasons = Counter(_generic(r.reason) for r in self.skipped)
        if reasons:
            lines.append("skipped because:")
            lines.extend(f"  {count:4d}  {reason}" for reason, count in reasons.most_common())
        fused = [f for f in self.fusions if f.fused]
        if fused:
            layers = sum(len(f.layers) for f in fused)
            glu = sum(1 for f in fused if f.glu)
            with_glu = f", {glu} with their SwiGLU activation" if glu else ""
            lines.append(f"fused {layers} quantized gated layers into {len(fused)} ops (same input, same settings{with_glu})")
        lines.extend(f"  not fused: {' + '.join(f.layers)}: {f.why}" for f in self.fusions if not f.fused)
        lines.extend(f"  fused with a Split, not as a SwiGLU: {' + '.join(f.layers)}: {f.why_no_glu}"
                     for f in self.fusions if f.fused and f.why_no_glu)
        lines.extend(self.attention_summary())
        if not self.rewritten and not self.preview and not any(a.rewritten for a in self.attention):
            lines.append("note: no layer matched the selection; the output is the input model unchanged")
        lines.extend(f"note: {note}" for note in self.notes)
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "layers": [r.to_dict() for r in self.layers],
            "counts": self.counts(),
            "exact": self.exact,
            "preview": self.preview,
            "attention_cores": self.attention_cores,
            "attention": [a.to_dict() for a in self.attention],
            "added_initializers": self.added_initializers,
            "removed_initializers": self.removed_initializers,
            "fusions": [{"layers": list(f.layers), "fused": f.fused, "why": f.why, "glu": f.glu,
                         "why_no_glu": f.why_no_glu} for f in self.fusions],
            "notes": self.notes,
            "config": config_dict(self.config),
        }


def config_dict(config: RewriteConfig) -> dict[str, Any]:
    """The config as JSON data: every technique's global choice (``auto`` resolved), the
    overrides, attention, the caller's per-node plan."""
    from .techniques import TECHNIQUES

    techniques = {}
    for name in TECHNIQUES:
        choice = config.choice(name)
        techniques[name] = {"settings": dataclasses.asdict(choice.settings), "enabled": choice.enabled,
                            "target": choice.target}
    overrides = [dataclasses.asdict(entry) for entry in config.overrides]
    return {
        "techniques": techniques,
        "overrides": overrides,
        "attention": config.attention.attributes() if config.attention else None,
        "attention_why": config.attention_why,
        "plan": None if config.plan is None else {"technique": config.plan.technique, "rest": config.plan.rest,
                                                   "nodes": dict(config.plan.nodes)},
    }


def _generic(reason: str) -> str:
    # Group "weight 'h.0.w' is ..." and "weight 'h.1.w' is ..." into one line of the summary.
    return re.sub(r"'[^']*'", "'…'", reason)


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    def fmt(cells):
        return "  ".join(c.rjust(w) if c.isdigit() else c.ljust(w) for c, w in zip(cells, widths)).rstrip()
    return "\n".join([fmt(header), fmt(tuple("-" * w for w in widths)), *(fmt(r) for r in rows)])
