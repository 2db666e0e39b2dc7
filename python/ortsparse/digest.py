"""The one file digest of the package: the sha256 that model manifests (zoo/models.py) and the
genai folder record (graph_rewrite/genai.py: the op library's copy) write and compare."""
from __future__ import annotations

import hashlib
import os


def sha256(path: str | os.PathLike) -> str:
    """Hex sha256 of the file at ``path``, read in 4 MiB chunks (model weights do not fit twice in memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()
