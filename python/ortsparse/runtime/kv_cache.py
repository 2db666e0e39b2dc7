"""KV-cache decoders: :func:`kv_layout` (past/present names, heads, head size — a symbolic head size,
as onnxruntime-genai's graphs declare it, is read from the folder's ``genai_config.json`` or from the
graph; window-sized buffers of sliding-window layers, GroupQueryAttention's ``sliding_window_cache=1``,
from the graph) and :class:`KVDecoder`, which advances a decoder session step by step with the present
K/V kept as ONNX Runtime values (IOBinding: the cache is never copied through numpy)."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from .model_files import load_proto
from .genai_config import GenaiDecoder, genai_folder, genai_decoder


NUMPY_INTS = {"tensor(int64)": np.int64, "tensor(int32)": np.int32}


def past_inputs(session: Any) -> list:
    """The KV-cache inputs (``past_key_values.*``) of a decoder session, in graph order."""
    return [i for i in session.get_inputs() if i.name.startswith("past_key_values.")]


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
        self._ids_type = NUMPY_INTS.get(types.get("input_ids"), np.int64)
        self._mask_type = NUMPY_INTS.get(types.get("attention_mask"), np.int64)
        self._position_type = NUMPY_INTS.get(types.get("position_ids"), np.int64)
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

    def advance(self, ids: Any, every: bool = False) -> np.ndarray:
        """Feed ``ids`` (1-D) at the next positions; returns the logits after the last one ([vocab]),
        or with ``every`` those after each of them ([len(ids), vocab]: a teacher-forced chunk)."""
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
        rows = logits.reshape(-1, logits.shape[-1])
        return np.array(rows if every else rows[-1], dtype=np.float32)
