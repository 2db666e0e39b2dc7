"""Tiny ONNX models built with onnx.helper and fixed-seed random weights (no torch).

They mimic what exporters produce: GPT-2 (Conv1D as Reshape -> Gemm -> Reshape, tied lm_head as
MatMul(x, Transpose(wte))), BERT (MatMul + Add with the bias on either side, additive mask, erf
Gelu, optional pooler), Llama (no biases, RMSNorm, rotary, SwiGLU), plus one-layer models for the
rules' near-misses. Expected layer classes are exposed as constants for the tests.
"""
from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import TensorProto, helper

OPSET = 17
D_MODEL, HEADS, HEAD_DIM, D_FF, VOCAB, MAX_POS = 16, 2, 8, 32, 40, 32

# (class, role) of each candidate layer, in topological order, per family and layer count.
GPT2_LAYER = [("attn", "qkv"), ("attn", "out"), ("mlp", "up"), ("mlp", "down")]
BERT_LAYER = [("attn", "q"), ("attn", "k"), ("attn", "v"), ("attn", "out"), ("mlp", "up"), ("mlp", "down")]
LLAMA_LAYER = [("attn", "q"), ("attn", "k"), ("attn", "v"), ("attn", "out"), ("mlp", "up"), ("mlp", "up"),
               ("mlp", "down")]


def expected_classes(family: str, n_layers: int = 2, pooler: bool = False) -> list[tuple[str, str]]:
    per_layer = {"gpt2": GPT2_LAYER, "bert": BERT_LAYER, "llama": LLAMA_LAYER}[family]
    tail = {"gpt2": [("head", "head")], "bert": [("other", "other")] if pooler else [],
            "llama": [("head", "head")]}[family]
    return per_layer * n_layers + tail


class GraphBuilder:
    """Collects nodes and initializers; ``op`` returns output names."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._count = 0

    def const(self, name: str, array) -> str:
        self.initializers.append(onnx.numpy_helper.from_array(np.asarray(array), name))
        return name

    def weight(self, name: str, shape, scale: float | None = None, dtype=np.float32) -> str:
        scale = scale if scale is not None else 1.0 / math.sqrt(shape[0])
        return self.const(name, (self.rng.standard_normal(shape) * scale).astype(dtype))

    def scalar(self, value: float) -> str:
        self._count += 1
        return self.const(f"scalar_{self._count}", np.array(value, dtype=np.float32))

    def ints(self, *values: int) -> str:
        self._count += 1
        return self.const(f"ints_{self._count}", np.array(values, dtype=np.int64))

    def op(self, op_type: str, inputs, name: str | None = None, outputs: int = 1, domain: str = "",
           **attrs):
        self._count += 1
        name = name or f"/{op_type}_{self._count}"
        outs = [f"{name}_out{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=name, domain=domain, **attrs))
        return outs[0] if outputs == 1 else outs

    def model(self, inputs, outputs, opset: int = OPSET, extra_opsets=()) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, "tiny", inputs, outputs, self.initializers)
        opsets = [helper.make_opsetid("", opset), *(helper.make_opsetid(d, v) for d, v in extra_opsets)]
        model = helper.make_model(graph, opset_imports=opsets, producer_name="ortsparse-tests")
        model.ir_version = 8
        onnx.checker.check_model(model, full_check=True)
        return model

    # -- pieces shared by the families -------------------------------------------------------

    def layer_norm(self, x: str, prefix: str) -> str:
        gamma = self.const(f"{prefix}.weight", (1 + 0.1 * self.rng.standard_normal(D_MODEL)).astype(np.float32))
        beta = self.const(f"{prefix}.bias", (0.1 * self.rng.standard_normal(D_MODEL)).astype(np.float32))
        return self.op("LayerNormalization", [x, gamma, beta], name=f"/{prefix}/LayerNorm", axis=-1, epsilon=1e-5)

    def rms_norm(self, x: str, prefix: str) -> str:
        gamma = self.const(f"{prefix}.weight", (1 + 0.1 * self.rng.standard_normal(D_MODEL)).astype(np.float32))
        var = self.op("ReduceMean", [self.op("Pow", [x, self.scalar(2.0)])], axes=[-1], keepdims=1)
        inv = self.op("Reciprocal", [self.op("Sqrt", [self.op("Add", [var, self.scalar(1e-6)])])])
        return self.op("Mul", [self.op("Mul", [x, inv]), gamma], name=f"/{prefix}/Mul")

    def seq_len(self, ids: str) -> str:
        """[1] int64 holding S (dim 1 of the token input)."""
        self._count += 1
        index = self.const(f"index_{self._count}", np.array(1, np.int64))
        s = self.op("Gather", [self.op("Shape", [ids]), index], axis=0)
        return self.op("Unsqueeze", [s, self.ints(0)])

    def causal(self, scores: str, ids: str) -> str:
        tril = np.tril(np.ones((MAX_POS, MAX_POS), dtype=bool))[None, None]
        bias = "causal_bias" if any(i.name == "causal_bias" for i in self.initializers) else self.const("causal_bias", tril)
        s1 = self.seq_len(ids)
        mask = self.op("Slice", [bias, self.ints(0, 0), self.op("Concat", [s1, s1], axis=0), self.ints(2, 3)])
        return self.op("Where", [mask, scores, self.scalar(-1e4)])

    def split_heads(self, x: str, key: bool = False) -> str:
        shaped = self.op("Reshape", [x, self.ints(0, 0, HEADS, HEAD_DIM)])
        return self.op("Transpose", [shaped], perm=[0, 2, 3, 1] if key else [0, 2, 1, 3])

    def merge_heads(self, ctx: str) -> str:
        return self.op("Reshape", [self.op("Transpose", [ctx], perm=[0, 2, 1, 3]), self.ints(0, 0, D_MODEL)])

    def attention_core(self, q: str, k_t: str, v: str, mask_fn) -> str:
        scores = self.op("Div", [self.op("MatMul", [q, k_t]), self.scalar(math.sqrt(HEAD_DIM))])
        probs = self.op("Softmax", [mask_fn(scores)], axis=-1)
        return self.op("MatMul", [probs, v])


def _token_input(name: str = "input_ids") -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.INT64, ["batch", "sequence"])


def _logits() -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "sequence", VOCAB])


def gpt2_like(n_layers: int = 2, seed: int = 0) -> onnx.ModelProto:
    b = GraphBuilder(seed)
    wte = b.weight("transformer.wte.weight", (VOCAB, D_MODEL), scale=0.5)
    wpe = b.weight("transformer.wpe.weight", (MAX_POS, D_MODEL), scale=0.1)
    positions = b.op("Range", [b.const("zero", np.array(0, np.int64)),
                               b.op("Squeeze", [b.seq_len("input_ids"), b.ints(0)]),
                               b.const("step", np.array(1, np.int64))])
    h = b.op("Add", [b.op("Gather", [wte, "input_ids"], axis=0), b.op("Gather", [wpe, positions], axis=0)])

    def conv1d(x: str, k: int, n: int, prefix: str) -> str:
        lead = b.op("Slice", [b.op("Shape", [x]), b.ints(0), b.ints(-1)])
        w = b.weight(f"{prefix}.weight", (k, n))
        bias = b.weight(f"{prefix}.bias", (n,), scale=0.1)
        y = b.op("Gemm", [b.op("Reshape", [x, b.ints(-1, k)]), w, bias], name=f"/{prefix}/Gemm")
        return b.op("Reshape", [y, b.op("Concat", [lead, b.ints(n)], axis=0)])

    for i in range(n_layers):
        p = f"transformer.h.{i}"
        qkv = conv1d(b.layer_norm(h, f"{p}.ln_1"), D_MODEL, 3 * D_MODEL, f"{p}.attn.c_attn")
        q, k, v = b.op("Split", [qkv, b.ints(D_MODEL, D_MODEL, D_MODEL)], outputs=3, axis=-1)
        ctx = b.attention_core(b.split_heads(q), b.split_heads(k, key=True), b.split_heads(v),
                               lambda s: b.causal(s, "input_ids"))
        h = b.op("Add", [h, conv1d(b.merge_heads(ctx), D_MODEL, D_MODEL, f"{p}.attn.c_proj")])
        x = conv1d(b.layer_norm(h, f"{p}.ln_2"), D_MODEL, D_FF, f"{p}.mlp.c_fc")
        inner = b.op("Add", [x, b.op("Mul", [b.op("Pow", [x, b.scalar(3.0)]), b.scalar(0.044715)])])
        tanh = b.op("Tanh", [b.op("Mul", [inner, b.scalar(math.sqrt(2 / math.pi))])])
        gelu = b.op("Mul", [b.op("Mul", [x, b.scalar(0.5)]), b.op("Add", [tanh, b.scalar(1.0)])])
        h = b.op("Add", [h, conv1d(gelu, D_FF, D_MODEL, f"{p}.mlp.c_proj")])
    h = b.layer_norm(h, "transformer.ln_f")
    b.op("MatMul", [h, b.op("Transpose", [wte], perm=[1, 0], name="/lm_head/Transpose")], name="/lm_head/MatMul")
    b.nodes[-1].output[0] = "logits"
    return b.model([_token_input()], [_logits()])


def bert_like(n_layers: int = 2, seed: int = 1, pooler: bool = False) -> onnx.ModelProto:
    b = GraphBuilder(seed)
    emb = b.op("Gather", [b.weight("embeddings.word_embeddings.weight", (VOCAB, D_MODEL), scale=0.5), "input_ids"], axis=0)
    h = b.layer_norm(emb, "embeddings.LayerNorm")
    mask = b.op("Cast", [b.op("Unsqueeze", ["attention_mask", b.ints(1, 2)])], to=TensorProto.FLOAT)
    ext = b.op("Mul", [b.op("Sub", [b.scalar(1.0), mask]), b.scalar(-10000.0)])

    def dense(x: str, k: int, n: int, prefix: str, bias_first: bool = False) -> str:
        mm = b.op("MatMul", [x, b.weight(f"{prefix}.weight", (k, n))], name=f"/{prefix}/MatMul")
        bias = b.weight(f"{prefix}.bias", (n,), scale=0.1)
        return b.op("Add", [bias, mm] if bias_first else [mm, bias], name=f"/{prefix}/Add")

    for i in range(n_layers):
        p = f"encoder.layer.{i}"
        q = dense(h, D_MODEL, D_MODEL, f"{p}.attention.self.query")
        k = dense(h, D_MODEL, D_MODEL, f"{p}.attention.self.key", bias_first=True)
        v = dense(h, D_MODEL, D_MODEL, f"{p}.attention.self.value")
        ctx = b.attention_core(b.split_heads(q), b.split_heads(k, key=True), b.split_heads(v),
                               lambda s: b.op("Add", [s, ext]))
        attn = dense(b.merge_heads(ctx), D_MODEL, D_MODEL, f"{p}.attention.output.dense")
        h = b.layer_norm(b.op("Add", [attn, h]), f"{p}.attention.output.LayerNorm")
        x = dense(h, D_MODEL, D_FF, f"{p}.intermediate.dense")
        erf = b.op("Erf", [b.op("Div", [x, b.scalar(math.sqrt(2.0))])])
        gelu = b.op("Mul", [b.op("Mul", [x, b.op("Add", [erf, b.scalar(1.0)])]), b.scalar(0.5)])
        h = b.layer_norm(b.op("Add", [dense(gelu, D_FF, D_MODEL, f"{p}.output.dense"), h]), f"{p}.output.LayerNorm")
    b.nodes[-1].output[0] = "last_hidden_state"
    outputs = [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, ["batch", "sequence", D_MODEL])]
    if pooler:
        first = b.op("Gather", ["last_hidden_state", b.const("zero", np.array(0, np.int64))], axis=1)
        b.op("Tanh", [dense(first, D_MODEL, D_MODEL, "pooler.dense")])
        b.nodes[-1].output[0] = "pooler_output"
        outputs.append(helper.make_tensor_value_info("pooler_output", TensorProto.FLOAT, ["batch", D_MODEL]))
    return b.model([_token_input(), _token_input("attention_mask")], outputs)


def llama_like(n_layers: int = 2, seed: int = 2) -> onnx.ModelProto:
    b = GraphBuilder(seed)
    h = b.op("Gather", [b.weight("model.embed_tokens.weight", (VOCAB, D_MODEL), scale=0.5), "input_ids"], axis=0)
    inv_freq = 1.0 / (10000 ** (np.arange(0, HEAD_DIM, 2, dtype=np.float32) / HEAD_DIM))
    pos = b.op("Cast", [b.op("Unsqueeze", ["position_ids", b.ints(1)])], to=TensorProto.FLOAT)
    freqs = b.op("MatMul", [b.const("inv_freq", inv_freq.reshape(1, -1, 1).astype(np.float32)), pos],
                 name="/rotary_emb/MatMul")
    freqs = b.op("Transpose", [freqs], perm=[0, 2, 1])
    emb = b.op("Concat", [freqs, freqs], axis=-1)
    cos = b.op("Unsqueeze", [b.op("Cos", [emb]), b.ints(1)])
    sin = b.op("Unsqueeze", [b.op("Sin", [emb]), b.ints(1)])

    def rotary(x: str) -> str:
        half = HEAD_DIM // 2
        x1 = b.op("Slice", [x, b.ints(0), b.ints(half), b.ints(3)])
        x2 = b.op("Slice", [x, b.ints(half), b.ints(HEAD_DIM), b.ints(3)])
        rotated = b.op("Concat", [b.op("Neg", [x2]), x1], axis=-1)
        return b.op("Add", [b.op("Mul", [x, cos]), b.op("Mul", [rotated, sin])])

    def linear(x: str, k: int, n: int, prefix: str) -> str:
        return b.op("MatMul", [x, b.weight(f"{prefix}.weight", (k, n))], name=f"/{prefix}/MatMul")

    for i in range(n_layers):
        p = f"model.layers.{i}"
        x = b.rms_norm(h, f"{p}.input_layernorm")
        q = rotary(b.split_heads(linear(x, D_MODEL, D_MODEL, f"{p}.self_attn.q_proj")))
        k = rotary(b.split_heads(linear(x, D_MODEL, D_MODEL, f"{p}.self_attn.k_proj")))
        v = b.split_heads(linear(x, D_MODEL, D_MODEL, f"{p}.self_attn.v_proj"))
        ctx = b.attention_core(q, b.op("Transpose", [k], perm=[0, 1, 3, 2]), v,
                               lambda s: b.causal(s, "input_ids"))
        h = b.op("Add", [h, linear(b.merge_heads(ctx), D_MODEL, D_MODEL, f"{p}.self_attn.o_proj")])
        x = b.rms_norm(h, f"{p}.post_attention_layernorm")
        gate = linear(x, D_MODEL, D_FF, f"{p}.mlp.gate_proj")
        up = linear(x, D_MODEL, D_FF, f"{p}.mlp.up_proj")
        act = b.op("Mul", [b.op("Mul", [gate, b.op("Sigmoid", [gate])]), up])
        h = b.op("Add", [h, linear(act, D_FF, D_MODEL, f"{p}.mlp.down_proj")])
    linear(b.rms_norm(h, "model.norm"), D_MODEL, VOCAB, "lm_head")
    b.nodes[-1].output[0] = "logits"
    return b.model([_token_input(), _token_input("position_ids")], [_logits()])


# -- one-layer models for the rules and their near-misses -------------------------------------

K_IN, N_OUT = 12, 10


def _x(dtype=TensorProto.FLOAT, rank: int = 3) -> onnx.ValueInfoProto:
    dims = ["batch", "sequence", K_IN][-rank:] if rank <= 3 else None
    return helper.make_tensor_value_info("X", dtype, dims)


def _y(dtype=TensorProto.FLOAT, rank: int = 3) -> onnx.ValueInfoProto:
    dims = ["batch", "sequence", N_OUT][-rank:] if rank <= 3 else [f"d{i}" for i in range(rank - 1)] + [N_OUT]
    return helper.make_tensor_value_info("Y", dtype, dims)


def _finish(b: GraphBuilder, inputs, rank: int = 3, dtype=TensorProto.FLOAT) -> onnx.ModelProto:
    b.nodes[-1].output[0] = "Y"
    return b.model(inputs, [_y(dtype, rank)])


def matmul_model(seed: int = 3, weight_dtype=np.float32, weight_as_graph_input: bool = False,
                 initializer_also_input: bool = False, bias: str | None = None,
                 bias_shape: tuple[int, ...] | None = None, weight_via_cast: bool = False) -> onnx.ModelProto:
    """Y = X @ W (+ b). ``bias``: None, "after" (Add(mm, b)) or "before" (Add(b, mm)).
    ``weight_via_cast``: W = Cast(W16) computed from an fp16 initializer at run time."""
    b = GraphBuilder(seed)
    x_type = TensorProto.FLOAT16 if weight_dtype == np.float16 else TensorProto.FLOAT
    inputs = [_x(x_type)]
    if weight_as_graph_input:
        inputs.append(helper.make_tensor_value_info("W", TensorProto.FLOAT, [K_IN, N_OUT]))
        w = "W"
    elif weight_via_cast:
        w = b.op("Cast", [b.weight("W16", (K_IN, N_OUT), dtype=np.float16)], name="/layer/Cast", to=TensorProto.FLOAT)
    else:
        w = b.weight("W", (K_IN, N_OUT), dtype=weight_dtype)
        if initializer_also_input:
            inputs.append(helper.make_tensor_value_info("W", TensorProto.FLOAT, [K_IN, N_OUT]))
    mm = b.op("MatMul", ["X", w], name="/layer/MatMul")
    if bias is not None:
        bvec = b.weight("b", bias_shape or (N_OUT,), scale=0.5)
        b.op("Add", [mm, bvec] if bias == "after" else [bvec, mm], name="/layer/Add")
    return _finish(b, inputs, rank=max(3, len(bias_shape or ())), dtype=x_type)


def gemm_model(seed: int = 4, trans_b: int = 0, bias_shape: tuple[int, ...] | None = (N_OUT,),
               alpha: float = 1.0, beta: float = 1.0, trans_a: int = 0) -> onnx.ModelProto:
    """Y = Gemm(X [M, K], W, C) on a 2-D input."""
    b = GraphBuilder(seed)
    w = b.weight("W", (N_OUT, K_IN) if trans_b else (K_IN, N_OUT))
    inputs = ["X", w] + ([b.weight("C", bias_shape, scale=0.5)] if bias_shape is not None else [])
    x_dims = [K_IN, "rows"] if trans_a else ["rows", K_IN]
    b.op("Gemm", inputs, name="/layer/Gemm", transB=trans_b, alpha=alpha, beta=beta, transA=trans_a)
    b.nodes[-1].output[0] = "Y"
    return b.model([helper.make_tensor_value_info("X", TensorProto.FLOAT, x_dims)],
                   [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["rows", N_OUT])])


def shared_weight_model(seed: int = 5) -> onnx.ModelProto:
    """Two MatMuls share W [K, K]; two Gemm(transB=1) share V [K, K]: Y = g2(g1(m2(m1(X))))."""
    b = GraphBuilder(seed)
    w = b.weight("W", (K_IN, K_IN))
    v = b.weight("V", (K_IN, K_IN))
    x = b.op("Reshape", ["X", b.ints(-1, K_IN)])
    x = b.op("MatMul", [b.op("MatMul", [x, w], name="/m1/MatMul"), w], name="/m2/MatMul")
    x = b.op("Relu", [x])
    x = b.op("Gemm", [b.op("Gemm", [x, v], name="/g1/Gemm", transB=1), v], name="/g2/Gemm", transB=1)
    b.nodes[-1].output[0] = "Y"
    return b.model([_x(rank=2)], [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["sequence", K_IN])])


BERT_FUSED_CLASSES = [("attn", "out"), ("mlp", "up"), ("mlp", "down"),
                      ("attn", "q"), ("attn", "k"), ("attn", "v"), ("attn", "out"), ("mlp", "up"), ("mlp", "down")]


def bert_fused_like(seed: int = 6) -> onnx.ModelProto:
    """BERT after onnxruntime's transformer fusions: layer 0 with com.microsoft Attention (packed
    QKV weights inside the op) and BiasGelu, layer 1 with q/k/v MatMul+Add into MultiHeadAttention
    and FastGelu; residuals in SkipLayerNormalization with the projection bias folded in."""
    ms = "com.microsoft"
    b = GraphBuilder(seed)
    emb = b.op("Gather", [b.weight("embeddings.word_embeddings.weight", (VOCAB, D_MODEL), scale=0.5), "input_ids"], axis=0)
    h = b.layer_norm(emb, "embeddings.LayerNorm")

    def gamma_beta(prefix: str) -> list[str]:
        return [b.const(f"{prefix}.weight", (1 + 0.1 * b.rng.standard_normal(D_MODEL)).astype(np.float32)),
                b.weight(f"{prefix}.bias", (D_MODEL,), scale=0.1)]

    def skip_ln(x: str, skip: str, bias: str, prefix: str) -> str:
        return b.op("SkipLayerNormalization", [x, skip, *gamma_beta(prefix), bias], name=f"/{prefix}/SkipLN",
                    domain=ms, epsilon=1e-5)

    def mlp(x: str, prefix: str, gelu: str) -> str:
        up = b.op("MatMul", [x, b.weight(f"{prefix}.intermediate.dense.weight", (D_MODEL, D_FF))],
                  name=f"/{prefix}.intermediate.dense/MatMul")
        act = b.op(gelu, [up, b.weight(f"{prefix}.intermediate.dense.bias", (D_FF,), scale=0.1)], domain=ms)
        down = b.op("MatMul", [act, b.weight(f"{prefix}.output.dense.weight", (D_FF, D_MODEL))],
                    name=f"/{prefix}.output.dense/MatMul")
        return skip_ln(down, x, b.weight(f"{prefix}.output.dense.bias", (D_MODEL,), scale=0.1), f"{prefix}.output.LayerNorm")

    p = "encoder.layer.0"
    ctx = b.op("Attention", [h, b.weight(f"{p}.attention.qkv.weight", (D_MODEL, 3 * D_MODEL)),
                             b.weight(f"{p}.attention.qkv.bias", (3 * D_MODEL,), scale=0.1)],
               name=f"/{p}/Attention", domain=ms, num_heads=HEADS)
    out = b.op("MatMul", [ctx, b.weight(f"{p}.attention.output.dense.weight", (D_MODEL, D_MODEL))],
               name=f"/{p}.attention.output.dense/MatMul")
    h = skip_ln(out, h, b.weight(f"{p}.attention.output.dense.bias", (D_MODEL,), scale=0.1), f"{p}.attention.output.LayerNorm")
    h = mlp(h, p, "BiasGelu")

    p = "encoder.layer.1"
    qkv = []
    for part in ("query", "key", "value"):
        mm = b.op("MatMul", [h, b.weight(f"{p}.attention.self.{part}.weight", (D_MODEL, D_MODEL))],
                  name=f"/{p}.attention.self.{part}/MatMul")
        qkv.append(b.op("Add", [mm, b.weight(f"{p}.attention.self.{part}.bias", (D_MODEL,), scale=0.1)]))
    ctx = b.op("MultiHeadAttention", qkv, name=f"/{p}/MultiHeadAttention", domain=ms, num_heads=HEADS)
    out = b.op("MatMul", [ctx, b.weight(f"{p}.attention.output.dense.weight", (D_MODEL, D_MODEL))],
               name=f"/{p}.attention.output.dense/MatMul")
    h = skip_ln(out, h, b.weight(f"{p}.attention.output.dense.bias", (D_MODEL,), scale=0.1), f"{p}.attention.output.LayerNorm")
    mlp(h, p, "FastGelu")
    b.nodes[-1].output[0] = "last_hidden_state"
    outputs = [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, ["batch", "sequence", D_MODEL])]
    return b.model([_token_input()], outputs, extra_opsets=[(ms, 1)])
