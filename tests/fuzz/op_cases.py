"""Random one-node models for each ortsparse op: mostly plausible, often invalid (attributes out of
range or of the wrong type, list-valued or non-finite, weights of the wrong rank/dtype/shape or not
constant, inputs of the wrong shape, empty tensors and zero dims, NaN/Inf, extreme TT modes). Each
generator takes a numpy Generator and returns a :class:`Case`: the model and its feeds, plus what
the op must do with it — refuse it (``must_refuse``: e.g. a list where the op takes one float), or,
when the settings are exact (KWTA k_frac = 1, PopcountAttention select = none, ...), match the
numpy reference of tests/ops or, for PopcountGroupQueryAttention, onnxruntime's GroupQueryAttention
(``reference``; NaN/Inf inputs included for the attention ops). ``tags`` name the families a case belongs to."""
from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
from onnx import ModelProto, TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the ops' numpy references


@dataclasses.dataclass
class Case:
    op_type: str
    node_name: str
    model: ModelProto
    feeds: dict
    # () -> (expected output, magnitude): |y - expected| must be <= tolerance * magnitude elementwise
    # (magnitude: the sum of |terms| behind each output, so the bound scales with float rounding).
    reference: Callable[[], tuple[np.ndarray, np.ndarray]] | None = None
    tolerance: float = 1e-4
    must_refuse: str | None = None
    tags: frozenset[str] = frozenset()

DOMAIN = "ai.ortsparse"
FLOAT_DTYPES = [np.float32] * 12 + [np.float64, np.float16, np.int32, np.int64]
ONNX_TYPES = {np.float32: TensorProto.FLOAT, np.float64: TensorProto.DOUBLE, np.float16: TensorProto.FLOAT16,
              np.int32: TensorProto.INT32, np.int64: TensorProto.INT64, np.bool_: TensorProto.BOOL,
              np.uint16: TensorProto.UINT16}


def pick(rng: np.random.Generator, options):
    return options[int(rng.integers(len(options)))]


def small_dim(rng, typical: int) -> int:
    """Mostly in [1, typical], sometimes 0, sometimes a bit larger."""
    roll = rng.random()
    if roll < 0.05:
        return 0
    if roll < 0.15:
        return int(rng.integers(typical, 3 * typical + 2))
    return int(rng.integers(1, typical + 1))


def values(rng, shape, dtype=np.float32, special: float = 0.05) -> np.ndarray:
    """Normal values, some exact zeros / repeated values, and a few NaN/Inf when special > 0."""
    shape = tuple(int(s) for s in shape)
    if np.dtype(dtype).kind in "iu":
        return rng.integers(-5, 6, size=shape).astype(dtype)
    if np.dtype(dtype).kind == "b":
        return rng.random(size=shape) < 0.5
    array = rng.standard_normal(shape).astype(np.float64)
    if array.size and rng.random() < 0.3:
        array[rng.random(shape) < rng.random()] = 0.0
    if array.size and rng.random() < 0.1:
        array[...] = pick(rng, [0.0, 1.0, -2.5])
    if array.size and rng.random() < special:
        flat = array.reshape(-1)
        for _ in range(int(rng.integers(1, 4))):
            flat[int(rng.integers(flat.size))] = pick(rng, [np.nan, np.inf, -np.inf])
    return array.astype(dtype)


# Probability that one field of the current case is made invalid: half of the cases are fully
# valid (so the run paths get exercised too), the rest carry a few invalid fields.
_invalid_rate = 0.0
_tags: set[str] = set()
_must_refuse: list[str] = []


def start_case(rng) -> None:
    global _invalid_rate
    _invalid_rate = 0.0 if rng.random() < 0.5 else 0.15
    _tags.clear()
    _must_refuse.clear()


def fully_valid() -> bool:
    """No field of this case was made invalid (references apply only to such cases)."""
    return _invalid_rate == 0.0 and not _must_refuse


def broken(rng) -> bool:
    return rng.random() < _invalid_rate


def attr_value(rng, valid, invalid):
    """A valid value, or in a broken case sometimes an invalid one (out of range or another type)."""
    return pick(rng, invalid) if broken(rng) else valid


def make_model(op_type: str, node_name: str, node_inputs, graph_inputs, initializers, attrs, n_outputs=1):
    node = helper.make_node(op_type, node_inputs, [f"Y{i}" for i in range(n_outputs)], domain=DOMAIN,
                            name=node_name, **{k: v for k, v in attrs.items() if v is not None})
    outputs = [helper.make_tensor_value_info(f"Y{i}", TensorProto.FLOAT, None) for i in range(n_outputs)]
    graph = helper.make_graph([node], "fuzz", graph_inputs, outputs, initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)],
                             ir_version=9)


def weight_input(rng, name: str, array: np.ndarray, graph_inputs, initializers, feeds, node_inputs):
    """Usually a constant initializer; sometimes a graph input (not constant: must be refused)."""
    if broken(rng) and rng.random() < 0.3:
        graph_inputs.append(helper.make_tensor_value_info(name, ONNX_TYPES[array.dtype.type], list(array.shape)))
        feeds[name] = array
    else:
        initializers.append(numpy_helper.from_array(array, name))
    node_inputs.append(name)


def matmul_operands(rng, k: int, n: int, graph_inputs, initializers, feeds, node_inputs,
                    weight_shape=None, with_bias=True):
    """X [..., K] (sometimes a wrong K or dtype), W [K, N] (sometimes another rank/dtype), B? [N]."""
    rank = int(rng.integers(1, 5))
    lead = [small_dim(rng, 3) for _ in range(rank - 1)]
    x_k = int(rng.integers(0, k + 3)) if broken(rng) else k
    x = values(rng, lead + [x_k], np.float64 if broken(rng) and rng.random() < 0.2 else np.float32)
    graph_inputs.append(helper.make_tensor_value_info("X", ONNX_TYPES[x.dtype.type], ["d%d" % i for i in range(rank)]))
    feeds["X"] = x
    node_inputs.append("X")
    if weight_shape is not None:
        shape = weight_shape
        if broken(rng):
            shape = pick(rng, [[k], [k, n, 1], [n, k], [k + 1, n]])
        dtype = pick(rng, FLOAT_DTYPES) if broken(rng) else np.float32
        weight_input(rng, "W", values(rng, shape, dtype, 0.02), graph_inputs, initializers, feeds, node_inputs)
    if with_bias and rng.random() < 0.5:
        b_shape = pick(rng, [[n + 1], [1, n], [], [max(n - 1, 0)]]) if broken(rng) else [n]
        dtype = pick(rng, FLOAT_DTYPES) if broken(rng) else np.float32
        weight_input(rng, "B", values(rng, b_shape, dtype, 0.02), graph_inputs, initializers, feeds, node_inputs)
    return x


def kwta_gate_attributes(rng, k: int, prefix: str = "") -> dict:
    return {
        f"{prefix}k_frac": attr_value(rng, float(rng.uniform(0.01, 1.0)), [0.0, -0.5, 1.5, float("nan"), 1]),
        f"{prefix}k_abs": attr_value(rng, int(rng.integers(0, k + 2)) if rng.random() < 0.2 else None, [-3, 2**40]),
        f"{prefix}score": attr_value(rng, pick(rng, ["l2", "mean_abs", "l2_weighted"]), ["L2", "", "max"]),
        f"{prefix}threshold": attr_value(rng, float(rng.uniform(0, 2)) if rng.random() < 0.2 else None,
                                         [-1.0, float("nan"), float("inf")]),
        f"{prefix}temp": attr_value(rng, float(rng.uniform(0.1, 3)) if rng.random() < 0.2 else None,
                                    [0.0, -1.0, float("nan")]),
        f"{prefix}duty": attr_value(rng, int(rng.integers(1, 4)) if rng.random() < 0.3 else None, [0, -2]),
        f"{prefix}duty_mode": attr_value(rng, pick(rng, ["dense", "hold"]) if rng.random() < 0.4 else None,
                                         ["Hold", "sometimes"]),
        f"{prefix}renorm": attr_value(rng, int(rng.integers(0, 2)) if rng.random() < 0.3 else None, [2, -1]),
        f"{prefix}max_gated_rows": attr_value(rng, int(rng.integers(0, 4)) if rng.random() < 0.2 else None, [-1]),
    }


def kwta_block_matmul(rng):
    start_case(rng)
    k, n = small_dim(rng, 96), small_dim(rng, 80)
    graph_inputs, initializers, feeds, node_inputs = [], [], {}, []
    matmul_operands(rng, k, n, graph_inputs, initializers, feeds, node_inputs, weight_shape=[k, n])
    attrs = kwta_gate_attributes(rng, k)
    attrs["block"] = attr_value(rng, int(rng.integers(1, max(k, 1) + 1)) if rng.random() < 0.7 else None,
                                [0, -1, k + 1, 2**40, 1.5])
    if rng.random() < 0.25:  # the state-pack bitmap gate
        attrs["pack_mode"] = attr_value(rng, pick(rng, ["none", "binary", "ternary"]), ["Binary", ""])
        attrs["pack_eps"] = attr_value(rng, pick(rng, [0.0, 0.5, 1e-4]), [-1.0, float("nan")])
        attrs["pack_density_max"] = attr_value(rng, pick(rng, [0.15, 1.0, 0.5]), [0.0, 2.0, float("nan")])
    if rng.random() < 0.3:  # exact settings: every block kept, so Y = X @ W + B
        attrs.update(k_frac=1.0, k_abs=None, threshold=None)
    mutate_attributes(rng, "KwtaBlockMatMul", attrs)
    if k == 0 or n == 0:
        _tags.add("zero_dim")
    name = f"kwta_{int(rng.integers(1000))}"
    model = make_model("KwtaBlockMatMul", name, node_inputs, graph_inputs, initializers, attrs)
    exact = (attrs.get("k_frac") == 1.0 and not attrs.get("k_abs") and not attrs.get("threshold")
             and (attrs.get("pack_mode") in (None, "none") or not attrs.get("pack_eps")))
    return finish("KwtaBlockMatMul", name, model, feeds, dense_reference(model, feeds) if exact else None)


# Calls of at least this many query rows are prompts, computed exactly (the ops' prefill_rows default;
# the generators leave the attribute unset).
PREFILL_ROWS = 16


def popcount_attention(rng):
    start_case(rng)
    b, hkv, sq, skv, d = small_dim(rng, 2), max(1, small_dim(rng, 3)), small_dim(rng, 4), small_dim(rng, 40), \
        small_dim(rng, 70)
    if rng.random() < 0.15:  # a prompt: the tiled path
        sq = int(rng.integers(PREFILL_ROWS, 3 * PREFILL_ROWS))
    if rng.random() < 0.05:
        d = 0  # head dim 0: every q.k is 0
    h = hkv * int(rng.integers(1, 4)) + (1 if broken(rng) else 0)
    dv = small_dim(rng, 20)
    shapes = {"Q": [b, h, sq, d], "K": [b, hkv, skv, d], "V": [b, hkv, skv, dv]}
    if broken(rng):
        name = pick(rng, ["Q", "K", "V"])
        shapes[name] = pick(rng, [shapes[name][:3], shapes[name] + [1], [x + 1 for x in shapes[name]]])
    graph_inputs, feeds, node_inputs = [], {}, []
    for name in ("Q", "K", "V"):
        dtype = pick(rng, FLOAT_DTYPES) if broken(rng) else np.float32
        feeds[name] = values(rng, shapes[name], dtype, special=0.15 if name == "Q" else 0.05)
        graph_inputs.append(helper.make_tensor_value_info(name, ONNX_TYPES[feeds[name].dtype.type], None))
        node_inputs.append(name)
    if rng.random() < 0.5:
        full = [b, h, sq, skv]
        rank = int(rng.integers(1, 5))
        shape = [pick(rng, [1, dim]) for dim in full[4 - rank:]]
        if broken(rng):
            shape = pick(rng, [shape + [2], [x + 2 for x in shape], []])
        dtype = pick(rng, [np.bool_, np.float32, np.float32] + ([np.int64, np.float64] if broken(rng) else []))
        feeds["attn_mask"] = np.asarray(values(rng, shape, dtype, special=0.15))
        graph_inputs.append(helper.make_tensor_value_info("attn_mask", ONNX_TYPES[feeds["attn_mask"].dtype.type], None))
        node_inputs.append("attn_mask")
    attrs = {
        "select": attr_value(rng, pick(rng, ["popcount", "energy", "none", None]), ["Popcount", ""]),
        "mode": attr_value(rng, pick(rng, ["sign", "binary", "ternary", None]), ["quad"]),
        "topk": attr_value(rng, pick(rng, [0, 1, 4, 16, None]), [-1, 2**40]),
        "min_keys": attr_value(rng, pick(rng, [0, 0, 8, None]), [-5]),
        "eps": attr_value(rng, pick(rng, [0.0, 0.5, None]), [-1.0, float("nan")]),
        "density_max": attr_value(rng, pick(rng, [1.0, 0.15, None]), [0.0, 1.5]),
        "candidates": attr_value(rng, pick(rng, [1.0, 2.5, None]), [0.5, float("inf")]),
        "keep_first": attr_value(rng, pick(rng, [0, 2, None]), [-1]),
        "keep_recent": attr_value(rng, pick(rng, [0, 3, None]), [-1]),
        "is_causal": attr_value(rng, pick(rng, [0, 1, None]), [2, -1]),
        "scale": attr_value(rng, pick(rng, [0.0, 0.3, None]), [-1.0, float("nan")]),
        "pack_cache": attr_value(rng, pick(rng, [0, 1, None]), [2]),
        "center": attr_value(rng, pick(rng, [0, 1, None]), [2, -1]),
        "proj_bits": attr_value(rng, pick(rng, [0, 0, 7, 64, 256, None]), [-1, 2**40]),
    }
    if attrs["select"] == "energy" and attrs["topk"] == 0 and not broken(rng):
        attrs["topk"] = 4
    if rng.random() < 0.2:  # exact settings
        attrs["select"] = "none"
    mutate_attributes(rng, "PopcountAttention", attrs)
    _tags.update(tag for tag, present in [("attn_d0", d == 0), ("proj_bits", bool(attrs.get("proj_bits"))),
                                          ("center0", attrs.get("center") == 0), ("zero_dim", 0 in (b, sq, skv, dv))]
                 if present)
    name = f"attn_{int(rng.integers(1000))}"
    model = make_model("PopcountAttention", name, node_inputs, graph_inputs, [], attrs)
    reference = attention_reference(feeds, attrs) if fully_valid() and _attention_is_exact(attrs, skv, sq) else None
    _tag_nonfinite(feeds)
    # The reference defines NaN/Inf (tests/ops/attention_reference.py, as onnxruntime): kept with them.
    return finish("PopcountAttention", name, model, feeds, reference, nonfinite_ok=True)


def _tag_nonfinite(feeds: dict) -> None:
    if any(a.dtype.kind == "f" and a.size and not np.isfinite(a).all() for a in feeds.values()):
        _tags.add("nonfinite_input")


GQA_OP = "PopcountGroupQueryAttention"
GQA_INPUTS = ("query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length", "cos_cache",
              "sin_cache", "position_ids", "attention_bias", "head_sink")


def popcount_group_query_attention(rng):
    """The GroupQueryAttention form: first prompts (short ones, and long ones of at least
    prefill_rows rows: the tiled path), decode steps and later prompt chunks (separate past / present
    tensors), NaN/Inf often in query, attention_bias and head_sink (sometimes in K/V). Exact settings
    (and long prompts, exact whatever `select` says) are compared with onnxruntime's own
    com.microsoft.GroupQueryAttention."""
    start_case(rng)
    hkv = int(rng.integers(1, 3))
    h, d, b = hkv * int(rng.integers(1, 3)), pick(rng, [8, 16]), int(rng.integers(1, 3))
    phase = pick(rng, ["prompt", "decode", "chunk", "long_prompt"])
    if phase == "prompt":
        s, past = int(rng.integers(1, 6)), 0
    elif phase == "long_prompt":
        s, past = int(rng.integers(PREFILL_ROWS, 3 * PREFILL_ROWS)), 0
    elif phase == "decode":
        s, past = 1, int(rng.integers(1, 40))
    else:
        b, s, past = 1, int(rng.integers(2, 5)), int(rng.integers(1, 30))
    total = past + s
    shapes = {"query": [b, s, h * d], "key": [b, s, hkv * d], "value": [b, s, hkv * d],
              "past_key": [b, hkv, past, d], "past_value": [b, hkv, past, d], "attention_bias": [b, h, s, total],
              "head_sink": [h]}
    if rng.random() < 0.3:
        shapes["attention_bias"] = [1, 1, s, total]  # broadcast over batch and heads
    used = {"attention_bias": rng.random() < 0.6, "head_sink": rng.random() < 0.5}
    if broken(rng):
        name = pick(rng, ["query", "key", "past_key", "attention_bias", "head_sink"])
        shapes[name] = pick(rng, [shapes[name][:-1], [x + 1 for x in shapes[name]]])
        used[name] = True
        _must_refuse.append(f"{name} has shape {shapes[name]}")
    feeds, graph_inputs, node_inputs = {}, [], []
    for name in GQA_INPUTS:
        if name in ("cos_cache", "sin_cache", "position_ids") or not used.get(name, True):
            node_inputs.append("")
            continue
        if name == "seqlens_k":
            feeds[name] = np.full(b, total - 1, np.int32)
        elif name == "total_sequence_length":
            feeds[name] = np.array([total], np.int32)
        else:
            special = 0.3 if name in ("query", "attention_bias", "head_sink") else 0.05
            dtype = pick(rng, FLOAT_DTYPES) if broken(rng) else np.float32
            feeds[name] = values(rng, shapes[name], dtype, special=special)
            if dtype != np.float32:
                _must_refuse.append(f"{name} is {np.dtype(dtype).name}")
        graph_inputs.append(helper.make_tensor_value_info(name, ONNX_TYPES[feeds[name].dtype.type], None))
        node_inputs.append(name)
    while node_inputs[-1] == "":
        node_inputs.pop()
    gqa_attrs = {"num_heads": h, "kv_num_heads": hkv, "local_window_size": pick(rng, [-1, -1, 2, 5]),
                 "softcap": pick(rng, [0.0, 0.0, 5.0]), "smooth_softmax": pick(rng, [0, 0, 1])}
    select = pick(rng, ["none", "none", "pages", "popcount", "energy"])
    selection = {"select": select, "topk": pick(rng, [2, 4, None]), "min_keys": pick(rng, [0, 0, None]),
                 "page_size": 4 if select == "pages" else None, "keep_first": pick(rng, [0, 1, None]),
                 "keep_recent": pick(rng, [0, 2, None])}
    if select == "popcount":
        selection["candidates"] = pick(rng, [1.0, 2.0])
    name = f"gqa_{int(rng.integers(1000))}"
    model = make_model(GQA_OP, name, node_inputs, graph_inputs, [], {**gqa_attrs, **selection}, n_outputs=3)
    topk = 256 if selection["topk"] is None else selection["topk"]
    min_keys = 2048 if selection["min_keys"] is None else selection["min_keys"]
    # docs/ops.md: the call runs no selector, or is a prompt (exact whatever select says)
    exact = select == "none" or total < min_keys or total <= topk or s >= PREFILL_ROWS
    reference = gqa_reference(node_inputs, graph_inputs, feeds, gqa_attrs) if fully_valid() and exact else None
    _tag_nonfinite(feeds)
    _tags.add(f"gqa_{phase}")
    return finish(GQA_OP, name, model, feeds, reference, nonfinite_ok=True)


def gqa_score_rows(feeds: dict, attrs: dict) -> tuple[np.ndarray, np.ndarray]:
    """[B, S, H] bool each: the query rows with a NaN score among the keys they attend (causal,
    local window), and those whose attended scores are all -inf; in float64: q·k·scale, soft-cap,
    + attention_bias."""
    h, hkv = attrs["num_heads"], attrs["kv_num_heads"]
    b, s, _ = feeds["query"].shape
    d = feeds["past_key"].shape[3]
    total = int(feeds["total_sequence_length"][0])
    q = feeds["query"].astype(np.float64).reshape(b, s, h, d)
    new_k = feeds["key"].astype(np.float64).reshape(b, s, hkv, d).transpose(0, 2, 1, 3)
    k = np.repeat(np.concatenate([feeds["past_key"].astype(np.float64), new_k], axis=2), h // hkv, axis=1)
    with np.errstate(invalid="ignore", over="ignore"):
        scores = np.einsum("bshd,bhtd->bsht", q, k) * float(np.float32(1.0 / np.sqrt(d)))
        cap = attrs.get("softcap", 0.0)
        if cap > 0:
            scores = cap * np.tanh(scores / cap)
        if "attention_bias" in feeds:
            scores = scores + feeds["attention_bias"].astype(np.float64).transpose(0, 2, 1, 3)
    pos = total - s + np.arange(s)[:, None]
    key = np.arange(total)[None, :]
    attended = key <= pos
    window = attrs.get("local_window_size", -1)
    if window > 0:
        attended &= key > pos - window
    attended = np.broadcast_to(attended[None, :, None, :], scores.shape)
    nan = (np.isnan(scores) & attended).any(axis=-1)
    dead = (np.isneginf(scores) | ~attended).all(axis=-1)
    return nan, dead


def gqa_zero_weights_output(feeds: dict, attrs: dict) -> np.ndarray:
    """[B, H, Dv]: 0·V summed over every key in [0, total): 0, or NaN in a column with a NaN/Inf."""
    h, hkv = attrs["num_heads"], attrs["kv_num_heads"]
    b, s, _ = feeds["query"].shape
    d = feeds["past_value"].shape[3]
    new_v = feeds["value"].reshape(b, s, hkv, d).transpose(0, 2, 1, 3)
    v = np.concatenate([feeds["past_value"], new_v], axis=2)
    bad = ~np.isfinite(v).all(axis=2)  # [B, Hkv, D]
    return np.where(np.repeat(bad, h // hkv, axis=1), np.nan, 0.0)


def gqa_reference(node_inputs, graph_inputs, feeds: dict, attrs: dict):
    """onnxruntime's com.microsoft.GroupQueryAttention on the same inputs. |output| <= max |V|
    (a convex combination of V rows; the sink's weight only lowers it). Without a sink and smooth
    softmax, onnxruntime's plain softmax (MLAS) returns 0 for some rows holding a NaN score (where the
    NaN falls decides; its sink path gives NaN): the op gives NaN there (docs/ops.md), so those rows
    of the reference are NaN."""
    def compute():
        import onnxruntime as ort

        node_in, graph_in, run_feeds = node_inputs, graph_inputs, feeds
        node = helper.make_node("GroupQueryAttention", node_in, ["Y0", "Y1", "Y2"], domain="com.microsoft", **attrs)
        outputs = [helper.make_tensor_value_info(f"Y{i}", TensorProto.FLOAT, None) for i in range(3)]
        graph = helper.make_graph([node], "reference", graph_in, outputs)
        proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
                                  ir_version=9)
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
        expected = session.run(None, run_feeds)[0].astype(np.float64)
        b, s, _ = expected.shape
        rows = expected.reshape(b, s, attrs["num_heads"], -1)
        nan, dead = gqa_score_rows(feeds, attrs)
        sink = feeds["head_sink"] if "head_sink" in node_in else np.full(attrs["num_heads"],
                                                                          0.0 if attrs.get("smooth_softmax") else -np.inf)
        if "head_sink" not in node_in and not attrs.get("smooth_softmax"):
            rows = np.where(nan[..., None], np.nan, rows)
        # Every attended score -inf and the sink -inf: the op's weights are 0, y = 0·V (onnxruntime's
        # sink path divides 0 by 0; docs/ops.md).
        dead &= np.isneginf(sink)[None, None, :] & ~nan
        rows = np.where(dead[..., None], gqa_zero_weights_output(feeds, attrs)[:, None], rows)
        expected = rows.reshape(expected.shape)
        v = np.concatenate([feeds["value"].ravel(), feeds["past_value"].ravel()])
        v = v[np.isfinite(v)]
        return expected, np.full(expected.shape, 1.0 + (float(np.abs(v).max()) if v.size else 0.0))
    return compute


def _attention_is_exact(attrs: dict, skv: int, sq: int) -> bool:
    """select none, fewer keys than min_keys, every key within topk, or a prompt of at least
    prefill_rows query rows: exact attention (docs/ops.md)."""
    topk = 256 if attrs.get("topk") is None else attrs["topk"]
    min_keys = 1024 if attrs.get("min_keys") is None else attrs["min_keys"]
    return attrs.get("select") == "none" or skv < min_keys or 0 < topk and skv <= topk or sq >= PREFILL_ROWS


def tt_matmul(rng):
    """TTMatMul(X, cores, B?, W_dense?): small TT-matrices; broken cases get wrong mode/rank lists,
    a cores tensor of the wrong length/rank/dtype or not constant, bad nan_guard/order values."""
    start_case(rng)
    d = int(rng.integers(1, 4))
    in_modes = [max(1, small_dim(rng, 5)) for _ in range(d)]
    out_modes = [max(1, small_dim(rng, 5)) for _ in range(d)]
    ranks = [1] + [int(rng.integers(1, 5)) for _ in range(d - 1)] + [1]
    if rng.random() < 0.01:  # extreme modes: K = N = 32768 from two cores of one nontrivial mode each
        d, ranks = 2, [1, int(rng.integers(1, 3)), 1]
        in_modes, out_modes = pick(rng, [([1, 32768], [32768, 1]), ([32768, 1], [1, 32768])])
        _tags.add("tt_extreme")
    size = sum(ranks[t] * in_modes[t] * out_modes[t] * ranks[t + 1] for t in range(d))
    k, n = int(np.prod(in_modes)), int(np.prod(out_modes))
    graph_inputs, initializers, feeds, node_inputs = [], [], {}, []
    matmul_operands(rng, k, n, graph_inputs, initializers, feeds, node_inputs, with_bias=False)
    cores_shape = pick(rng, [[size + 1], [max(size - 1, 0)], [1, size], []]) if broken(rng) else [size]
    dtype = pick(rng, FLOAT_DTYPES) if broken(rng) else np.float32
    weight_input(rng, "cores", values(rng, cores_shape, dtype, 0.02), graph_inputs, initializers, feeds, node_inputs)
    if rng.random() < 0.3:
        b_shape = pick(rng, [[n + 1], [1, n], []]) if broken(rng) else [n]
        weight_input(rng, "B", values(rng, b_shape, np.float32, 0.02), graph_inputs, initializers, feeds, node_inputs)
    elif rng.random() < 0.3:
        node_inputs.append("")
    if rng.random() < 0.2 and k * n <= 1 << 22:  # (not with the extreme modes: 4 GB)
        if len(node_inputs) == 2:
            node_inputs.append("")
        w_shape = pick(rng, [[k, n + 1], [n, k], [k]]) if broken(rng) else [k, n]
        weight_input(rng, "W_dense", values(rng, w_shape, np.float32, 0.0), graph_inputs, initializers, feeds,
                     node_inputs)
    attrs = {
        "in_modes": attr_value(rng, in_modes, [in_modes[:-1] or [0], [0] * d, [-1] * d, [2**40] * d]),
        "out_modes": attr_value(rng, out_modes, [out_modes + [2], [0] * d, [2**31] * d]),
        "ranks": attr_value(rng, ranks, [ranks[1:], [2] + ranks[1:], ranks[:-1] + [3], [1] + [0] * (d - 1) + [1],
                                         [1] + [2**20] * (d - 1) + [1]]),
        "nan_guard": attr_value(rng, int(rng.integers(0, 2)) if rng.random() < 0.3 else None, [2, -1, 0.5]),
        "order": attr_value(rng, int(rng.integers(-1, 2)) if rng.random() < 0.3 else None, [2, -2]),
        "gap": attr_value(rng, float(rng.uniform(0, 0.1)) if rng.random() < 0.3 else None, [float("nan"), 1]),
    }
    mutate_attributes(rng, "TTMatMul", attrs)
    name = f"tt_{int(rng.integers(1000))}"
    model = make_model("TTMatMul", name, node_inputs, graph_inputs, initializers, attrs)
    small = k * n <= 1 << 22  # the dense reference of the extreme modes would take 8 GB
    return finish("TTMatMul", name, model, feeds, tt_reference(model, feeds, in_modes, out_modes, ranks) if small else None)


def proc_sparse_matmul(rng):
    """Packed layers as the builder writes them (ascending block indices, [N, F, block] deltas), or
    with out-of-range / unsorted indices, wrong dtypes and shapes, attributes that disagree."""
    start_case(rng)
    k, n = max(1, small_dim(rng, 96)), max(1, small_dim(rng, 80))
    block = int(rng.integers(1, min(k, 40) + 1)) if rng.random() < 0.8 else pick(rng, [1, 16, 32, 64])
    nb = -(-k // block)
    fanout = int(rng.integers(1, nb + 1))
    graph_inputs, initializers, feeds, node_inputs = [], [], {}, []
    matmul_operands(rng, k, n, graph_inputs, initializers, feeds, node_inputs, with_bias=False)
    indices = np.stack([np.sort(rng.choice(nb, size=fanout, replace=False)) for _ in range(n)]).astype(np.uint16)
    if broken(rng):
        kind = int(rng.integers(4))
        if kind == 0:
            indices[int(rng.integers(n)), int(rng.integers(fanout))] = nb + int(rng.integers(0, 3))
        elif kind == 1 and fanout > 1:
            indices[int(rng.integers(n))] = indices[0][::-1]
        elif kind == 2:
            indices = indices.astype(pick(rng, [np.int32, np.int64, np.float32]))
        else:
            indices = indices[:, :max(fanout - 1, 0)] if rng.random() < 0.5 else indices[: max(n - 1, 0)]
    weight_input(rng, "indices", indices, graph_inputs, initializers, feeds, node_inputs)
    d_shape = [n, fanout, block]
    if broken(rng):
        d_shape = pick(rng, [[n, fanout], [n, fanout, block + 1], [n + 1, fanout, block], [fanout, n, block]])
    d_dtype = pick(rng, [np.float32, np.float16]) if not broken(rng) else pick(rng, FLOAT_DTYPES)
    weight_input(rng, "deltas", values(rng, d_shape, d_dtype, 0.02), graph_inputs, initializers, feeds, node_inputs)
    if rng.random() < 0.5:
        b_shape = pick(rng, [[n + 1], [1, n], []]) if broken(rng) else [n]
        weight_input(rng, "B", values(rng, b_shape, np.float32, 0.02), graph_inputs, initializers, feeds, node_inputs)
    attrs = {f"kwta_{name}": value for name, value in kwta_gate_attributes(rng, k).items()} if rng.random() < 0.5 else {}
    if attrs:
        attrs["kwta_block"] = attr_value(rng, int(rng.integers(1, k + 1)) if rng.random() < 0.5 else None, [0, k + 1])
    attrs.update({
        "K": attr_value(rng, k, [0, -1, k + 1, 1.5]),
        "N": attr_value(rng, n, [0, n + 1]),
        "block": attr_value(rng, block, [0, k + 1, block + 1, -4]),
        "fanout": attr_value(rng, fanout if rng.random() < 0.5 else None, [0, fanout + 1]),
        "seed": int(rng.integers(0, 2**62)) if rng.random() < 0.5 else None,
        "base_scale": attr_value(rng, pick(rng, [0.0, 0.05, float(rng.uniform(-1, 1))]), [float("nan"), float("inf"), "x"]),
    })
    if rng.random() < 0.3:  # exact settings: no hash base, no gate, so Y = X @ W_hat + B
        attrs = {key: value for key, value in attrs.items() if not key.startswith("kwta_")}
        attrs["base_scale"] = 0.0
    mutate_attributes(rng, "ProcSparseMatMul", attrs)
    name = f"proc_{int(rng.integers(1000))}"
    model = make_model("ProcSparseMatMul", name, node_inputs, graph_inputs, initializers, attrs)
    gate_off = (attrs.get("kwta_k_frac", 1.0) == 1.0 and not attrs.get("kwta_k_abs")
                and not attrs.get("kwta_threshold"))
    exact = not attrs.get("base_scale") and gate_off
    return finish("ProcSparseMatMul", name, model, feeds, proc_reference(model, feeds, k, block) if exact else None)


def event_driven_matmul(rng):
    """One run per case: with axis sequence and rows of X beyond the first per stream, the event
    path (gate, delta products, gap check) runs within the call."""
    start_case(rng)
    k, n = small_dim(rng, 96), small_dim(rng, 80)
    graph_inputs, initializers, feeds, node_inputs = [], [], {}, []
    matmul_operands(rng, k, n, graph_inputs, initializers, feeds, node_inputs, weight_shape=[k, n])
    if rng.random() < 0.4:
        if len(node_inputs) == 2:
            node_inputs.append("")
        shape = pick(rng, [[2], [1, 2]]) if broken(rng) else pick(rng, [[], [1]])
        graph_inputs.append(helper.make_tensor_value_info("reset", TensorProto.BOOL, shape))
        feeds["reset"] = np.asarray(rng.random(size=shape) < 0.5, dtype=bool)
        node_inputs.append("reset")
    attrs = {
        "axis": attr_value(rng, pick(rng, ["sequence", "call"]), ["Sequence", "", 3]),
        "topk": attr_value(rng, float(rng.uniform(0.01, 1.0)), [0.0, 1.5, float("nan")]),
        "delta_theta": attr_value(rng, float(rng.uniform(0, 0.2)), [-1.0, float("inf"), float("nan")]),
        "stale_beta": attr_value(rng, float(rng.uniform(0, 1)) if rng.random() < 0.3 else None, [1.5, -0.1]),
        "stale_lambda": attr_value(rng, float(rng.uniform(0, 1)) if rng.random() < 0.3 else None, [-1.0]),
        "age_max": attr_value(rng, int(rng.integers(0, 4)) if rng.random() < 0.3 else None, [-1, 0.5]),
        "budget_ms": attr_value(rng, pick(rng, [0.0, 1e-9, 0.01, 5.0]) if rng.random() < 0.4 else None,
                                [-1.0, float("inf")]),
        "quorum": attr_value(rng, float(rng.uniform(0, 1)) if rng.random() < 0.3 else None, [1.5, float("nan")]),
        "gap_every": attr_value(rng, int(rng.integers(0, 4)) if rng.random() < 0.5 else None, [-1]),
        "gap_tol": attr_value(rng, float(rng.uniform(0, 0.1)) if rng.random() < 0.3 else None, [-1.0, float("nan")]),
        "kwta_k": attr_value(rng, float(rng.uniform(0, 1)) if rng.random() < 0.3 else None, [2.0, -0.5]),
        "max_gated_rows": attr_value(rng, int(rng.integers(0, 4)) if rng.random() < 0.3 else None, [-1]),
        "block": attr_value(rng, int(rng.integers(1, max(k, 1) + 1)) if rng.random() < 0.5 else None, [0, k + 1]),
    }
    if rng.random() < 0.2:  # exact delta coding: every changed block refreshed, no deadline, no prior
        attrs.update(topk=1.0, delta_theta=0.0, stale_beta=None, stale_lambda=None, kwta_k=None, budget_ms=None)
    mutate_attributes(rng, "EventDrivenMatMul", attrs)
    if k == 0 or n == 0:
        _tags.add("zero_dim")
    name = f"event_{int(rng.integers(1000))}"
    model = make_model("EventDrivenMatMul", name, node_inputs, graph_inputs, initializers, attrs)
    exact = (attrs.get("topk") == 1.0 and attrs.get("delta_theta") == 0.0 and attrs.get("stale_beta") in (None, 1.0)
             and attrs.get("stale_lambda") in (None, 0.0) and not attrs.get("kwta_k") and not attrs.get("budget_ms"))
    return finish("EventDrivenMatMul", name, model, feeds, event_reference(model, feeds) if exact else None,
                  tolerance=1e-3)


# ---------------------------------------------------------------- attribute families the op must refuse

# Per op: attribute -> (kind, a valid value). "float" attributes are FLOAT in the op's contract
# (an int is accepted there), "int" INT, "str" STRING.
ATTRIBUTE_KINDS = {
    "KwtaBlockMatMul": {"k_frac": ("float", 0.5), "k_abs": ("int", 2), "score": ("str", "l2"),
                        "threshold": ("float", 0.1), "temp": ("float", 1.0), "duty": ("int", 2),
                        "duty_mode": ("str", "dense"), "renorm": ("int", 0), "max_gated_rows": ("int", 0),
                        "block": ("int", 1), "pack_mode": ("str", "binary"), "pack_eps": ("float", 0.0),
                        "pack_density_max": ("float", 0.5)},
    "PopcountAttention": {"select": ("str", "popcount"), "mode": ("str", "sign"), "topk": ("int", 4),
                          "min_keys": ("int", 0), "eps": ("float", 1e-4), "density_max": ("float", 1.0),
                          "candidates": ("float", 1.0), "keep_first": ("int", 0), "keep_recent": ("int", 0),
                          "is_causal": ("int", 0), "scale": ("float", 0.0), "pack_cache": ("int", 1),
                          "center": ("int", 1), "proj_bits": ("int", 64)},
    "EventDrivenMatMul": {"axis": ("str", "sequence"), "topk": ("float", 0.4), "delta_theta": ("float", 0.01),
                          "stale_beta": ("float", 1.0), "stale_lambda": ("float", 0.0), "age_max": ("int", 0),
                          "budget_ms": ("float", 0.0), "quorum": ("float", 0.6), "gap_every": ("int", 64),
                          "gap_tol": ("float", 0.03), "kwta_k": ("float", 0.0), "max_gated_rows": ("int", 0),
                          "block": ("int", 1)},
    "ProcSparseMatMul": {"base_scale": ("float", 0.0), "seed": ("int", 0), "kwta_k_frac": ("float", 1.0),
                         "kwta_threshold": ("float", 0.0), "kwta_temp": ("float", 1.0), "kwta_score": ("str", "l2"),
                         "kwta_duty": ("int", 1)},
    "TTMatMul": {"gap": ("float", -1.0), "nan_guard": ("int", 1), "order": ("int", -1)},
}
_WRONG_TYPE = {"int": [1.5, "2"], "float": ["0.5"], "str": [1, 0.5]}


def mutate_attributes(rng, op_type: str, attrs: dict) -> None:
    """Sometimes gives one attribute a value the op must refuse — a one-element list where it takes
    a scalar (``k_frac=[0.9]``), NaN, or another type (an int for a float is fine: not used) — or
    +-inf (must not crash; refused or computed, never a wrong exact result)."""
    if rng.random() >= 0.08:
        return
    kinds = ATTRIBUTE_KINDS[op_type]
    name = pick(rng, sorted(kinds))
    kind, valid = kinds[name]
    current = attrs.get(name)
    value = valid if current is None or isinstance(current, list) else current
    family = pick(rng, ["list", "list", "nan", "inf", "wrong_type"] if kind == "float" else ["list", "list", "wrong_type"])
    if family == "list":
        attrs[name] = [value]
        _must_refuse.append(f"{name}={[value]!r} is a list; the op takes one {kind}")
        _tags.add("list_attr")
    elif family == "nan":
        attrs[name] = float("nan")
        _must_refuse.append(f"{name}=nan")
        _tags.add("nan_attr")
    elif family == "inf":
        attrs[name] = pick(rng, [float("inf"), float("-inf")])
        _tags.add("inf_attr")
    else:
        attrs[name] = pick(rng, _WRONG_TYPE[kind])
        _must_refuse.append(f"{name}={attrs[name]!r} is not a {kind}")
        _tags.add("wrong_type")


def finish(op_type: str, name: str, model: ModelProto, feeds: dict, reference=None, tolerance: float = 1e-4,
           nonfinite_ok: bool = False) -> Case:
    """``nonfinite_ok``: the reference defines NaN/Inf inputs (compared: NaN and Inf positions, finite
    values); otherwise a case with any is run without one."""
    must_refuse = "; ".join(_must_refuse) or None
    # No reference with an infinite attribute: "exact" is not defined there (refused or computed,
    # it must only not crash).
    exact = reference if (must_refuse is None and _invalid_rate == 0.0 and "inf_attr" not in _tags
                          and (nonfinite_ok or all_finite(model, feeds))) else None
    return Case(op_type, name, model, feeds, exact, tolerance, must_refuse, frozenset(_tags))


# ---------------------------------------------------------------- numpy references (exact settings only)

def all_finite(model: ModelProto, feeds: dict) -> bool:
    arrays = list(feeds.values()) + [numpy_helper.to_array(t) for t in model.graph.initializer]
    return all(a.dtype.kind in "biu" or bool(np.isfinite(a).all()) for a in arrays)


def _initializer(model: ModelProto, name: str) -> np.ndarray | None:
    for tensor in model.graph.initializer:
        if tensor.name == name:
            return numpy_helper.to_array(tensor)
    return None


def _matmul_reference(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, rows_magnitude=None):
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    expected = x64 @ w64 + (0.0 if b is None else b.astype(np.float64))
    magnitude = (np.abs(x64) if rows_magnitude is None else rows_magnitude) @ np.abs(w64) \
        + (0.0 if b is None else np.abs(b.astype(np.float64)))
    return expected, magnitude


def dense_reference(model: ModelProto, feeds: dict, weight: str = "W"):
    """Y = X @ W + B from the case's own tensors."""
    def compute():
        return _matmul_reference(feeds["X"], _initializer(model, weight), _initializer(model, "B"))
    return compute


def proc_reference(model: ModelProto, feeds: dict, k: int, block: int):
    """Y = X @ W_hat + B, W_hat from indices/deltas (base_scale 0: zero outside the kept blocks)."""
    def compute():
        indices, deltas = _initializer(model, "indices").astype(np.int64), _initializer(model, "deltas")
        n, fanout = indices.shape
        w = np.zeros((k, n), dtype=np.float64)
        for unit in range(n):
            for f in range(fanout):
                start = int(indices[unit, f]) * block
                rows = min(block, k - start)
                w[start:start + rows, unit] = deltas[unit, f, :rows].astype(np.float32)
        return _matmul_reference(feeds["X"], w, _initializer(model, "B"))
    return compute


def tt_reference(model: ModelProto, feeds: dict, in_modes, out_modes, ranks):
    def compute():
        from ortsparse.tt import tt_full

        flat = _initializer(model, "cores").astype(np.float64)
        cores, at = [], 0
        for t in range(len(in_modes)):
            shape = (ranks[t], in_modes[t], out_modes[t], ranks[t + 1])
            cores.append(flat[at:at + int(np.prod(shape))].reshape(shape))
            at += int(np.prod(shape))
        bias = _initializer(model, "B")
        expected, _ = _matmul_reference(feeds["X"], tt_full(cores), bias)
        # |X| |G_1|...|G_d| + |B|: the bias is a term of every output too (without it, an output
        # that is mostly bias got a bound below its own float32 rounding)
        _, magnitude = _matmul_reference(np.abs(feeds["X"]), tt_full([np.abs(c) for c in cores]), bias)
        return expected, magnitude
    return compute


def event_reference(model: ModelProto, feeds: dict):
    """Exact delta coding (topk 1, delta_theta 0, stale_beta 1, no deadline or prior) is the dense
    product up to rounding carried from the rows before: the bound uses the largest row magnitude."""
    def compute():
        x = feeds["X"]
        peak = np.abs(x.astype(np.float64)).reshape(-1, x.shape[-1]).max(axis=0) if x.size else np.zeros(x.shape[-1])
        return _matmul_reference(x, _initializer(model, "W"), _initializer(model, "B"),
                                 rows_magnitude=np.broadcast_to(peak, x.shape) * 4)
    return compute


def attention_reference(feeds: dict, attrs: dict):
    """Exact attention (tests/ops/attention_reference.py). D = 0: every q.k is 0, so any finite scale
    gives the same (uniform over the attendable keys) weights."""
    def compute():
        from ops import attention_reference as ref

        q, k, v = feeds["Q"], feeds["K"], feeds["V"]
        scale = float(attrs.get("scale") or 0.0)
        if q.shape[3] == 0:
            scale = scale or 1.0
        mask = feeds.get("attn_mask")
        if k.shape[2] == 0:  # no keys: every row is fully masked, Y = 0 (docs/ops.md)
            expected = np.zeros(q.shape[:3] + v.shape[3:], dtype=np.float64)
            return expected, np.zeros(expected.shape)
        expected = ref.attention(q, k, v, mask, causal=bool(attrs.get("is_causal") or 0), scale=scale)
        finite = lambda a: np.where(np.isfinite(a), a, 0.0).astype(np.float64)  # bounds from the finite parts
        scores = np.einsum("bhid,bhjd->bhij", finite(q), ref.expand_kv(finite(k), q.shape[1]))
        spread = 1.0 + (np.abs(scores).max() * float(ref.scale_of(scale, max(q.shape[3], 1))) if scores.size else 0.0)
        if mask is not None and mask.dtype != np.bool_ and mask.size:
            spread += float(np.abs(finite(mask)).max())
        v_max = float(np.abs(finite(v)).max()) if v.size else 0.0
        return expected, np.full(expected.shape, v_max * spread)
    return compute


# op type -> generator; ops not in the loaded library are skipped by the fuzzer.
GENERATORS = {
    "KwtaBlockMatMul": kwta_block_matmul,
    "PopcountAttention": popcount_attention,
    GQA_OP: popcount_group_query_attention,
    "ProcSparseMatMul": proc_sparse_matmul,
    "EventDrivenMatMul": event_driven_matmul,
    "TTMatMul": tt_matmul,
}
