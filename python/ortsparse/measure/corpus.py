"""Evaluation data: the token corpus and its windows (language models), the sentence sets and their
batches (encoders), and where the cache keeps both.

Window ``i`` of a corpus is ``token_ids[offset + i*L : offset + (i+1)*L]``: consecutive,
non-overlapping, from the start of the array unless ``offset`` says otherwise (calibration takes
later windows so it never sees the evaluation ones). With a BOS token (the model's tokenizer adds
one, :func:`ortsparse.measure.text.tokenizer_bos`) window ``i`` is ``[bos] + token_ids[offset +
i*(L-1) : offset + (i+1)*(L-1)]``: still L positions, L-1 of them text. A sentence set is ``input_ids`` and
``attention_mask`` ``[n, S]`` (padded), optionally ``token_type_ids`` (a ``.npz`` or a mapping).
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..graph_rewrite.errors import ModelFileError
from ..runtime import vocab_size as logits_width
from ..zoo.cache import models_dir
from ..zoo.models import cached_file


NPY_MAGIC = b"\x93NUMPY"


def default_corpus() -> Path:
    """SmolLM2 token ids of the perplexity corpus (britannica-11th; the cache builder's fallback
    corpus when it had to use one)."""
    return cached_file("corpus", "smollm2.tokens", models_dir() / "smollm2" / "corpus_britannica.npy")


def default_sentences() -> Path:
    """The MiniLM sentence set of the cache (with sentence-transformers' reference embeddings)."""
    return cached_file("minilm", "sentences", models_dir() / "minilm" / "sentences.npz")


def load_corpus_tokens(path: str | os.PathLike | None = None, vocab_size: int | None = None) -> np.ndarray:
    """The token ids of a ``.npy`` file (default: the cache's SmolLM2 britannica-11th tokens) as int64,
    checked as every command reads a token corpus: a 1-D, non-empty array of integers, each ``0 <= id
    < vocab_size`` (the model's vocabulary, when known: an id past it would fail inside onnxruntime,
    and a negative one would silently read another embedding row — Gather wraps -1 to the last).
    Anything else is a one-line :class:`ModelFileError` naming the file (CLI exit 2)."""
    path = Path(path) if path is not None else default_corpus()
    if not path.is_file():
        raise ModelFileError(f"token corpus {path} not found (run `ortsparse models`, or give a .npy of token ids)")
    try:
        with path.open("rb") as file:
            if file.read(len(NPY_MAGIC)) != NPY_MAGIC:  # a text file, a .npz archive, anything else
                raise ModelFileError(f"token corpus {path} is not a .npy file; give the token ids saved with np.save")
            file.seek(0)
            ids = np.load(file, allow_pickle=False)
    except (OSError, ValueError, EOFError) as error:  # unreadable, truncated, or an array of Python objects
        reason = (str(error).splitlines() or [type(error).__name__])[0]
        raise ModelFileError(f"token corpus {path} cannot be read as token ids: {reason}") from None
    if not np.issubdtype(ids.dtype, np.integer):
        raise ModelFileError(f"token corpus {path} holds {ids.dtype} values; token ids are integers")
    if ids.ndim != 1:
        raise ModelFileError(f"token corpus {path} has shape {list(ids.shape)}; give a 1-D array of token ids")
    if ids.size == 0:
        raise ModelFileError(f"token corpus {path} is empty")
    low, high = int(ids.min()), int(ids.max())
    if low < 0:
        raise ModelFileError(f"token corpus {path} holds the negative id {low} (at index {int(ids.argmin())})")
    if vocab_size is not None and high >= vocab_size:
        raise ModelFileError(f"token corpus {path} holds the id {high} (at index {int(ids.argmax())}), outside the "
                             f"model's vocabulary of {vocab_size}: the ids are not this model's")
    return ids.astype(np.int64, copy=False)


def vocabulary_of(*models: Any) -> int | None:
    """The smallest vocabulary of ``models`` (paths or protos of decoder graphs) that their logits
    output states: the ids a corpus for all of them may hold (None when no graph states it)."""
    return min(filter(None, (logits_width(model, default=None) for model in models)), default=None)


SPLITS = ("halves", "interleaved")


def split_held_out(token_ids: Any, window_len: int, how: str = "halves") -> tuple[np.ndarray, np.ndarray]:
    """(held-out, calibration) token streams of one text; no token is in both. ``halves``: the first
    half is held out, the second calibrates. ``interleaved``: the text cut into ``window_len``-token
    windows, even windows held out and odd ones calibrating — both halves then see the same mix of
    the text (a text whose second half differs from its first, such as an encyclopedia in alphabetical
    order, otherwise calibrates on one kind of text and is checked on another)."""
    tokens = np.asarray(token_ids).reshape(-1)
    if how == "halves":
        held, calibration = np.split(tokens, [tokens.size // 2])
        return held, calibration
    if how != "interleaved":
        raise ValueError(f"split {how!r}: expected one of {', '.join(SPLITS)}")
    count = tokens.size // window_len
    windows = tokens[:count * window_len].reshape(count, window_len)
    return windows[0::2].reshape(-1), windows[1::2].reshape(-1)


def text_per_window(window_len: int, bos: int | None = None) -> int:
    """Text tokens in a window of ``window_len`` positions (one fewer when a BOS comes first)."""
    return window_len - (bos is not None)


def first_scored(bos: int | None = None) -> int:
    """Position of a window's first scored prediction. Scored are the predictions of the window's
    text tokens 2..n from the tokens before them; the first text token is context only. With a BOS,
    the BOS position's prediction (the first text token, cut from mid-text, from nothing) is not
    scored either, so a window with and without BOS scores the same text tokens."""
    return 0 if bos is None else 1


def shortest_window(bos: int | None = None) -> int:
    """Positions of the shortest window with one scored prediction (a BOS adds one, unscored)."""
    return 2 + (bos is not None)


def lm_windows(token_ids: Any, windows: int = 8, window_len: int = 512, offset: int = 0,
               bos: int | None = None) -> np.ndarray:
    """``[windows, window_len]`` int64: window i = ``token_ids[offset + i*L : offset + (i+1)*L]``;
    with ``bos``: ``[bos] + token_ids[offset + i*(L-1) : offset + (i+1)*(L-1)]``."""
    tokens = np.asarray(token_ids).reshape(-1)
    if not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"token ids must be integers, got dtype {tokens.dtype}")
    shortest = shortest_window(bos)
    if windows < 1 or window_len < shortest:
        raise ValueError(f"need windows >= 1 and window_len >= {shortest} (got {windows} x {window_len})")
    if offset < 0:
        raise ValueError(f"offset {offset} is negative")
    text = text_per_window(window_len, bos)
    needed = offset + windows * text
    if needed > tokens.size:
        raise ValueError(f"{windows} windows of {text} text tokens from offset {offset} need {needed} tokens; "
                         f"the token array has {tokens.size}")
    body = tokens[offset:needed].astype(np.int64).reshape(windows, text)
    if bos is None:
        return body
    return np.concatenate([np.full((windows, 1), bos, dtype=np.int64), body], axis=1)


def check_windows(available: int, windows: int, window_len: int, *, offset: int = 0, source: str = "the tokens",
                  max_positions: int | None = None, windows_flag: str = "--windows", bos: int | None = None) -> None:
    """A one-line :class:`ModelFileError` (CLI exit 2), before any model runs, when ``windows`` windows
    of ``window_len`` positions (``[bos] +`` text when ``bos``) from ``offset`` need more than the
    ``available`` tokens of ``source``, a window has no scored prediction (:func:`lm_windows`), or a
    window is longer than the model's ``max_positions`` (its longest sequence, when known)."""
    shortest = shortest_window(bos)
    if window_len < shortest:
        raise ModelFileError(f"--window-len {window_len} leaves no next-token prediction to score"
                             + (f" after the BOS (id {bos})" if bos is not None else "")
                             + f"; give --window-len {shortest} or more")
    if max_positions is not None and window_len > max_positions:
        raise ModelFileError(f"--window-len {window_len} is longer than the model's context of {max_positions} "
                             f"tokens; give --window-len {max_positions} or less")
    text = text_per_window(window_len, bos)
    needed = offset + windows * text
    if needed > available:
        fit = max(0, (available - offset) // text)
        start = f" from --offset {offset}" if offset else ""
        raise ModelFileError(f"{windows_flag} {windows} x --window-len {window_len}{start} need {needed} tokens; "
                             f"{source} has {available} (room for {fit} such window(s): fewer or shorter "
                             "windows, or a longer text)")


def load_sentences(sentences: Any) -> dict[str, np.ndarray]:
    """A sentence set: a ``.npz`` path or a mapping with ``input_ids`` and ``attention_mask``
    (``[n, S]``, padded) and optionally ``token_type_ids``."""
    if isinstance(sentences, Mapping):
        arrays = {k: np.asarray(v) for k, v in sentences.items()}
    else:
        with np.load(os.fspath(sentences)) as data:
            arrays = {k: data[k] for k in data.files}
    for key in ("input_ids", "attention_mask"):
        if key not in arrays:
            raise ValueError(f"sentence set lacks {key!r} (has {', '.join(sorted(arrays))})")
        if arrays[key].ndim != 2:
            raise ValueError(f"sentence set {key!r} must be [sentences, length], got shape {list(arrays[key].shape)}")
    return arrays


def sentence_batches(arrays: Mapping[str, np.ndarray], batch_size: int = 32) -> list[dict[str, np.ndarray]]:
    """A loaded sentence set cut into batches of at most ``batch_size`` sentences."""
    count = arrays["input_ids"].shape[0]
    return [{k: v[start:start + batch_size] for k, v in arrays.items()} for start in range(0, count, batch_size)]


def encoder_batches(sentences: Any = None, batch_size: int = 32) -> list[dict[str, np.ndarray]]:
    """The sentence set (default: the cache's MiniLM set) cut into batches of named arrays, each
    usable with :func:`ortsparse.runtime.lm_feeds`."""
    return sentence_batches(load_sentences(default_sentences() if sentences is None else sentences), batch_size)
