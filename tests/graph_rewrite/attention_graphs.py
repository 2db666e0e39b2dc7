"""One-core attention models built with onnx.helper, one per form the attention rules take (and
the near-misses they decline). Q/K/V and masks are graph inputs, so tests feed random tensors and
compare the rewritten model with the original in onnxruntime."""
from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

B, H, HKV, S, D = 2, 4, 2, 6, 8
OPSET = 17
MS = "com.microsoft"


class _G:
    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.n = 0

    def const(self, array, dtype=None) -> str:
        self.n += 1
        name = f"c{self.n}"
        self.inits.append(numpy_helper.from_array(np.asarray(array, dtype=dtype), name))
        return name

    def op(self, op_type: str, inputs, outputs: int = 1, domain: str = "", **attrs):
        self.n += 1
        outs = [f"{op_type.lower()}_{self.n}_{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=f"/attn/{op_type}_{self.n}",
                                           domain=domain, **attrs))
        return outs[0] if outputs == 1 else outs

    def input(self, name: str, elem, shape) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem, shape))
        return name

    def model(self, out: str, out_shape, opset: int = OPSET, ms: bool = False) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, "attention", self.inputs,
                                  [helper.make_tensor_value_info(out, TensorProto.FLOAT, out_shape)], self.inits)
        opsets = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(MS, 1)] if ms else [])
        model = helper.make_model(graph, opset_imports=opsets, producer_name="ortsparse-tests")
        model.ir_version = 8 if opset < 21 else 10
        onnx.checker.check_model(model, full_check=True)
        return model


def eager_core(k_form: str = "t0132", scale: str = "div", masks: tuple[str, ...] = (), tail: str = "none",
               gqa: bool = False, mask_before_scale: bool = False, dynamic_scale: bool = False,
               softmax_axis: int = -1) -> onnx.ModelProto:
    """``MatMul(Softmax(MatMul(Q, K^T) * scale + masks), V)`` with inputs Q [B,H,S,D], K and V.

    k_form: ``t0132`` (K [B,H,S,D] -> Transpose [0,1,3,2]), ``t0231`` (K [B,S,H,D] -> Transpose
    [0,2,3,1], GPT-2 style), ``rtr`` (Reshape-Transpose-Reshape). scale: ``div`` (/ sqrt(D)),
    ``mul`` (* 1/sqrt(D)), ``split`` (Q and K^T each * D^-1/4), ``none``. masks: ``add`` (float input
    ``add_mask`` [B,1,S,S]), ``bool`` (Where(bool input ``keep`` [B,1,1,S], scores, -1e4)),
    ``inf`` (float input ``add_mask``, meant to hold -inf). tail: ``none``, ``cast``, ``nanguard``.
    gqa: K/V inputs have HKV heads and are repeated by Unsqueeze-Expand-Reshape."""
    g = _G()
    q = g.input("Q", TensorProto.FLOAT, ["batch", H, "seq", D])
    kv_heads = HKV if gqa else H
    k_shape = ["batch", "seq", kv_heads, D] if k_form == "t0231" else ["batch", kv_heads, "seq", D]
    k = g.input("K", TensorProto.FLOAT, k_shape if k_form != "rtr" else [B, kv_heads, S, D])
    v = g.input("V", TensorProto.FLOAT, ["batch", kv_heads, "seq", D] if k_form != "rtr" else [B, kv_heads, S, D])
    if gqa:
        def repeat(x):
            expanded = g.op("Expand", [g.op("Unsqueeze", [x, g.const([2], np.int64)]),
                                       g.const([B, HKV, H // HKV, S, D], np.int64)])
            return g.op("Reshape", [expanded, g.const([B, H, S, D], np.int64)])
        k, v = repeat(k), repeat(v)
    if k_form == "t0132":
        k_t = g.op("Transpose", [k], perm=[0, 1, 3, 2])
    elif k_form == "t0231":
        k_t = g.op("Transpose", [k], perm=[0, 2, 3, 1])
    else:
        flat = g.op("Reshape", [k, g.const([-1, S, D], np.int64)])
        k_t = g.op("Reshape", [g.op("Transpose", [flat], perm=[0, 2, 1]), g.const([B, H, D, S], np.int64)])
    if scale == "split":
        quarter = g.const(D ** -0.25, np.float32)
        q, k_t = g.op("Mul", [q, quarter]), g.op("Mul", [k_t, quarter])
    scores = g.op("MatMul", [q, k_t])

    def apply_masks(x):
        for kind in masks:
            if kind in ("add", "inf"):
                x = g.op("Add", [x, g.input("add_mask", TensorProto.FLOAT, ["batch", 1, "seq", "seq"])])
            elif kind == "bool":
                keep = g.input("keep", TensorProto.BOOL, ["batch", 1, 1, "seq"])
                x = g.op("Where", [keep, x, g.const(-1e4, np.float32)])
        return x

    if mask_before_scale:
        scores = apply_masks(scores)
    if dynamic_scale:
        d = g.op("Cast", [g.op("Gather", [g.op("Shape", [q]), g.const(3, np.int64)], axis=0)], to=TensorProto.FLOAT)
        scores = g.op("Div", [scores, g.op("Sqrt", [d])])
    elif scale == "div":
        scores = g.op("Div", [scores, g.const(math.sqrt(D), np.float32)])
    elif scale == "mul":
        scores = g.op("Mul", [g.const(1 / math.sqrt(D), np.float32), scores])
    if not mask_before_scale:
        scores = apply_masks(scores)
    probs = g.op("Softmax", [scores], axis=softmax_axis)
    if tail == "cast":
        probs = g.op("Cast", [g.op("Cast", [probs], to=TensorProto.FLOAT)], to=TensorProto.FLOAT)
    elif tail == "nanguard":
        probs = g.op("Where", [g.op("IsNaN", [probs]), g.const(0.0, np.float32), probs])
    out = g.op("MatMul", [probs, v])
    return g.model(out, ["batch", H, "seq", D] if k_form != "rtr" else [B, H, S, D])


def onnx_attention(mask: str | None = "bool", is_causal: int = 0, gqa: bool = False, softcap: float = 0.0,
                   scale: float | None = None, k_len: str = "seq") -> onnx.ModelProto:
    """ONNX opset-23 ``Attention`` on 4-D inputs; GQA natively (K/V with HKV heads)."""
    g = _G()
    kv = HKV if gqa else H
    q = g.input("Q", TensorProto.FLOAT, ["batch", H, "seq", D])
    k = g.input("K", TensorProto.FLOAT, ["batch", kv, k_len, D])
    v = g.input("V", TensorProto.FLOAT, ["batch", kv, k_len, D])
    inputs = [q, k, v]
    if mask == "bool":
        inputs.append(g.input("keep", TensorProto.BOOL, ["batch", 1, "seq", k_len]))  # ORT needs dim -2 == Sq
    elif mask == "add":
        inputs.append(g.input("add_mask", TensorProto.FLOAT, ["batch", 1, "seq", k_len]))
    attrs = {"is_causal": is_causal}
    if softcap:
        attrs["softcap"] = softcap
    if scale is not None:
        attrs["scale"] = scale
    out = g.op("Attention", inputs, **attrs)
    return g.model(out, ["batch", H, "seq", D], opset=23)


def ms_attention(mask: str | None = "2d", unidirectional: int = 0, seed: int = 0) -> onnx.ModelProto:
    """com.microsoft ``Attention`` (packed QKV weights inside the op) on X [B, S, H*D]."""
    rng = np.random.default_rng(seed)
    g = _G()
    hidden = H * D
    x = g.input("X", TensorProto.FLOAT, ["batch", "seq", hidden])
    w = g.const((rng.standard_normal((hidden, 3 * hidden)) / math.sqrt(hidden)).astype(np.float32))
    b = g.const((0.1 * rng.standard_normal(3 * hidden)).astype(np.float32))
    inputs = [x, w, b]
    if mask == "2d":
        inputs.append(g.input("mask_index", TensorProto.INT32, ["batch", "seq"]))
    elif mask == "1d":
        inputs.append(g.input("mask_index", TensorProto.INT32, ["batch"]))
    out = g.op("Attention", inputs, domain=MS, num_heads=H, unidirectional=unidirectional)
    return g.model(out, ["batch", "seq", hidden], ms=True)


def ms_mha(key_padding: bool = True, bias: bool = True, seed: int = 1) -> onnx.ModelProto:
    """com.microsoft ``MultiHeadAttention`` on 3-D query/key/value [B, S, H*D]."""
    rng = np.random.default_rng(seed)
    g = _G()
    hidden = H * D
    q = g.input("Qp", TensorProto.FLOAT, ["batch", "seq", hidden])
    k = g.input("Kp", TensorProto.FLOAT, ["batch", "seq", hidden])
    v = g.input("Vp", TensorProto.FLOAT, ["batch", "seq", hidden])
    inputs = [q, k, v, g.const((0.1 * rng.standard_normal(3 * hidden)).astype(np.float32)) if bias else ""]
    if key_padding:
        inputs.append(g.input("key_padding_mask", TensorProto.INT32, ["batch", "seq"]))
    out = g.op("MultiHeadAttention", inputs, domain=MS, num_heads=H)
    return g.model(out, ["batch", "seq", hidden], ms=True)


def feeds(model: onnx.ModelProto, seed: int = 0, pad: int = 2) -> dict[str, np.ndarray]:
    """Random Q/K/V; masks that hide the last ``pad`` keys of batch row 1 (padding) — plus a causal
    triangle in ``add_mask`` — so masked scores must stay masked after the rewrite."""
    rng = np.random.default_rng(seed)
    result = {}
    names = {i.name: i for i in model.graph.input}
    for name, info in names.items():
        dims = [d.dim_value or {"batch": B, "seq": S}.get(d.dim_param, S) for d in info.type.tensor_type.shape.dim]
        elem = info.type.tensor_type.elem_type
        if name == "keep":
            keep = np.ones(dims, bool)
            keep[1, ..., S - pad:] = False
            result[name] = keep
        elif name == "add_mask":
            causal = np.where(np.tril(np.ones((S, S), bool)), 0.0, -np.inf).astype(np.float32)
            mask = np.broadcast_to(causal, dims).copy()
            mask[1, ..., S - pad:] = -np.inf
            result[name] = mask
        elif name in ("mask_index", "key_padding_mask"):
            if len(dims) == 1:
                result[name] = np.array([S, S - pad], np.int32)
            else:
                m = np.ones(dims, np.int32)
                m[1, S - pad:] = 0
                result[name] = m
        elif elem == TensorProto.FLOAT:
            result[name] = rng.standard_normal(dims).astype(np.float32)
    return result


def bmm_core() -> onnx.ModelProto:
    """3-D attention over [B*H, S, D] (``torch.bmm`` style), with no shapes on the inner values."""
    g = _G()
    q = g.input("Q", TensorProto.FLOAT, ["bh", "seq", D])
    k = g.input("K", TensorProto.FLOAT, ["bh", "seq", D])
    v = g.input("V", TensorProto.FLOAT, ["bh", "seq", D])
    scores = g.op("Mul", [g.op("MatMul", [g.op("Identity", [q]), g.op("Transpose", [k], perm=[0, 2, 1])]),
                          g.const(1 / math.sqrt(D), np.float32)])
    out = g.op("MatMul", [g.op("Softmax", [scores], axis=-1), v])
    return g.model(out, ["bh", "seq", D])
