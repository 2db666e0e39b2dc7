"""Running models in ONNX Runtime: model sources, CPU sessions with the right options, and feeds.

One place for what every measurement, benchmark and offline builder needs:

- model sources: :func:`load_proto` (a path, serialized bytes or an ``onnx.ModelProto``),
  :func:`opset_domains` / :func:`uses_ortsparse` (read from a file's top level only), and
  :func:`with_outputs` (a copy whose graph also outputs some inner values, e.g. a layer's X);
- sessions: :func:`open_session` registers the op library only when the model uses the
  ``ai.ortsparse`` domain (dense models run without it); :func:`thread_options` is the thread
  policy of every benchmark here (N intra-op threads; above one, ``session.intra_op.allow_spinning``
  off so idle pool threads do not steal the other candidate's core);
- feeds: :func:`lm_feeds` (one full-sequence window, or named sentence batches),
  :func:`decode_feeds` (one decoder step after a past of a given length, generated values),
  :func:`kv_step_feeds` (one real decode step: new ids, their positions and the past K/V).
"""
from __future__ import annotations

import mmap
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from ._library import DOMAIN
from ._library import session_options as library_session_options

# --------------------------------------------------------------------------- model sources


def load_proto(model: Any, load_weights: bool = False) -> onnx.ModelProto:
    """``model`` as an ``onnx.ModelProto``: a proto is returned as is, bytes are parsed, a path is
    loaded (external weights only when ``load_weights``)."""
    if isinstance(model, onnx.ModelProto):
        return model
    if isinstance(model, (bytes, bytearray)):
        return onnx.load_from_string(bytes(model))
    return onnx.load(os.fspath(model), load_external_data=load_weights)


def _varint(data: Any, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _file_opset_domains(path: str) -> set[str]:
    """The opset domains of an ONNX file from the top level of its protobuf: the graph (field 7) is
    skipped over, so this costs microseconds on a 600 MB model. Raises ValueError / IndexError /
    OSError when the file is not a plain protobuf."""
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        domains, pos = set(), 0
        while pos < len(data):
            key, pos = _varint(data, pos)
            field, wire = key >> 3, key & 7
            if wire == 0:
                _, pos = _varint(data, pos)
            elif wire == 1:
                pos += 8
            elif wire == 5:
                pos += 4
            elif wire == 2:
                length, pos = _varint(data, pos)
                if field == 8:  # ModelProto.opset_import
                    opset = onnx.OperatorSetIdProto()
                    opset.ParseFromString(data[pos:pos + length])
                    domains.add(opset.domain)
                pos += length
            else:
                raise ValueError(f"wire type {wire}")
        if pos != len(data):
            raise ValueError("truncated")
        return domains


def opset_domains(model: Any) -> set[str]:
    """The opset domains a model imports (for a file, read from the top level of the protobuf)."""
    if isinstance(model, (str, os.PathLike)):
        try:
            return _file_opset_domains(os.fspath(model))
        except (OSError, ValueError, IndexError):
            pass  # not a plain protobuf file (or empty): let onnx.load explain
    return {o.domain for o in load_proto(model).opset_import}


def uses_ortsparse(model: Any) -> bool:
    return DOMAIN in opset_domains(model)


def with_outputs(model: onnx.ModelProto, names: Sequence[str]) -> onnx.ModelProto:
    """A copy of ``model`` whose graph also outputs the values ``names`` (those not already outputs),
    e.g. the inputs X of linear layers for calibration."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    existing = {o.name for o in probe.graph.output}
    for name in dict.fromkeys(names):
        if name not in existing:
            probe.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
    return probe


# --------------------------------------------------------------------------- sessions


def thread_options(threads: int) -> dict[str, Any]:
    """The benchmarks' thread settings for :func:`open_session`: ``threads`` intra-op threads, and
    with more than one ``allow_spinning`` off (ORT's spinning pool threads would steal the core the
    other alternated candidate needs; with one thread there is no pool and ORT's default stays)."""
    return {"intra_op_num_threads": int(threads), "allow_spinning": False if threads > 1 else None}


def _dense_options(intra_op_num_threads: int | None = None, allow_spinning: bool | None = None,
                   **attrs: Any) -> ort.SessionOptions:
    # Same keywords as ortsparse.session_options, without registering the op library.
    options = ort.SessionOptions()
    if intra_op_num_threads is not None:
        options.intra_op_num_threads = int(intra_op_num_threads)
    if allow_spinning is not None:
        options.add_session_config_entry("session.intra_op.allow_spinning", "1" if allow_spinning else "0")
    for name, value in attrs.items():
        if not hasattr(options, name):
            raise TypeError(f"onnxruntime.SessionOptions has no attribute {name!r}")
        setattr(options, name, value)
    return options


def options_for(model: Any, session_options: Any = None) -> ort.SessionOptions:
    """The ``onnxruntime.SessionOptions`` :func:`open_session` uses for ``model``."""
    if isinstance(session_options, ort.SessionOptions):
        return session_options
    keywords = dict(session_options or {})
    if uses_ortsparse(model):
        return library_session_options(**keywords)
    return _dense_options(**keywords)


def open_session(model: Any, session_options: Any = None) -> ort.InferenceSession:
    """An onnxruntime CPU session for a path / ModelProto / bytes. ``session_options``: None, a dict
    of keywords (``intra_op_num_threads``, ``allow_spinning`` — see :func:`thread_options` — or any
    ``SessionOptions`` attribute) or a ready ``onnxruntime.SessionOptions`` (used as given). The op
    library is registered only when the model uses the ``ai.ortsparse`` domain."""
    options = options_for(model, session_options)
    if hasattr(model, "SerializeToString"):
        model = model.SerializeToString()
    elif isinstance(model, os.PathLike):
        model = os.fspath(model)
    elif isinstance(model, bytearray):
        model = bytes(model)
    return ort.InferenceSession(model, sess_options=options, providers=["CPUExecutionProvider"])


# --------------------------------------------------------------------------- feeds

_NUMPY_INTS = {"tensor(int64)": np.int64, "tensor(int32)": np.int32}


def lm_feeds(session_or_inputs: Any, tokens: Any) -> dict[str, np.ndarray]:
    """Feeds of one full-sequence run: ``tokens`` are the ids of one window (``[L]`` or ``[1, L]``;
    mask all ones, positions 0..L-1, token types 0), or a mapping of named arrays (a sentence batch)
    fed by name (:func:`named_feeds`). ``session_or_inputs``: a session or its ``get_inputs()``."""
    inputs = session_or_inputs.get_inputs() if hasattr(session_or_inputs, "get_inputs") else session_or_inputs
    if isinstance(tokens, Mapping):
        return named_feeds(inputs, tokens)
    window = np.asarray(tokens).reshape(-1)
    feeds = {}
    length = window.shape[-1]
    for spec in inputs:
        dtype = _NUMPY_INTS.get(spec.type)
        name = spec.name.lower()
        if dtype is None and spec.type != "tensor(bool)":
            raise ValueError(f"input {spec.name!r} of type {spec.type}: perplexity needs a full-sequence LM export "
                             "(integer input_ids, attention_mask [, position_ids])")
        if "past" in name or "cache" in name or "present" in name:
            raise ValueError(f"input {spec.name!r} looks like a KV cache: perplexity needs a full-sequence export")
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
        dtype = _NUMPY_INTS.get(spec.type, np.int64)
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
            shape = [1, int(dims[1]), past, int(dims[3])]
            feeds[name] = rng.standard_normal(shape).astype(np.float32)
        else:
            raise ValueError(f"speed: do not know how to feed input {name!r} of shape {_shape_of(graph_input)}")
    return feeds


def vocab_size(source: Any, default: int = 1000) -> int:
    """The last dim of the ``logits`` output when the graph states it, else ``default``."""
    for output in load_proto(source).graph.output:
        if output.name == "logits":
            dims = _shape_of(output)
            if isinstance(dims[-1], int) and dims[-1] > 0:
                return int(dims[-1])
    return default


def past_inputs(session: Any) -> list:
    """The KV-cache inputs (``past_key_values.*``) of a decoder session, in graph order."""
    return [i for i in session.get_inputs() if i.name.startswith("past_key_values.")]


def empty_past(session: Any, batch: int = 1) -> list[np.ndarray]:
    """K/V arrays of past length 0 for every KV input: a Run with them prefills the whole prompt."""
    return [np.zeros((batch, i.shape[1], 0, i.shape[3]), np.float32) for i in past_inputs(session)]


def kv_step_feeds(session: Any, ids: Any, position: int, past: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
    """Feeds of one real decode step of a KV export: ``ids`` [1, S] new tokens at positions
    ``position``..``position + S - 1``, the mask over past and new tokens, and ``past`` (the
    previous step's present K/V, or :func:`empty_past`)."""
    ids = np.asarray(ids, dtype=np.int64).reshape(1, -1)
    seq = ids.shape[1]
    feeds = {"input_ids": ids, "attention_mask": np.ones((1, position + seq), np.int64),
             "position_ids": np.arange(position, position + seq, dtype=np.int64)[None, :]}
    feeds.update(zip((i.name for i in past_inputs(session)), past))
    return feeds
