"""One-node GroupQueryAttention graphs — onnxruntime's com.microsoft op or ortsparse's
PopcountGroupQueryAttention with the same inputs — and a runner that binds past/present K/V the
way onnxruntime-genai does (one buffer for both) or as separate tensors."""
from __future__ import annotations

import dataclasses

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

import ortsparse

MS = "com.microsoft"
OURS = "ai.ortsparse"
OP = "PopcountGroupQueryAttention"


@dataclasses.dataclass(frozen=True)
class Gqa:
    """The shape of one GroupQueryAttention node."""

    num_heads: int = 4
    kv_num_heads: int = 2
    head_size: int = 16
    packed: bool = False
    rotary: bool = False
    interleaved: bool = False
    rotary_dim: int | None = None  # None: head_size
    local_window: int = -1
    softcap: float = 0.0
    scale: float | None = None
    past: bool = True  # past_key / past_value inputs wired
    extra: tuple[str, ...] = ()  # later optional inputs wired: position_ids, attention_bias, head_sink

    @property
    def hidden(self) -> int:
        return self.num_heads * self.head_size

    @property
    def kv_hidden(self) -> int:
        return self.kv_num_heads * self.head_size

    @property
    def half(self) -> int:
        return (self.rotary_dim or self.head_size) // 2


def model(cfg: Gqa, *, ours: bool, node_name: str = "gqa", free: bool = False, **attrs) -> bytes:
    """The one-node model; ``attrs``: extra attributes (ours: the selection ones). ``free``: graph
    inputs of any shape (bad-input tests feed shapes the node must refuse itself)."""
    inputs = ["query", "" if cfg.packed else "key", "" if cfg.packed else "value",
              "past_key" if cfg.past else "", "past_value" if cfg.past else "", "seqlens_k", "total_sequence_length",
              "cos_cache" if cfg.rotary else "", "sin_cache" if cfg.rotary else ""]
    inputs += [name if name in cfg.extra else "" for name in ("position_ids", "attention_bias", "head_sink")]
    while inputs[-1] == "":
        inputs.pop()
    node_attrs = dict(num_heads=cfg.num_heads, kv_num_heads=cfg.kv_num_heads, local_window_size=cfg.local_window,
                      do_rotary=int(cfg.rotary), rotary_interleaved=int(cfg.interleaved), softcap=float(cfg.softcap))
    if cfg.scale is not None:
        node_attrs["scale"] = float(cfg.scale)
    node_attrs.update(attrs)
    node = helper.make_node(OP if ours else "GroupQueryAttention", inputs, ["output", "present_key", "present_value"],
                            name=node_name, domain=OURS if ours else MS, **node_attrs)
    f, i32 = TensorProto.FLOAT, TensorProto.INT32
    width = cfg.hidden + 2 * cfg.kv_hidden if cfg.packed else cfg.hidden
    graph_inputs = [helper.make_tensor_value_info("query", f, ["b", "s", width])]
    if not cfg.packed:
        graph_inputs += [helper.make_tensor_value_info(n, f, ["b", "s", cfg.kv_hidden]) for n in ("key", "value")]
    if cfg.past:
        graph_inputs += [helper.make_tensor_value_info(n, f, ["b", cfg.kv_num_heads, "p", cfg.head_size])
                         for n in ("past_key", "past_value")]
    graph_inputs += [helper.make_tensor_value_info("seqlens_k", i32, ["b"]),
                     helper.make_tensor_value_info("total_sequence_length", i32, [1])]
    if cfg.rotary:
        graph_inputs += [helper.make_tensor_value_info(n, f, ["r", cfg.half]) for n in ("cos_cache", "sin_cache")]
    if "position_ids" in cfg.extra:
        graph_inputs.append(helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["b", "s"]))
    if "attention_bias" in cfg.extra:
        graph_inputs.append(helper.make_tensor_value_info("attention_bias", f, ["bb", "hb", "s", "t"]))
    if "head_sink" in cfg.extra:
        graph_inputs.append(helper.make_tensor_value_info("head_sink", f, [cfg.num_heads]))
    outputs = [helper.make_tensor_value_info("output", f, ["b", "s", cfg.hidden]),
               helper.make_tensor_value_info("present_key", f, ["b", cfg.kv_num_heads, "t", cfg.head_size]),
               helper.make_tensor_value_info("present_value", f, ["b", cfg.kv_num_heads, "t", cfg.head_size])]
    if free:
        for value in graph_inputs:
            value.type.tensor_type.ClearField("shape")
    graph = helper.make_graph([node], "gqa", graph_inputs, outputs)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(MS, 1), helper.make_opsetid(OURS, 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=9).SerializeToString()


def session(cfg: Gqa, *, ours: bool, threads: int = 1, free: bool = False, node_name: str = "gqa",
            **attrs) -> ort.InferenceSession:
    options = ortsparse.session_options() if ours else ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return ort.InferenceSession(model(cfg, ours=ours, free=free, node_name=node_name, **attrs), options,
                                providers=["CPUExecutionProvider"])


def rotary_tables(rng: np.random.Generator, positions: int, half: int) -> tuple[np.ndarray, np.ndarray]:
    angle = rng.random((positions, half), dtype=np.float32) * np.float32(2 * np.pi)
    return np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)


class Stepper:
    """Runs one session through a sequence of calls, keeping K/V state as an app does: ``shared``:
    one [B, Hkv, buffer, D] buffer bound as past and present (only new rows written); otherwise the
    present tensors of a call are the next call's past."""

    def __init__(self, sess: ort.InferenceSession, cfg: Gqa, *, batch: int, buffer: int, shared: bool,
                 cos: np.ndarray | None = None, sin: np.ndarray | None = None,
                 past_k: np.ndarray | None = None, past_v: np.ndarray | None = None):
        self.sess, self.cfg, self.shared, self.cos, self.sin = sess, cfg, shared, cos, sin
        shape = (batch, cfg.kv_num_heads, buffer if shared else 0, cfg.head_size)
        self.k = np.zeros(shape, np.float32) if past_k is None else np.ascontiguousarray(past_k, dtype=np.float32)
        self.v = np.zeros(shape, np.float32) if past_v is None else np.ascontiguousarray(past_v, dtype=np.float32)

    def step(self, query, key, value, seqlens_k, total, **extra) -> np.ndarray:
        """One call; ``extra``: feeds of the later optional inputs (position_ids, ...)."""
        feeds = {"query": query, "seqlens_k": np.asarray(seqlens_k, np.int32),
                 "total_sequence_length": np.asarray([total], np.int32), **extra}
        if key is not None:
            feeds["key"], feeds["value"] = key, value
        if self.cfg.rotary:
            feeds["cos_cache"], feeds["sin_cache"] = self.cos, self.sin
        if not self.cfg.past:
            out, self.k, self.v = self.sess.run(None, feeds)
            return out
        if not self.shared:
            feeds["past_key"], feeds["past_value"] = self.k, self.v
            out, self.k, self.v = self.sess.run(None, feeds)
            return out
        binding = self.sess.io_binding()
        for name, value_ in feeds.items():
            binding.bind_cpu_input(name, np.ascontiguousarray(value_))
        k_value = ort.OrtValue.ortvalue_from_numpy(self.k)
        v_value = ort.OrtValue.ortvalue_from_numpy(self.v)
        binding.bind_ortvalue_input("past_key", k_value)
        binding.bind_ortvalue_input("past_value", v_value)
        binding.bind_output("output")  # first: copy_outputs_to_cpu() lists outputs in binding order
        binding.bind_ortvalue_output("present_key", k_value)
        binding.bind_ortvalue_output("present_value", v_value)
        self.sess.run_with_iobinding(binding)
        return binding.copy_outputs_to_cpu()[0]
