"""Re-encoding on attention: with ``--event-driven on --event-axis call --event-target attn|both|all``
and ``--attn`` given, the 4-D attention ops the rewrite emits run PopcountAttention's re-encoding
mode (docs/ops.md#re-encoding): rows whose Q, K, V and mask rows are unchanged since the previous
call reuse their output, rows whose keys changed are corrected. ``--event-delta-theta`` means here
what it means for the linear layers: a row changed by at most that fraction (max-abs, relative)
counts as unchanged (0: bit-identical rows only, exact).

Before: PopcountAttention(Q, K, V, mask?; select=..., ...)
After:  PopcountAttention(Q, K, V, mask?; select=..., ..., reuse_rows=1, reuse_tol=<delta_theta>)

The GroupQueryAttention form (decode) is not re-encoded: its event mode is by heads.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from .techniques import TECHNIQUES
from .techniques.popcount import OP_TYPE, AttentionSettings

EVENT_TARGETS_WITH_ATTENTION = ("attn", "both", "all")


@dataclasses.dataclass(frozen=True)
class ReencodingAttentionSettings(AttentionSettings):
    """AttentionSettings plus the re-encoding attributes of the 4-D op."""

    reuse_tol: float = 0.0

    @property
    def exact(self) -> bool:
        return super().exact and self.reuse_tol == 0.0

    def attributes(self) -> dict[str, Any]:
        return {**super().attributes(), "reuse_rows": 1, "reuse_tol": float(self.reuse_tol)}


def reencoding_tolerance(config) -> float | None:
    """``reuse_tol`` for the 4-D attention ops of a rewrite with ``config`` (a RewriteConfig), or None
    when re-encoding is not asked for (event-driven off, axis sequence, target without attention,
    or no ``--attn``)."""
    if config.attention is None or "event" not in TECHNIQUES:
        return None
    event = config.choice("event")
    if not (event.enabled and event.target in EVENT_TARGETS_WITH_ATTENTION and event.settings.axis == "call"):
        return None
    return float(event.settings.delta_theta)


def for_op(settings: AttentionSettings, new_op: str, tolerance: float | None) -> AttentionSettings:
    """The settings an emitted attention op gets: re-encoding on the 4-D op when ``tolerance`` is set."""
    if tolerance is None or new_op != OP_TYPE:
        return settings
    fields = {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)}
    return ReencodingAttentionSettings(**fields, reuse_tol=tolerance)
