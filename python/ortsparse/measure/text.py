"""Text in: the token ids of a text file, with the tokenizer that belongs to the model.

The tokenizer is ``--tokenizer`` (a ``tokenizer.json`` file, or a folder holding one) or else the
``tokenizer.json`` beside the model (an onnxruntime-genai folder or a Hugging Face export ships it
there). A text the tokenizer cannot read, an empty text, no tokenizer, or ids the model's vocabulary
does not have are one-line :class:`~ortsparse.graph_rewrite.errors.ModelFileError`s (CLI exit 2).

**BOS.** The text is tokenized without special tokens; whether each window starts with the model's
BOS token is decided apart (:func:`tokenizer_bos`), the way Hugging Face's tokenizer starts an
encoding (what an app's generation path feeds the model): ``add_bos_token`` in the
``tokenizer_config.json`` beside ``tokenizer.json`` when it is there (transformers' Llama/Gemma
tokenizers rebuild their post-processor from it), else what ``tokenizer.json``'s post-processor puts
before the text (a TemplateProcessing ``<bos> $A``). ``genai_config.json``'s ``bos_token_id`` is not
a sign: every genai folder names one (SmolLM2's and the tiny test model's too) whether or not the
tokenizer adds it; it only names the id when the tokenizer config says to add a BOS without naming it.
SmolLM2 (GPT-2 style, no template) gets none; Gemma-3 (``add_bos_token: true``, ``<bos> $A``) gets
``<bos>``.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..graph_rewrite.errors import ModelFileError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENAI_CONFIG_FILE = "genai_config.json"
BOS_CHOICES = "auto, none or a token id"


@dataclasses.dataclass(frozen=True)
class BosChoice:
    """Whether every window starts with a BOS token (``id``; None: no BOS), its text, and what said so."""

    id: int | None
    token: str | None
    source: str

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "token": self.token, "source": self.source}

    def describe(self) -> str:
        if self.id is None:
            return f"no BOS ({self.source})"
        name = f"{self.token} " if self.token else ""
        return f"BOS {name}(id {self.id}) first ({self.source})"


def as_bos(bos: BosChoice | int | None) -> BosChoice:
    """A BosChoice of ``bos`` (a token id given by the caller, or None: no BOS)."""
    if isinstance(bos, BosChoice):
        return bos
    if bos is None:
        return BosChoice(None, None, "none given")
    return BosChoice(int(bos), None, "given")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelFileError(f"{path} cannot be read as JSON: {str(error).splitlines()[0]}") from None
    return data if isinstance(data, dict) else {}


def _load_tokenizer(path: str | os.PathLike):
    from tokenizers import Tokenizer  # a Rust wheel; imported only when text comes in

    try:
        return Tokenizer.from_file(os.fspath(path))
    except Exception as error:  # tokenizers raises its own exception types
        raise ModelFileError(f"tokenizer {path} cannot be loaded: {str(error).splitlines()[0]}") from None


def _template_prefix(encoder) -> list[int]:
    """The ids the tokenizer's post-processor puts before a text (TemplateProcessing ``<bos> $A``)."""
    probe = "Hello world. 1 2 3"
    plain = encoder.encode(probe, add_special_tokens=False).ids
    full = encoder.encode(probe, add_special_tokens=True).ids
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return full[:start]
    return []


def tokenizer_bos(tokenizer: str | os.PathLike) -> BosChoice:
    """The BOS a generation path adds before a text with the tokenizer ``tokenizer`` (a
    tokenizer.json), from its folder's tokenizer_config.json or else its post-processor (module
    docstring)."""
    path = Path(tokenizer)
    encoder = _load_tokenizer(path)
    prefix = _template_prefix(encoder)
    config_path = path.with_name(TOKENIZER_CONFIG_FILE)
    config = _read_json(config_path) if config_path.is_file() else {}
    flag = config.get("add_bos_token")
    template = (f"tokenizer.json's post-processor adds {encoder.id_to_token(prefix[0])}" if prefix
                else "tokenizer.json's post-processor adds none")
    if isinstance(flag, bool):
        source = f"{TOKENIZER_CONFIG_FILE}: add_bos_token {str(flag).lower()}; {template}"
        if not flag:
            return BosChoice(None, None, source)
        name = config.get("bos_token")
        name = name.get("content") if isinstance(name, dict) else name
        bos = encoder.token_to_id(name) if isinstance(name, str) else None
        if bos is None and prefix:
            bos = prefix[0]
        genai = path.with_name(GENAI_CONFIG_FILE)
        if bos is None and genai.is_file():
            bos = _read_json(genai).get("model", {}).get("bos_token_id")
            bos = bos[0] if isinstance(bos, list) and bos else bos
            source += f"; id from {GENAI_CONFIG_FILE} bos_token_id"
        if not isinstance(bos, int):
            raise ModelFileError(f"{config_path}: add_bos_token is true but no BOS token is named there "
                                 f"(bos_token) or in the tokenizer; give --bos ID")
        return BosChoice(bos, encoder.id_to_token(bos), source)
    if prefix:
        extra = f" (and {len(prefix) - 1} more start token(s), not used)" if len(prefix) > 1 else ""
        return BosChoice(prefix[0], encoder.id_to_token(prefix[0]),
                         f"{template}{extra}; no add_bos_token in {TOKENIZER_CONFIG_FILE}")
    return BosChoice(None, None, f"{template}; no add_bos_token in {TOKENIZER_CONFIG_FILE}")


def resolve_bos(spec: str | None, model: str | os.PathLike | None, tokenizer: str | os.PathLike | None = None,
                vocab_size: int | None = None) -> BosChoice:
    """``--bos``: ``auto`` (default; :func:`tokenizer_bos` of the tokenizer ``find_tokenizer`` finds,
    no BOS when there is none), ``none``, or a token id."""
    spec = "auto" if spec is None else str(spec).strip().lower()
    if spec == "none":
        return BosChoice(None, None, "--bos none")
    if spec == "auto":
        try:
            path = find_tokenizer(model, tokenizer)
        except ModelFileError:
            if tokenizer is not None:
                raise
            return BosChoice(None, None, "no tokenizer beside the model to ask")
        return tokenizer_bos(path)
    try:
        bos = int(spec)
    except ValueError:
        raise ModelFileError(f"--bos {spec}: expected {BOS_CHOICES}") from None
    if bos < 0 or (vocab_size is not None and bos >= vocab_size):
        raise ModelFileError(f"--bos {bos} is outside the model's vocabulary of {vocab_size}")
    return BosChoice(bos, None, f"--bos {bos}")


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
    """The int64 token ids of the UTF-8 text file ``text`` (no special tokens added: a BOS is the
    windows' business, :func:`tokenizer_bos`)."""
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
    return tokenize_text(content, tokenizer)


def tokenize_text(content: str, tokenizer: str | os.PathLike) -> np.ndarray:
    """The int64 token ids of ``content`` (no special tokens added)."""
    encoder = _load_tokenizer(tokenizer)
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
