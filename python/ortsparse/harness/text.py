"""Text in: the token ids of a text file, with the tokenizer that belongs to the model.

The tokenizer is ``--tokenizer`` (a ``tokenizer.json`` file, or a folder holding one) or else the
``tokenizer.json`` beside the model (an onnxruntime-genai folder or a Hugging Face export ships it
there). A text the tokenizer cannot read, an empty text, no tokenizer, or ids the model's vocabulary
does not have are one-line :class:`~ortsparse.graph_rewrite.errors.ModelFileError`s (CLI exit 2).
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..graph_rewrite.errors import ModelFileError

TOKENIZER_FILE = "tokenizer.json"


def find_tokenizer(model: str | os.PathLike | None, tokenizer: str | os.PathLike | None = None) -> Path:
    """The tokenizer.json to use for ``model`` (a model file or folder), ``tokenizer`` first."""
    if tokenizer is not None:
        path = Path(tokenizer)
        if path.is_dir():
            path = path / TOKENIZER_FILE
        if not path.is_file():
            raise ModelFileError(f"tokenizer {tokenizer}: no {TOKENIZER_FILE} there")
        return path
    if model is not None:
        model = Path(model)
        folder = model if model.is_dir() else model.parent
        if (folder / TOKENIZER_FILE).is_file():
            return folder / TOKENIZER_FILE
        raise ModelFileError(f"no tokenizer for {model}: {folder} has no {TOKENIZER_FILE}; give --tokenizer "
                             f"PATH (a {TOKENIZER_FILE} or the folder holding it)")
    raise ModelFileError(f"no tokenizer: give --tokenizer PATH (a {TOKENIZER_FILE} or the folder holding it)")


def tokenizer_read(model: str | os.PathLike | None, tokenizer: str | os.PathLike | None) -> Path | None:
    """The tokenizer file a ``--text`` run would read (an input no output may replace), or None
    when there is none (the run then says so)."""
    try:
        return find_tokenizer(model, tokenizer)
    except ModelFileError:
        return None


def tokenize_file(text: str | os.PathLike, tokenizer: str | os.PathLike) -> np.ndarray:
    """The int64 token ids of the UTF-8 text file ``text`` (no special tokens added)."""
    from tokenizers import Tokenizer  # a Rust wheel; imported only when text comes in

    path = Path(text)
    if not path.is_file():
        raise ModelFileError(f"text {path} does not exist or is not a regular file")
    try:
        content = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ModelFileError(f"text {path} is not UTF-8 ({error.reason} at byte {error.start})") from None
    except OSError as error:
        raise ModelFileError(f"cannot read text {path}: {error.strerror or error}") from None
    if not content.strip():
        raise ModelFileError(f"text {path} is empty")
    try:
        encoder = Tokenizer.from_file(os.fspath(tokenizer))
    except Exception as error:  # tokenizers raises its own exception types
        raise ModelFileError(f"tokenizer {tokenizer} cannot be loaded: {str(error).splitlines()[0]}") from None
    ids = encoder.encode(content, add_special_tokens=False).ids
    return np.asarray(ids, dtype=np.int64)


def check_vocabulary(tokens: np.ndarray, vocab_size: int | None, *, tokenizer: str | os.PathLike | None = None) -> None:
    """Token ids must be < the model's vocabulary (a tokenizer of another model would not be)."""
    if vocab_size is None or tokens.size == 0:
        return
    top = int(tokens.max())
    if top >= vocab_size:
        source = f" from tokenizer {tokenizer}" if tokenizer else ""
        raise ModelFileError(f"token id {top}{source} is outside the model's vocabulary of {vocab_size}: "
                             "the tokenizer does not belong to this model")


def text_tokens(text: str | os.PathLike, model: str | os.PathLike | None, tokenizer: str | os.PathLike | None = None,
                vocab_size: int | None = None) -> np.ndarray:
    """find_tokenizer + tokenize_file + check_vocabulary."""
    path = find_tokenizer(model, tokenizer)
    tokens = tokenize_file(text, path)
    check_vocabulary(tokens, vocab_size, tokenizer=path)
    return tokens
