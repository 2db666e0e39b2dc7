"""Event-driven attention from the event-driven flags: with ``--event-driven on --event-target
attn|both|all`` and ``--attn`` given, the attention ops the rewrite emits get event-driven attention
as well as the target's projections getting EventDrivenMatMul; ``--event-axis`` chooses the half:

- ``call`` (re-encoding, 4-D ops): rows whose Q, K, V and mask rows are unchanged since the previous
  call reuse their output, rows whose keys changed are corrected (docs/ops.md#re-encoding);
  ``--event-delta-theta`` means what it means for the linear layers: a row changed by at most that
  fraction (max-abs, relative) counts as unchanged (0: bit-identical rows only, exact).
- ``sequence`` (decode, both forms; docs/ops.md#event-driven-attention-by-heads-event-ortsparse-addition):
  a head reuses its page choice while its query moves little; ``--event-topk`` (fraction of the
  uncertified heads recomputed), ``--event-age-max`` (0: no limit), ``--event-gap-every`` and
  ``--event-gap-tol`` mean what they mean for the linear layers, per head instead of per block.
  ``--attn-event*`` set the same attributes directly and win when given.

Before: PopcountAttention(Q, K, V, mask?; select=..., ...)
After:  PopcountAttention(Q, K, V, mask?; select=..., ..., reuse_rows=1, reuse_tol=<delta_theta>)   (call)
        Popcount[GroupQuery]Attention(...; select=..., ..., event=1, event_topk=<topk>, ...)       (sequence)
"""
from __future__ import annotations

import dataclasses
from typing import Any

from .techniques import TECHNIQUES
from .techniques.popcount import OP_TYPE, AttentionSettings

EVENT_TARGETS_WITH_ATTENTION = ("attn", "both", "all")
NO_AGE_LIMIT = 2**31 - 1  # --event-age-max 0 (no limit) as the op's event_age_max


@dataclasses.dataclass(frozen=True)
class ReencodingAttentionSettings(AttentionSettings):
    """AttentionSettings plus the re-encoding attributes of the 4-D op."""

    reuse_tol: float = 0.0

    @property
    def exact(self) -> bool:
        return super().exact and self.reuse_tol == 0.0

    def attributes(self) -> dict[str, Any]:
        return {**super().attributes(), "reuse_rows": 1, "reuse_tol": float(self.reuse_tol)}


@dataclasses.dataclass(frozen=True)
class EventAttention:
    """What the event-driven flags ask of the attention ops: re-encoding (``reuse_tol``) or reuse by
    heads (``heads``: the AttentionSettings fields it sets)."""

    reuse_tol: float | None = None
    heads: dict[str, Any] | None = None


def event_attention(config) -> EventAttention:
    """The event-driven attention a rewrite with ``config`` (a RewriteConfig) asks for: none when
    event-driven is off, its target has no attention, or ``--attn`` is not given."""
    if config.attention is None or "event" not in TECHNIQUES:
        return EventAttention()
    event = config.choice("event")
    if not (event.enabled and event.target in EVENT_TARGETS_WITH_ATTENTION):
        return EventAttention()
    s = event.settings
    if s.axis == "call":
        return EventAttention(reuse_tol=float(s.delta_theta))
    return EventAttention(heads=dict(event=1, event_topk=float(s.topk),
                                     event_age_max=int(s.age_max) if s.age_max > 0 else NO_AGE_LIMIT,
                                     event_gap_every=int(s.gap_every), event_gap_tol=float(s.gap_tol)))


def for_op(settings: AttentionSettings, new_op: str, event: EventAttention | None) -> AttentionSettings:
    """The settings an emitted attention op gets: re-encoding on the 4-D op when asked for; reuse by
    heads on either op where it selects with the budgeted page selector, unless ``--attn-event``
    already turned it on (its own settings win)."""
    if event is None:
        return settings
    # by heads only where the op can do it: the budgeted page selector
    if event.heads is not None and not settings.event and settings.select == "pages" and settings.candidates > 0:
        settings = dataclasses.replace(settings, **event.heads)
    if event.reuse_tol is None or new_op != OP_TYPE:
        return settings
    fields = {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)}
    return ReencodingAttentionSettings(**fields, reuse_tol=event.reuse_tol)
