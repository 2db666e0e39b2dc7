"""Layer classes, roles and the ``--<technique>-target`` values that select them."""
from __future__ import annotations

LAYER_CLASSES = ("mlp", "attn", "head", "other")
LAYER_ROLES = ("up", "down", "q", "k", "v", "qkv", "out", "head", "other")
TARGETS = ("mlp", "attn", "both", "down", "all")


def target_includes(target: str, layer_class: str, role: str) -> bool:
    """Whether a ``--<technique>-target`` value selects a layer of this class and role."""
    if target == "all":
        return True
    if target == "down":
        return layer_class == "mlp" and role == "down"
    if target == "both":
        return layer_class in ("mlp", "attn")
    return layer_class == target
