"""Where the harness keeps what it fetches and builds (never in git).

$ORTSPARSE_CACHE, else $XDG_CACHE_HOME/ortsparse, else ~/.cache/ortsparse. The native build's
header cache (ort-headers/) lives there too.
"""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    explicit = os.environ.get("ORTSPARSE_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "ortsparse"


def models_dir() -> Path:
    return cache_root() / "models"


def corpus_dir() -> Path:
    return cache_root() / "corpus"


def reports_dir() -> Path:
    return cache_root() / "reports"
