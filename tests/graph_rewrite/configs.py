"""Short spellings of the RewriteConfigs the tests use (KWTA is techniques["kwta"] like any other)."""
from __future__ import annotations

from ortsparse.graph_rewrite import KwtaSettings, RewriteConfig, TechniqueChoice

KWTA_OFF = TechniqueChoice(KwtaSettings(), enabled=False)


def kwta(target: str = "mlp", *, enabled: bool = True, overrides=(), attention=None, techniques=None,
         **settings) -> RewriteConfig:
    """KWTA switched on (or off) for ``target`` with ``settings``, plus anything else given."""
    choice = TechniqueChoice(KwtaSettings(**settings), enabled=enabled, target=target)
    return RewriteConfig(techniques={"kwta": choice, **(techniques or {})}, overrides=overrides, attention=attention)


def without_kwta(*, overrides=(), attention=None, techniques=None) -> RewriteConfig:
    """KWTA explicitly off (whatever ``auto`` would say), plus anything else given."""
    return RewriteConfig(techniques={"kwta": KWTA_OFF, **(techniques or {})}, overrides=overrides,
                         attention=attention)
