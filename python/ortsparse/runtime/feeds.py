"""Feeds: :func:`lm_feeds` (one full-sequence window, or named sentence batches; a KV-cache decoder gets
an empty past, so a decoder graph is scored on the graph that runs), :func:`decode_feeds` (one decoder
step after a past of a given length, generated values), :func:`kv_step_feeds` (one real decode step:
new ids, their positions and the past K/V)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .model_files import load_proto
from .kv_cache import NUMPY_INTS, past_inputs, KVLayout, window_capacities, kv_layout


def lm_feeds(session_or_inputs: Any, tokens: Any, kv: KVLayout | None = None) -> dict[str, np.ndarray]:
    """Feeds of one full-sequence run: ``tokens`` are the ids of one window (``[L]`` or ``[1, L]``;
    mask all ones, positions 0..L-1, token types 0), or a mapping of named arrays (a sentence batch)
    fed by name (:func:`named_feeds`). ``session_or_inputs``: a session or its ``get_inputs()``.
    A KV-cache decoder is fed an empty past when its ``kv`` layout (:func:`kv_layout`) is given:
    the whole window is then one prefill of the graph that decodes."""
    inputs = session_or_inputs.get_inputs() if hasattr(session_or_inputs, "get_inputs") else session_or_inputs
    if isinstance(tokens, Mapping):
        return named_feeds(inputs, tokens)
    window = np.asarray(tokens).reshape(-1)
    feeds = {}
    length = window.shape[-1]
    empty = dict(zip(kv.past, kv.empty())) if kv is not None else {}
    for spec in inputs:
        if spec.name in empty:
            feeds[spec.name] = empty[spec.name]
            continue
        dtype = NUMPY_INTS.get(spec.type)
        name = spec.name.lower()
        if "past" in name or "cache" in name or "present" in name:
            raise ValueError(f"input {spec.name!r} looks like a KV cache: perplexity needs a full-sequence export "
                             "or the decoder's KV layout (ortsparse.runtime.kv_layout) for an empty past")
        if dtype is None and spec.type != "tensor(bool)":
            raise ValueError(f"input {spec.name!r} of type {spec.type}: perplexity needs a full-sequence LM export "
                             "(integer input_ids, attention_mask [, position_ids])")
        if "mask" in name:
            feeds[spec.name] = np.ones((1, length), dtype=dtype or np.bool_)
        elif "position" in name:
            feeds[spec.name] = np.arange(length, dtype=dtype)[None, :]
        elif "type" in name:
            feeds[spec.name] = np.zeros((1, length), dtype=dtype)
        elif "ids" in name or "input" in name:
            feeds[spec.name] = window[None, :].astype(dtype)
        else:
            raise ValueError(f"do not know what to feed LM input {spec.name!r}")
    return feeds


def named_feeds(inputs: Any, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Feeds from named arrays ([batch, S]); token types default to zeros, positions to 0..S-1."""
    mask = np.asarray(arrays.get("attention_mask", arrays.get("input_ids")))
    feeds = {}
    for spec in inputs:
        dtype = NUMPY_INTS.get(spec.type, np.int64)
        lowered = spec.name.lower()
        if spec.name in arrays:
            feeds[spec.name] = np.asarray(arrays[spec.name]).astype(dtype)
        elif "type" in lowered:
            feeds[spec.name] = np.zeros(mask.shape, dtype=dtype)
        elif "position" in lowered:
            feeds[spec.name] = np.broadcast_to(np.arange(mask.shape[1], dtype=dtype), mask.shape).copy()
        else:
            raise ValueError(f"nothing to feed model input {spec.name!r} (have {', '.join(sorted(arrays))})")
    return feeds


def _shape_of(value_info) -> list:
    return [d.dim_param if d.dim_param else d.dim_value for d in value_info.type.tensor_type.shape.dim]


def decode_feeds(source: Any, *, new_tokens: int, past: int, vocab: int = 1000, seed: int = 0) -> dict[str, np.ndarray]:
    """Feeds for one Run of a decoder export (generated values, for timing): ``new_tokens`` random
    ids after a past of ``past`` tokens (KV inputs named past*, sized [batch=1, heads, past,
    head_dim], Gaussian values); a full-sequence export ignores ``past``."""
    rng = np.random.default_rng(seed)
    proto = load_proto(source)
    initializers = {init.name for init in proto.graph.initializer}
    feeds: dict[str, np.ndarray] = {}
    has_past = any("past" in i.name for i in proto.graph.input)
    total = past + new_tokens if has_past else new_tokens
    windows = window_capacities(proto)
    for graph_input in proto.graph.input:
        if graph_input.name in initializers:
            continue
        name = graph_input.name
        if name == "input_ids":
            feeds[name] = rng.integers(0, vocab, size=(1, new_tokens), dtype=np.int64)
        elif name == "attention_mask":
            feeds[name] = np.ones((1, total), dtype=np.int64)
        elif name == "position_ids":
            feeds[name] = np.arange(total - new_tokens, total, dtype=np.int64)[None, :]
        elif name == "token_type_ids":
            feeds[name] = np.zeros((1, new_tokens), dtype=np.int64)
        elif "past" in name:
            dims = _shape_of(graph_input)
            rows = windows[name] if name in windows else past  # a window-sized buffer: its capacity
            shape = [1, int(dims[1]), rows, int(dims[3])]
            feeds[name] = rng.standard_normal(shape).astype(np.float32)
        else:
            raise ValueError(f"speed: do not know how to feed input {name!r} of shape {_shape_of(graph_input)}")
    return feeds


def vocab_size(source: Any, default: int | None = 1000) -> int | None:
    """The last dim of the ``logits`` output when the graph states it, else ``default``."""
    for output in load_proto(source).graph.output:
        if output.name == "logits":
            dims = _shape_of(output)
            if isinstance(dims[-1], int) and dims[-1] > 0:
                return int(dims[-1])
    return default


def empty_past(session: Any, batch: int = 1, model: Any = None) -> list[np.ndarray]:
    """K/V arrays of past length 0 for every KV input: a Run with them prefills the whole prompt.
    ``model`` (the session's path or proto) resolves a symbolic head size (:func:`kv_layout`)."""
    layout = kv_layout(session, model)
    return layout.empty(batch) if layout is not None else []


def kv_step_feeds(session: Any, ids: Any, position: int, past: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
    """Feeds of one real decode step of a KV export: ``ids`` [1, S] new tokens at positions
    ``position``..``position + S - 1``, the mask over past and new tokens, and ``past`` (the
    previous step's present K/V, or :func:`empty_past`). A graph without a ``position_ids`` input
    (onnxruntime-genai's: positions come from the mask) gets none."""
    ids = np.asarray(ids, dtype=np.int64).reshape(1, -1)
    seq = ids.shape[1]
    types = {i.name: i.type for i in session.get_inputs()}
    feeds = {"input_ids": ids.astype(NUMPY_INTS.get(types.get("input_ids"), np.int64)),
             "attention_mask": np.ones((1, position + seq), NUMPY_INTS.get(types.get("attention_mask"), np.int64))}
    if "position_ids" in types:
        feeds["position_ids"] = np.arange(position, position + seq, dtype=NUMPY_INTS.get(types["position_ids"],
                                                                                          np.int64))[None, :]
    feeds.update(zip((i.name for i in past_inputs(session)), past))
    return feeds
