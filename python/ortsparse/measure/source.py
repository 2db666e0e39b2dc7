"""The model a command names, resolved once: :class:`ModelSource`.

A model is named as an ONNX file or an onnxruntime-genai folder. What the measurements and the
rewrite need of it — the folder (a folder is rewritten as a folder), the decoder file, its graph,
the tokenizer beside it, the vocabulary, the context length, the KV cache's layout, the linear
layers the rewriter's survey finds — is derived here once, when the model is opened, instead of
from the path at each use (``tune`` read the same decoder from disk about ten times and surveyed
it four times).
"""
from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import onnx
import onnx_ir as ir

from ..graph_rewrite.genai import model_input
from ..graph_rewrite.layers import LinearLayer, survey
from ..runtime import KVLayout, context_length, genai_folder, kv_layout, load_proto, vocab_size, with_weights
from ..verify import embedding_sizes
from .text import find_tokenizer


def token_vocabulary(model: Any) -> int | None:
    """The rows of the embedding table the model's token ids index (the fewest, when several id
    inputs index tables; position and token-type ids aside); None when no input indexes one."""
    rows = embedding_sizes(model)
    token_inputs = [n for n in rows if "ids" in n.lower() and not any(w in n.lower() for w in ("position", "type"))]
    return min(rows[n] for n in token_inputs) if token_inputs else None


class ModelSource:
    """One model, opened once (:func:`open_model`): ``path`` as named; ``folder``, the genai folder
    when ``path`` is one (the model is then rewritten and run as a folder); ``decoder``, the ONNX file;
    ``graph``, its graph without the external weights (parsed once); ``context_length``, the longest
    sequence its genai config allows (also for the decoder file of a folder); ``vocabulary``, the
    logits' width. Derived on first use and kept: ``weights`` (the graph with its weights),
    ``linear_layers`` (the rewriter's survey of it), ``token_vocabulary``, ``tokenizer`` and the KV
    layout (:meth:`kv_layout`)."""

    def __init__(self, path: str | os.PathLike, tokenizer: str | os.PathLike | None = None) -> None:
        self.path = Path(path)
        self.folder = genai_folder(self.path) if self.path.is_dir() else None
        self.decoder = model_input(self.path)  # a damaged file or folder: one line, before anything runs
        self.graph = load_proto(self.decoder)
        self.context_length = context_length(self.path)
        self.vocabulary = vocab_size(self.graph, default=None)
        self._tokenizer = tokenizer
        self._kv: dict[str, KVLayout | None] = {}

    def __repr__(self) -> str:
        return f"ModelSource({str(self.path)!r})"

    def __fspath__(self) -> str:
        """The decoder file (what a session opens)."""
        return os.fspath(self.decoder)

    @property
    def runs_as(self) -> Path:
        """What runs the model in the decode loop: the folder (the Generator), else the decoder file."""
        return self.folder if self.folder is not None else self.decoder

    @functools.cached_property
    def tokenizer(self) -> Path:
        """The tokenizer.json given, else the one beside the model (ModelFileError naming the
        folder when there is none)."""
        return find_tokenizer(self.path, self._tokenizer)

    @functools.cached_property
    def weights(self) -> onnx.ModelProto:
        """The decoder with its weights (external data read under ONNX Runtime's rule)."""
        return with_weights(self.graph, self.decoder)

    @functools.cached_property
    def linear_layers(self) -> list[LinearLayer]:
        """The rewriter's survey of the weighted graph (every linear layer, in graph order)."""
        return survey(ir.from_proto(self.weights)).layers

    @functools.cached_property
    def token_vocabulary(self) -> int | None:
        return token_vocabulary(self.graph)

    def kv_layout(self, session: Any) -> KVLayout | None:
        """The KV cache of the decoder as ``session`` (a session of it) declares it (None: no cache)."""
        key = repr([(i.name, i.shape) for i in session.get_inputs()])
        if key not in self._kv:
            self._kv[key] = kv_layout(session, self.decoder)
        return self._kv[key]

    def release_weights(self) -> None:
        """Drops the weighted graph and its survey (memory for what runs after the calibration)."""
        self.__dict__.pop("weights", None)
        self.__dict__.pop("linear_layers", None)


def open_model(path: str | os.PathLike, tokenizer: str | os.PathLike | None = None) -> ModelSource:
    """The model at ``path`` (an ONNX file or a genai folder) resolved once; ``tokenizer``: the
    tokenizer.json (or its folder) when it is not beside the model."""
    return ModelSource(path, tokenizer)
