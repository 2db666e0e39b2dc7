"""Small ONNX graphs with com.microsoft.MatMulNBits layers, built with onnx.helper (no torch), that
onnxruntime runs: one-layer models for the rules and their near-misses, and decoder graphs shaped
like onnxruntime-genai's (SimplifiedLayerNormalization, a fused qkv projection into
GroupQueryAttention's packed query, SkipSimplifiedLayerNormalization between the blocks, SwiGLU
MLP, lm_head; an int4 graph whose embedding reads the lm_head's quantized weight through
GatherBlockQuantized). Weights are quantized with onnxruntime's own block quantizer."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from tiny_graphs import GraphBuilder  # a sibling module (tests/graph_rewrite is on sys.path, not a package)

MS = "com.microsoft"
D_MODEL, HEADS, KV_HEADS, HEAD_DIM, D_FF, VOCAB, MAX_POS = 64, 4, 2, 16, 128, 96, 64
QKV = (HEADS + 2 * KV_HEADS) * HEAD_DIM
# (class, role) of each linear layer of genai_like(), in graph order.
GENAI_LAYER = [("attn", "qkv"), ("attn", "out"), ("mlp", "up"), ("mlp", "up"), ("mlp", "down")]


def genai_expected(n_layers: int) -> list[tuple[str, str]]:
    return GENAI_LAYER * n_layers + [("head", "head")]


def quantize(w: np.ndarray, bits: int, block: int, zero_points: bool):
    """(B, scales, zero points or None) of W [K, N], as onnxruntime's quantizer makes them."""
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, DefaultWeightOnlyQuantizer

    config = DefaultWeightOnlyQuantConfig(block_size=block, is_symmetric=not zero_points, bits=bits)
    b, scales, zp = DefaultWeightOnlyQuantizer(config).qbits_block_quant(np.ascontiguousarray(w, np.float32))
    return b, scales, (zp if zero_points else None)


class Builder(GraphBuilder):
    """tiny_graphs' builder with MatMulNBits / MatMul layers; models in onnxruntime-genai's opsets."""

    def nbits(self, x: str, k: int, n: int, prefix: str, bits: int, block: int, zero_points: bool,
              accuracy_level: int, scale: float = 0.15) -> str:
        """A MatMulNBits layer with its weight quantized from a random float matrix."""
        w = self.rng.standard_normal((k, n)).astype(np.float32) * scale
        b, scales, zp = quantize(w, bits, block, zero_points)
        inputs = [x, self.const(f"{prefix}.weight_Q{bits}", b), self.const(f"{prefix}.weight_scales", scales)]
        if zp is not None:
            inputs.append(self.const(f"{prefix}.weight_zero_points", zp))
        return self.op("MatMulNBits", inputs, name=f"/{prefix}/MatMul_Q{bits}", domain=MS, K=k, N=n, bits=bits,
                       block_size=block, accuracy_level=accuracy_level)

    def matmul(self, x: str, k: int, n: int, prefix: str, scale: float = 0.15) -> str:
        w = self.const(f"{prefix}.weight", self.rng.standard_normal((k, n)).astype(np.float32) * scale)
        return self.op("MatMul", [x, w], name=f"/{prefix}/MatMul")

    def model(self, inputs, outputs, opset: int = 21) -> onnx.ModelProto:
        # No checker here: com.microsoft ops (MatMulNBits) are not in the ONNX checker's schemas.
        graph = helper.make_graph(self.nodes, "nbits", inputs, outputs, self.initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(MS, 1)],
                                  producer_name="ortsparse-tests")
        model.ir_version = 10
        return model


def x_input(k: int, name: str = "X") -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", "sequence", k])


def y_output(n: int, name: str = "Y") -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", "sequence", n])


def nbits_model(k: int = 96, n: int = 40, bits: int = 8, block: int = 32, zero_points: bool = False,
                accuracy_level: int = 0, bias: str | None = None, seed: int = 0, **tamper) -> onnx.ModelProto:
    """Y = MatMulNBits(X, B, scales, zp?) — ``bias``: None, "input" (MatMulNBits' own bias
    input), "add" (an Add after it), "both". ``tamper`` builds a near-miss: g_idx=True,
    b_as_input=True, scales_as_input=True, float_zero_points=True, bits_attr=..., block_attr=...,
    b_shape=(...)."""
    bld = Builder(seed)
    w = bld.rng.standard_normal((k, n)).astype(np.float32) * 0.2
    b, scales, zp = quantize(w, bits, block, zero_points)
    if "b_shape" in tamper:
        b = b.reshape(tamper["b_shape"])
    inputs = [x_input(k)]
    names = ["X", "B", "scales", "", "", ""]
    if tamper.get("b_as_input"):
        inputs.append(helper.make_tensor_value_info("B", TensorProto.UINT8, list(b.shape)))
    else:
        bld.const("B", b)
    if tamper.get("scales_as_input"):
        inputs.append(helper.make_tensor_value_info("scales", TensorProto.FLOAT, list(scales.shape)))
    else:
        bld.const("scales", scales)
    if zp is not None:
        names[3] = bld.const("zero_points", zp)
    if tamper.get("float_zero_points"):
        names[3] = bld.const("zero_points", np.full(scales.shape, 2.0 ** (bits - 1), np.float32))
    if tamper.get("g_idx"):
        names[4] = bld.const("g_idx", (np.arange(k) // block).astype(np.int32))
    bias_vector = (bld.rng.standard_normal(n) * 0.1).astype(np.float32)
    if bias in ("input", "both"):
        names[5] = bld.const("bias", bias_vector)
    while names[-1] == "":
        names.pop()
    y = bld.op("MatMulNBits", names, name="/layer/MatMul_Q", domain=MS, K=k, N=n, bits=tamper.get("bits_attr", bits),
               block_size=tamper.get("block_attr", block), accuracy_level=accuracy_level)
    if bias in ("add", "both"):
        y = bld.op("Add", [y, bld.const("add_bias", bias_vector[None, :])], name="/layer/Add")
    bld.nodes[-1].output[0] = "Y"
    return bld.model(inputs, [y_output(n)])


def genai_like(n_layers: int = 2, bits: int | None = 8, block: int = 32, zero_points: bool = False,
               accuracy_level: int = 0, seed: int = 0, shared_embedding: bool = False) -> onnx.ModelProto:
    """A decoder graph as onnxruntime-genai's builder writes it (``bits`` None: float32 MatMul
    layers, as its fp32 models). ``shared_embedding`` (int4, no zero points): the embedding is a
    GatherBlockQuantized of the lm_head's quantized weight, as in genai int4 graphs."""
    bld = Builder(seed)

    def linear(x, k, n, prefix, scale=0.15):
        if bits is None:
            return bld.matmul(x, k, n, prefix, scale)
        return bld.nbits(x, k, n, prefix, bits, block, zero_points, accuracy_level, scale)

    def weight(name, size):
        return bld.const(name, (1 + 0.1 * bld.rng.standard_normal(size)).astype(np.float32))

    mask = "attention_mask"
    one = bld.const("/model/constants/INT64/[1]", np.array([1], np.int64))
    summed = bld.op("ReduceSum", [mask, one], name="/model/attn_mask_reformat/ReduceSum", keepdims=0)
    seqlens = bld.op("Cast", [bld.op("Sub", [summed, one], name="/model/attn_mask_reformat/Sub")], to=TensorProto.INT32)
    index = bld.const("/model/constants/INT64/1", np.array(1, np.int64))
    total = bld.op("Cast", [bld.op("Gather", [bld.op("Shape", [mask]), index], axis=0)], to=TensorProto.INT32)
    inv = 1.0 / (10000 ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM))
    angles = np.arange(MAX_POS)[:, None] * inv[None, :]
    cos = bld.const("cos_cache", np.cos(angles).astype(np.float32))
    sin = bld.const("sin_cache", np.sin(angles).astype(np.float32))

    def skip_norm(residual, x, weight_name, name, last=False):
        """SkipSimplifiedLayerNormalization: (normed, residual + x); the sum is not kept after the
        last block."""
        normed, _, _, summed = bld.op("SkipSimplifiedLayerNormalization", [residual, x, weight(weight_name, D_MODEL)],
                                      name=name, outputs=4, domain=MS, epsilon=1e-5)
        node = bld.nodes[-1]
        node.output[1] = node.output[2] = ""
        if last:
            node.output[3] = ""
        return normed, summed

    if shared_embedding:
        assert bits == 4 and not zero_points
        head_w = bld.rng.standard_normal((D_MODEL, VOCAB)).astype(np.float32) * 0.15
        b, scales, _ = quantize(head_w, 4, block, False)
        head_b = bld.const("lm_head.MatMul.weight_Q4", b)
        head_scales = bld.const("lm_head.MatMul.weight_scales", scales)
        table = bld.op("Reshape", [head_b, bld.const("embed_shape", np.array([VOCAB, D_MODEL // 2], np.int64))],
                       name="/model/embed_tokens/Reshape")
        h = bld.op("GatherBlockQuantized", [table, "input_ids", head_scales], name="/model/embed_tokens/Gather",
                   domain=MS, bits=4, block_size=block, gather_axis=0, quantize_axis=1)
    else:
        embed = bld.const("model.embed_tokens.weight", bld.rng.standard_normal((VOCAB, D_MODEL)).astype(np.float32))
        h = bld.op("Gather", [embed, "input_ids"], name="/model/embed_tokens/Gather", axis=0)
    normed = bld.op("SimplifiedLayerNormalization", [h, weight("model.layers.0.input_layernorm.weight", D_MODEL)],
                    name="/model/layers.0/input_layernorm/LayerNorm", axis=-1, epsilon=1e-5, stash_type=1)
    residual = h
    outputs = []
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"]),
              helper.make_tensor_value_info(mask, TensorProto.INT64, ["batch", "total"])]
    for i in range(n_layers):
        p = f"model.layers.{i}"
        past = [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
        inputs += [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", KV_HEADS, "past", HEAD_DIM])
                   for name in past]
        qkv = linear(normed, D_MODEL, QKV, f"{p}.attn.qkv_proj")
        attn, _, _ = bld.op(
            "GroupQueryAttention", [qkv, "", "", *past, seqlens, total, cos, sin], name=f"/model/layers.{i}/attn/GQA",
            outputs=3, domain=MS, num_heads=HEADS, kv_num_heads=KV_HEADS, do_rotary=1, scale=HEAD_DIM ** -0.5)
        bld.nodes[-1].output[1], bld.nodes[-1].output[2] = f"present.{i}.key", f"present.{i}.value"
        outputs += [helper.make_tensor_value_info(f"present.{i}.{kind}", TensorProto.FLOAT,
                                                  ["batch", KV_HEADS, "total", HEAD_DIM]) for kind in ("key", "value")]
        o = linear(attn, D_MODEL, D_MODEL, f"{p}.attn.o_proj")
        normed, residual = skip_norm(residual, o, f"{p}.post_attention_layernorm.weight",
                                     f"/model/layers.{i}/post_attention_layernorm/SkipLayerNorm")
        gate = linear(normed, D_MODEL, D_FF, f"{p}.mlp.gate_proj")
        up = linear(normed, D_MODEL, D_FF, f"{p}.mlp.up_proj")
        act = bld.op("Mul", [gate, bld.op("Sigmoid", [gate], name=f"/model/layers.{i}/mlp/act_fn/Sigmoid")],
                     name=f"/model/layers.{i}/mlp/act_fn/Mul")
        down = linear(bld.op("Mul", [act, up], name=f"/model/layers.{i}/mlp/Mul"), D_FF, D_MODEL, f"{p}.mlp.down_proj",
                      scale=0.1)
        last = i == n_layers - 1
        norm = "model.layers.final_norm_layernorm.weight" if last else f"model.layers.{i + 1}.input_layernorm.weight"
        normed, residual = skip_norm(residual, down, norm, f"/model/layers.{i + 1}/input_layernorm/SkipLayerNorm",
                                     last=last)
    if shared_embedding:
        bld.op("MatMulNBits", [normed, "lm_head.MatMul.weight_Q4", "lm_head.MatMul.weight_scales"],
               name="/lm_head/MatMul_Q4", domain=MS, K=D_MODEL, N=VOCAB, bits=4, block_size=block,
               accuracy_level=accuracy_level)
    else:
        linear(normed, D_MODEL, VOCAB, "lm_head")
    bld.nodes[-1].output[0] = "logits"  # the head's output, renamed as genai graphs name it
    outputs.insert(0, helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "sequence", VOCAB]))
    return bld.model(inputs, outputs)


def genai_feeds(model: onnx.ModelProto, batch: int = 1, seq: int = 1, seed: int = 0) -> dict[str, np.ndarray]:
    """A prompt of ``seq`` tokens with an empty past (what a first generation step feeds)."""
    rng = np.random.default_rng(seed)
    feeds = {"input_ids": rng.integers(0, VOCAB, (batch, seq)).astype(np.int64),
             "attention_mask": np.ones((batch, seq), np.int64)}
    for graph_input in model.graph.input:
        if graph_input.name.startswith("past_key_values"):
            feeds[graph_input.name] = np.zeros((batch, KV_HEADS, 0, HEAD_DIM), np.float32)
    return feeds


def with_accuracy_level(model: onnx.ModelProto, level: int) -> onnx.ModelProto:
    """A copy whose MatMulNBits nodes all have ``accuracy_level`` = level."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for node in copy.graph.node:
        if node.op_type == "MatMulNBits":
            for attribute in node.attribute:
                if attribute.name == "accuracy_level":
                    attribute.i = level
    return copy
