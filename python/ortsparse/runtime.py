"""Running models in ONNX Runtime: model sources, CPU sessions with the right options, and feeds.

One place for what every measurement, benchmark and offline builder needs:

- model sources: :func:`load_proto` (a path, serialized bytes or an ``onnx.ModelProto``),
  :func:`opset_domains` / :func:`uses_ortsparse` (read from a file's top level only), and
  :func:`with_outputs` (a copy whose graph also outputs some inner values, e.g. a layer's X);
- sessions: :func:`open_session` registers the op library only when the model uses the
  ``ai.ortsparse`` domain (dense models run without it); :func:`thread_options` is the thread
  policy of every benchmark here (N intra-op threads; above one, ``session.intra_op.allow_spinning``
  off so idle pool threads do not steal the other candidate's core);
- feeds: :func:`lm_feeds` (one full-sequence window, or named sentence batches; a KV-cache
  decoder gets an empty past, so a decoder graph is scored on the graph that runs),
  :func:`decode_feeds` (one decoder step after a past of a given length, generated values),
  :func:`kv_step_feeds` (one real decode step: new ids, their positions and the past K/V);
- KV-cache decoders: :func:`kv_layout` (past/present names, heads, head size — a symbolic head
  size, as onnxruntime-genai's graphs declare it, is read from the folder's ``genai_config.json``
  or from the graph; window-sized buffers of sliding-window layers, GroupQueryAttention's
  ``sliding_window_cache=1``, from the graph), :func:`genai_decoder` (what a genai model folder's
  config says about its decoder), and :class:`KVDecoder`, which advances a decoder session step by step with the
  present K/V kept as ONNX Runtime values (IOBinding: the cache is never copied through numpy).
"""
from __future__ import annotations

import dataclasses
import json
import mmap
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from ._library import DOMAIN, plain_session_options, session_source
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


def _scan_model_file(path: str) -> tuple[set[str], set[int]]:
    """(opset domains, top-level field numbers) of an ONNX file from the top level of its protobuf:
    the graph (field 7) is skipped over, so this costs microseconds on a 600 MB model. Raises
    ValueError / IndexError / OSError when the file is not a plain protobuf."""
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        domains, fields, pos = set(), set(), 0
        while pos < len(data):
            key, pos = _varint(data, pos)
            field, wire = key >> 3, key & 7
            fields.add(field)
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
        return domains, fields


def _file_opset_domains(path: str) -> set[str]:
    """The opset domains of an ONNX file (:func:`_scan_model_file`)."""
    return _scan_model_file(path)[0]


def is_onnx_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a file whose top level parses as an ONNX ModelProto holding a graph
    (a text, a tokenizer or a weights file does not); the graph itself is not read."""
    try:
        return 7 in _scan_model_file(os.fspath(path))[1]  # ModelProto.graph
    except (OSError, ValueError, IndexError):
        return False


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


def options_for(model: Any, session_options: Any = None) -> ort.SessionOptions:
    """The ``onnxruntime.SessionOptions`` :func:`open_session` uses for ``model``."""
    if isinstance(session_options, ort.SessionOptions):
        return session_options
    keywords = dict(session_options or {})
    if uses_ortsparse(model):
        return library_session_options(**keywords)
    return plain_session_options(**keywords)


def open_session(model: Any, session_options: Any = None) -> ort.InferenceSession:
    """An onnxruntime CPU session for a path / ModelProto / bytes. ``session_options``: None, a dict
    of keywords (``intra_op_num_threads``, ``allow_spinning`` — see :func:`thread_options` — or any
    ``SessionOptions`` attribute) or a ready ``onnxruntime.SessionOptions`` (used as given). The op
    library is registered only when the model uses the ``ai.ortsparse`` domain."""
    options = options_for(model, session_options)
    return ort.InferenceSession(session_source(model), sess_options=options, providers=["CPUExecutionProvider"])


# --------------------------------------------------------------------------- feeds

_NUMPY_INTS = {"tensor(int64)": np.int64, "tensor(int32)": np.int32}


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
        dtype = _NUMPY_INTS.get(spec.type)
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


def past_inputs(session: Any) -> list:
    """The KV-cache inputs (``past_key_values.*``) of a decoder session, in graph order."""
    return [i for i in session.get_inputs() if i.name.startswith("past_key_values.")]


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
    feeds = {"input_ids": ids.astype(_NUMPY_INTS.get(types.get("input_ids"), np.int64)),
             "attention_mask": np.ones((1, position + seq), _NUMPY_INTS.get(types.get("attention_mask"), np.int64))}
    if "position_ids" in types:
        feeds["position_ids"] = np.arange(position, position + seq, dtype=_NUMPY_INTS.get(types["position_ids"],
                                                                                          np.int64))[None, :]
    feeds.update(zip((i.name for i in past_inputs(session)), past))
    return feeds


# --------------------------------------------------------------------------- KV-cache decoders

GENAI_CONFIG = "genai_config.json"


class GenaiConfigError(ValueError):
    """A folder that is not a usable onnxruntime-genai model folder (one-line reason)."""


@dataclasses.dataclass(frozen=True)
class GenaiDecoder:
    """What an onnxruntime-genai model folder's ``genai_config.json`` says about its decoder."""

    folder: Path
    config_path: Path
    config: dict
    model_file: Path
    head_size: int
    kv_heads: int
    layers: int
    context_length: int | None

    @property
    def session_options(self) -> dict:
        return self.config["model"]["decoder"].setdefault("session_options", {})


def genai_folder(path: str | os.PathLike) -> Path | None:
    """The onnxruntime-genai folder ``path`` is or belongs to: a folder holding ``genai_config.json``,
    or a file beside one (its model.onnx, the config itself); None otherwise."""
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    return folder if (folder / GENAI_CONFIG).is_file() else None


def _not_json_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _positive_int(section: dict, key: str, where: str) -> int | None:
    """``section[key]`` as a positive int (None when absent); anything else is a GenaiConfigError."""
    value = section.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise GenaiConfigError(f"{where}.{key} must be a positive integer, not {json.dumps(value)[:40]}")
    return value


def genai_decoder(path: str | os.PathLike) -> GenaiDecoder:
    """Read the genai folder ``path`` (or the folder of a file in it). Raises
    :class:`GenaiConfigError` naming the folder and the problem: a path that does not exist, no
    genai_config.json, a config that is not JSON (NaN / Infinity included) or not an object, lacks
    the decoder's filename / head_size / layers or gives them as something else than positive
    integers, session_options that is not an object, a decoder model file that is missing."""
    path = Path(path)
    if not path.exists():
        raise GenaiConfigError(f"{path} does not exist")
    folder = path if path.is_dir() else path.parent
    config_path = folder / GENAI_CONFIG
    if not config_path.is_file():
        raise GenaiConfigError(f"{folder} has no {GENAI_CONFIG}: not an onnxruntime-genai model folder")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"), parse_constant=_not_json_constant)
    except (OSError, UnicodeDecodeError) as error:
        raise GenaiConfigError(f"cannot read {config_path}: {getattr(error, 'strerror', None) or error}") from None
    except RecursionError:
        raise GenaiConfigError(f"{config_path} is nested too deeply to be a genai config") from None
    except ValueError as error:
        raise GenaiConfigError(f"{config_path} is not valid JSON ({error})") from None
    model = config.get("model") if isinstance(config, dict) else None
    decoder = model.get("decoder") if isinstance(model, dict) else None
    if not isinstance(decoder, dict):
        raise GenaiConfigError(f"{config_path} has no model.decoder section")
    filename = decoder.get("filename")
    if not isinstance(filename, str) or not filename:
        raise GenaiConfigError(f"{config_path}: model.decoder.filename is missing")
    if "\0" in filename:
        raise GenaiConfigError(f"{config_path}: decoder filename {filename!r} holds a NUL character")
    model_file = folder / filename
    if not model_file.resolve().is_relative_to(folder.resolve()):
        raise GenaiConfigError(f"{config_path}: decoder filename {filename!r} lies outside the folder")
    if not model_file.is_file():
        raise GenaiConfigError(f"{config_path} names the decoder model {filename}, which does not exist in {folder}")
    options = decoder.get("session_options", {})
    if not isinstance(options, dict):
        raise GenaiConfigError(f"{config_path}: model.decoder.session_options must be an object, not "
                               f"{type(options).__name__}")
    library = options.get("custom_ops_library")
    if library is not None and not (isinstance(library, str) and library and "\0" not in library):
        raise GenaiConfigError(f"{config_path}: session_options.custom_ops_library must be a file name, not "
                               f"{json.dumps(library)[:40]}")
    where = f"{config_path}: model.decoder"
    head_size = _positive_int(decoder, "head_size", where)
    kv_heads = _positive_int(decoder, "num_key_value_heads", where) or _positive_int(decoder, "num_attention_heads",
                                                                                      where)
    layers = _positive_int(decoder, "num_hidden_layers", where)
    for key, value in (("head_size", head_size), ("num_key_value_heads", kv_heads), ("num_hidden_layers", layers)):
        if value is None:
            raise GenaiConfigError(f"{where} lacks a usable '{key}' entry")
    context = model.get("context_length")
    return GenaiDecoder(folder, config_path, config, model_file, head_size, kv_heads, layers,
                        context if isinstance(context, int) and not isinstance(context, bool) and context > 0 else None)


def context_length(path: str | os.PathLike) -> int | None:
    """The longest sequence of the model at ``path`` (a file or folder), when its onnxruntime-genai
    config says (``context_length``); None otherwise."""
    folder = genai_folder(path)
    if folder is None:
        return None
    try:
        return genai_decoder(folder).context_length
    except GenaiConfigError:
        return None


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """The KV cache of a decoder graph: past inputs and the present outputs that follow them (same
    order), K/V heads and head size, element type, and the other decoder inputs / outputs."""

    past: tuple[str, ...]
    present: tuple[str, ...]
    kv_heads: int
    head_dim: int
    dtype: Any
    logits: str
    has_position_ids: bool
    max_positions: int | None = None  # the model's longest sequence when it has one (genai config)
    # Per past input: 0 (the buffer grows with the sequence) or the rows of a window-sized buffer
    # (a sliding-window layer's GroupQueryAttention with sliding_window_cache=1); empty: all grow.
    capacity: tuple[int, ...] = ()

    def rows(self, index: int) -> int:
        return self.capacity[index] if self.capacity else 0

    def empty(self, batch: int = 1) -> list[np.ndarray]:
        """The K/V of a new sequence: no rows for growing buffers, zeroed window-sized ones (their
        GroupQueryAttention refuses a buffer smaller than its window)."""
        return [np.zeros((batch, self.kv_heads, self.rows(i), self.head_dim), self.dtype)
                for i in range(len(self.past))]

    def bytes_per_position(self) -> int:
        """Bytes the cache adds per token position (every growing layer's K and V; window-sized
        buffers do not grow)."""
        growing = sum(1 for i in range(len(self.past)) if not self.rows(i))
        return growing * self.kv_heads * self.head_dim * np.dtype(self.dtype).itemsize


_NUMPY_FLOATS = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


def _graph_head_size(model: Any, past_name: str) -> int | None:
    """Head size of the attention node that consumes ``past_name``, from the graph: the linear
    layer after it reads ``num_heads * head_size`` inputs (its weight's K, or MatMulNBits' K)."""
    graph = load_proto(model).graph
    dims = {init.name: list(init.dims) for init in graph.initializer}
    for node in graph.node:
        if past_name not in node.input:
            continue
        heads = next((a.i for a in node.attribute if a.name == "num_heads"), 0)
        if heads <= 0:
            continue
        for consumer in graph.node:
            if not consumer.input or consumer.input[0] != node.output[0]:
                continue
            k = next((a.i for a in consumer.attribute if a.name == "K"), 0)
            if not k and len(consumer.input) > 1 and len(dims.get(consumer.input[1], [])) == 2:
                k = dims[consumer.input[1]][0]
            if k and k % heads == 0:
                return k // heads
    return None


# onnxruntime-genai's CPU default of sliding_window.cache_slack: a window-sized buffer holds the window
# plus these rows, so its GroupQueryAttention compacts once every slack + 1 decode steps.
GENAI_CPU_WINDOW_SLACK = 16


def window_capacities(model: Any, slack: int = GENAI_CPU_WINDOW_SLACK) -> dict[str, int]:
    """Past K/V inputs of window-sized buffers -> the rows to give them: for each
    ``com.microsoft.GroupQueryAttention`` with ``sliding_window_cache=1``, its ``local_window_size``
    plus ``slack``, as onnxruntime-genai's Generator sizes them on CPU (any size >= the window gives
    the same attention)."""
    capacities = {}
    for node in load_proto(model).graph.node:
        attributes = {a.name: a for a in node.attribute}
        if node.op_type not in ("GroupQueryAttention", "PopcountGroupQueryAttention") or \
                "sliding_window_cache" not in attributes or attributes["sliding_window_cache"].i != 1:
            continue
        window = attributes["local_window_size"].i if "local_window_size" in attributes else -1
        for name in node.input[3:5]:
            if name and window > 0:
                capacities[name] = window + max(0, slack)
    return capacities


def _genai_window_slack(genai: GenaiDecoder | None) -> int:
    window = genai.config["model"]["decoder"].get("sliding_window") if genai is not None else None
    slack = window.get("cache_slack", 0) if isinstance(window, dict) else 0
    return int(slack) if isinstance(slack, int) and slack > 0 else GENAI_CPU_WINDOW_SLACK


def kv_layout(session: Any, model: Any = None) -> KVLayout | None:
    """The KV layout of a decoder session (None when it has no ``past_key_values.*`` inputs).
    Heads and head size come from the past inputs' shapes; a symbolic head size (onnxruntime-genai
    declares ``kv_cache_dim``) from ``model``: the ``genai_config.json`` of its folder when it is a
    path there, else the graph (:func:`_graph_head_size`). Raises ValueError when neither tells."""
    past = past_inputs(session)
    if not past:
        return None
    outputs = [o.name for o in session.get_outputs()]
    present = []
    for spec in past:
        wanted = spec.name.replace("past_key_values.", "present.", 1)
        if wanted not in outputs:
            raise ValueError(f"decoder input {spec.name!r} has no matching output {wanted!r}")
        present.append(wanted)
    spec = past[0]
    shape = list(spec.shape)
    if len(shape) != 4:
        raise ValueError(f"KV input {spec.name!r} has shape {shape}; expected [batch, heads, past, head size]")
    heads, head_dim = shape[1], shape[3]
    folder = genai_folder(model) if isinstance(model, (str, os.PathLike)) else None
    genai = genai_decoder(folder) if folder is not None else None
    if not isinstance(head_dim, int):
        head_dim = genai.head_size if genai is not None else (_graph_head_size(model, spec.name) if model is not None
                                                                 else None)
    if not isinstance(heads, int) and genai is not None:
        heads = genai.kv_heads
    if not isinstance(heads, int) or not isinstance(head_dim, int):
        raise ValueError(f"KV input {spec.name!r} has symbolic dims {shape} and nothing tells their size "
                         "(give the model's path inside its genai folder, or a graph with numeric K/V dims)")
    inputs = {i.name for i in session.get_inputs()}
    logits = "logits" if "logits" in outputs else outputs[0]
    capacities: dict[str, int] = {}
    # Window-sized buffers: onnxruntime-genai's builder names their length *_sliding_*; the graph
    # says which inputs and how large.
    if (genai is not None and genai.config["model"]["decoder"].get("sliding_window")) or \
            any("sliding" in str(dim) for i in past for dim in i.shape):
        if model is None:
            raise ValueError(f"KV input {spec.name!r}: window-sized KV buffers need the model (path or proto) to "
                             "tell their size")
        source = genai.model_file if genai is not None and Path(os.fspath(model)).is_dir() else model
        capacities = window_capacities(source, _genai_window_slack(genai))
    return KVLayout(tuple(i.name for i in past), tuple(present), int(heads), int(head_dim),
                    _NUMPY_FLOATS.get(spec.type, np.float32), logits, "position_ids" in inputs,
                    genai.context_length if genai is not None else None,
                    tuple(capacities.get(i.name, 0) for i in past) if capacities else ())


class KVDecoder:
    """Runs a KV-cache decoder session step by step: :meth:`advance` feeds new tokens after the
    cache and returns the last token's logits. The present K/V stay ONNX Runtime values bound as
    the next step's past (IOBinding), so the cache is never copied into or out of numpy; only the
    ids, the mask and the last logits cross."""

    def __init__(self, session: Any, layout: KVLayout):
        self.session = session
        self.layout = layout
        types = {i.name: i.type for i in session.get_inputs()}
        self._ids_type = _NUMPY_INTS.get(types.get("input_ids"), np.int64)
        self._mask_type = _NUMPY_INTS.get(types.get("attention_mask"), np.int64)
        self._position_type = _NUMPY_INTS.get(types.get("position_ids"), np.int64)
        self._cpu = ort.OrtDevice.make("cpu", 0)._get_c_device()
        self._outputs = (layout.logits, *layout.present)
        self.reset()

    def reset(self) -> None:
        """Forget the cache (the next :meth:`advance` is a prefill from position 0)."""
        self.position = 0
        # The first past values wrap these arrays' memory (no copy): they must stay referenced while
        # bound (window-sized buffers are non-empty; a freed array let onnxruntime place a present
        # output over it, and the op read freed memory as its past).
        self._empty = self.layout.empty()
        self.past = [ort.OrtValue.ortvalue_from_numpy(a)._ortvalue for a in self._empty]

    def advance(self, ids: Any) -> np.ndarray:
        """Feed ``ids`` (1-D) at the next positions; returns the logits after the last one ([vocab])."""
        ids = np.asarray(ids).reshape(1, -1).astype(self._ids_type)
        count = ids.shape[1]
        # A fresh binding per step: outputs bound to the CPU device get ORT-allocated values of this
        # step's shapes (a reused binding would treat the last step's outputs as preallocated). The
        # values are bound through the binding's C object (onnxruntime's Python wrapper adds ~10 us
        # of checks per value, 60 K/V values a step).
        binding = self.session.io_binding()
        native = binding._iobinding  # noqa: SLF001
        # The bound inputs wrap these arrays' memory: they stay referenced until the Run is done.
        mask = np.ones((1, self.position + count), self._mask_type)
        positions = np.arange(self.position, self.position + count, dtype=self._position_type)[None, :]
        native.bind_input("input_ids", ids)
        native.bind_input("attention_mask", mask)
        if self.layout.has_position_ids:
            native.bind_input("position_ids", positions)
        for name, value in zip(self.layout.past, self.past):
            native.bind_ortvalue_input(name, value)
        for name in self._outputs:
            native.bind_output(name, self._cpu)
        self.session.run_with_iobinding(binding)
        outputs = native.get_outputs()
        self.past = [outputs[i] for i in range(1, len(outputs))]
        self.position += count
        logits = outputs[0].numpy()
        return np.array(logits.reshape(-1, logits.shape[-1])[-1], dtype=np.float32)
