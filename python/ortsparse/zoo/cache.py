"""Where the harness keeps what it fetches and builds (never in git), and how files get there.

$ORTSPARSE_CACHE, else $XDG_CACHE_HOME/ortsparse, else ~/.cache/ortsparse. The native build's
header cache (ort-headers/) lives there too. Every file is written to a temporary name beside
its target and renamed (:func:`atomic_write`), so an interrupted build leaves no half file;
:func:`remove_stale_temporaries` clears what a killed run left.
"""
from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path


class ModelNotBuiltError(FileNotFoundError):
    """A cache file that ``ortsparse models`` has not built (yet)."""


class ModelBuildError(RuntimeError):
    """A build step failed; the message names the entry and the cause."""


class MissingDependencyError(ModelBuildError):
    """The ``models`` extra (torch, transformers, gguf, accelerate) is not installed."""


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


# --------------------------------------------------------------------------------------------
# Atomic writes


def _temporary_name(path: Path) -> Path:
    # Keep the suffix: numpy appends .npy/.npz and some writers pick the format by extension.
    return path.with_name(f".{path.stem}.tmp{os.getpid()}{path.suffix}")


def atomic_write(path: Path, writer: Callable[[Path], object]) -> object:
    """Run ``writer(tmp)`` on a temporary path beside ``path``, then rename it onto ``path``.
    On any error the temporary file is removed and ``path`` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary_name(path)
    try:
        result = writer(tmp)
        if not tmp.exists():
            raise ModelBuildError(f"writing {path.name}: the writer produced no file")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return result


def atomic_write_bytes(path: Path, data: bytes) -> None:
    atomic_write(path, lambda tmp: tmp.write_bytes(data))


_TEMPORARY = re.compile(r"^\.(?P<stem>.+)\.tmp(?P<pid>\d+)(?P<suffix>\.[^.]*)?$")


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temporaries(folder: Path) -> list[Path]:
    """Remove temporary files (``.NAME.tmpPID.EXT``) left by a killed run; those of a process
    still running (another ``ortsparse models``) are kept."""
    removed = []
    if folder.is_dir():
        for entry in folder.iterdir():
            match = _TEMPORARY.match(entry.name)
            if match is None or not entry.is_file():
                continue
            pid = int(match["pid"])
            if pid == os.getpid() or not _process_alive(pid):
                entry.unlink(missing_ok=True)
                removed.append(entry)
    return removed
