"""Bad input to PopcountGroupQueryAttention: a one-line error naming the op, the node and the values,
at session creation (attributes, unsupported inputs) or at run time (shapes, lengths) — never a
crash or a read past a buffer. Ends with a fuzz loop of random shapes and lengths."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import ortsparse

from . import gqa_graphs as G

PREFIX = "PopcountGroupQueryAttention node 'gqa'"
CFG = G.Gqa(num_heads=4, kv_num_heads=2, head_size=8, rotary=True)


def error_of(fn) -> str:
    with pytest.raises(Exception) as info:
        fn()
    return str(info.value)


@pytest.mark.parametrize("attrs,message", [
    ({"kv_num_heads": 3}, "num_heads=4 must be a multiple of kv_num_heads=3"),
    ({"kv_num_heads": 0}, "kv_num_heads=0 must be > 0"),
    ({"num_heads": -2}, "num_heads=-2 must be > 0"),
    ({"local_window_size": -5}, "local_window_size=-5 must be -1 (none) or >= 0"),
    ({"causal": 0, "local_window_size": 4}, "local_window_size=4 needs causal=1"),
    ({"qk_output": 1}, "qk_output=1 is not supported"),
    ({"sliding_window_cache": 1}, "sliding_window_cache=1 needs local_window_size > 0, got -1"),
    ({"sliding_window_cache": 2, "local_window_size": 4}, "sliding_window_cache=2 must be 0 or 1"),
    ({"k_quant_type": "PER_TENSOR"}, "k_quant_type='PER_TENSOR' is not supported"),
    ({"kv_cache_bit_width": 8}, "kv_cache_bit_width=8 is not supported"),
    ({"do_rotary": 2}, "do_rotary=2 must be 0 or 1"),
    ({"select": "bogus"}, "select='bogus' is not one of"),
    ({"topk": -1}, "topk=-1 must be >= 0"),
    ({"select": "pages", "topk": 0}, "topk=0"),
    ({"page_size": 0}, "page_size=0 must be in [1, 4096]"),
    ({"candidates": 0.5}, "candidates=0.5 must be in [1, 1024]"),
    ({"select": "pages", "mass_eps": 1.5}, "mass_eps=1.5 must be in [0, 1)"),
    ({"select": "pages", "mass_eps": 0.1, "event": 1}, "mass_eps=0.1 needs select='pages' with candidates > 0"),
    ({"verify_keys": 2}, "verify_keys=2 must be 0 or 1"),
    ({"scale": -1.0}, "scale=-1 must be >= 0"),
])
def test_bad_attributes_fail_at_session_creation(attrs, message):
    message_got = error_of(lambda: G.session(CFG, ours=True, **attrs))
    assert PREFIX in message_got and message in message_got


def test_unsupported_inputs_are_refused_at_session_creation():
    model = helper.make_model(helper.make_graph(
        [helper.make_node(G.OP, ["query", "", "", "", "", "seqlens_k", "total", "", "", "", "", "", "k_scale"],
                          ["output", "present_key", "present_value"], name="gqa", domain=G.OURS, num_heads=4,
                          kv_num_heads=2)], "g",
        [helper.make_tensor_value_info("query", TensorProto.FLOAT, ["b", "s", 64]),
         helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["b"]),
         helper.make_tensor_value_info("total", TensorProto.INT32, [1]),
         helper.make_tensor_value_info("k_scale", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("output", "present_key", "present_value")]),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(G.OURS, 1)], ir_version=9)
    message = error_of(lambda: ortsparse.inference_session(model))
    assert PREFIX in message and "input 12 (k_scale) is not supported" in message


def call(cfg=CFG, *, batch=2, s=3, buffer=16, seqlens=(2, 2), total=3, cos_rows=16, query=None, key=None,
         value=None, past_shape=None, value_shape=None, cos_shape=None, extra=None, **attrs):
    """One call of our op with the given (possibly bad) inputs; returns the outputs."""
    rng = np.random.default_rng(0)
    sess = G.session(cfg, ours=True, free=True, **attrs)
    width = cfg.hidden + (2 * cfg.kv_hidden if cfg.packed else 0)
    feeds = {"query": rng.standard_normal((batch, s, width), dtype=np.float32) if query is None else query,
             "seqlens_k": np.asarray(seqlens, np.int32), "total_sequence_length": np.asarray([total], np.int32)}
    if not cfg.packed:
        feeds["key"] = rng.standard_normal((batch, s, cfg.kv_hidden), dtype=np.float32) if key is None else key
        feeds["value"] = rng.standard_normal((batch, s, cfg.kv_hidden), dtype=np.float32) if value is None else value
    if cfg.past:
        shape = past_shape or (batch, cfg.kv_num_heads, buffer, cfg.head_size)
        feeds["past_key"] = np.zeros(shape, np.float32)
        feeds["past_value"] = np.zeros(value_shape or shape, np.float32)
    if cfg.rotary:
        shape = cos_shape or (cos_rows, cfg.half)
        feeds["cos_cache"] = np.ones(shape, np.float32)
        feeds["sin_cache"] = np.zeros((cos_rows, cfg.half), np.float32)
    feeds.update(extra or {})
    return sess.run(None, feeds)


@pytest.mark.parametrize("kwargs,message", [
    (dict(query=np.zeros((2, 3, 30), np.float32)), "query hidden size 30 is not num_heads=4 times a head size"),
    (dict(key=np.zeros((2, 3, 8), np.float32)), "key [2, 3, 8] and value [2, 3, 16] must be [batch, sequence, "),
    (dict(past_shape=(2, 3, 16, 8)), "past_key [2, 3, 16, 8] must be [batch=2, kv_num_heads=2, buffer, head_size=8]"),
    (dict(past_shape=(2, 2, 16, 8), value_shape=(2, 2, 15, 8)), "past_value [2, 2, 15, 8] must have past_key's shape"),
    (dict(seqlens=(2,)), "seqlens_k must be int32 [batch] = [2], got shape [1]"),
    (dict(seqlens=(2, -1)), "seqlens_k[1]=-1 is outside the KV buffer: it must be in [0, 16)"),
    (dict(seqlens=(2, 17), total=17, s=1, cos_rows=32), "seqlens_k[1]=17 is outside the KV buffer: it must be in [0, 17)"),
    (dict(seqlens=(2, 40), total=5, s=1), "seqlens_k[1]=40 is outside the KV buffer"),
    (dict(seqlens=(9, 2), total=4, s=1), "total_sequence_length=4 is smaller than seqlens_k[0] + 1 = 10"),
    (dict(total=0), "total_sequence_length=0 must be >= 1"),
    (dict(cos_rows=2), "cos_cache/sin_cache have 2 positions but batch entry 0 rotates row 2 by position 2"),
    (dict(seqlens=(9, 12), total=13, s=1, cos_rows=12), "batch entry 1 rotates row 0 by position 12"),
    (dict(cos_shape=(16, 2)), "sin_cache [16, 4] must have cos_cache's shape [16, 2]"),
    (dict(batch=1, seqlens=(1,), total=4, s=3), "seqlens_k[0]=1 is too small for 3 new rows"),
    (dict(seqlens=(5, 5), total=6, s=1, buffer=3, past_shape=(2, 2, 3, 8)),
     "seqlens_k[0]=5 needs 5 past rows but past_key holds 3"),
    (dict(batch=2, s=2, seqlens=(5, 5), total=8), "needs batch 1, got 2"),
    (dict(extra={"position_ids": np.zeros((2, 2), np.int64)}), "position_ids [2, 2] must be int64 [batch, sequence]"),
    (dict(extra={"position_ids": np.full((1, 3), -4, np.int64)}, seqlens=(5,), total=6, s=3, batch=1),
     "rotates row 0 by position -4 (from position_ids)"),
    (dict(extra={"attention_bias": np.zeros((2, 4, 3, 2), np.float32)}), "attention_bias [2, 4, 3, 2] must be"),
    (dict(extra={"head_sink": np.zeros(3, np.float32)}), "head_sink [3] must be [num_heads] = [4]"),
])
def test_bad_call_inputs_are_clear_errors(kwargs, message):
    extra = kwargs.get("extra") or {}
    cfg = CFG if not extra else G.Gqa(num_heads=4, kv_num_heads=2, head_size=8, rotary=True, extra=tuple(extra))
    got = error_of(lambda: call(cfg, **kwargs))
    assert PREFIX in got and message in got, got


def test_position_ids_past_the_rotary_cache_are_refused():
    cfg = G.Gqa(num_heads=4, kv_num_heads=2, head_size=8, rotary=True, extra=("position_ids",))
    got = error_of(lambda: call(cfg, batch=1, s=1, seqlens=(4,), total=5,
                                extra={"position_ids": np.array([[99]], np.int64)}))
    assert PREFIX in got and "rotates row 0 by position 99 (from position_ids)" in got


def test_do_rotary_without_caches_is_refused():
    cfg = G.Gqa(num_heads=4, kv_num_heads=2, head_size=8, rotary=False)
    got = error_of(lambda: call(cfg, do_rotary=1))
    assert PREFIX in got and "do_rotary=1 needs the cos_cache and sin_cache inputs" in got


def test_float16_query_is_refused_by_type():
    cfg = G.Gqa(num_heads=4, kv_num_heads=2, head_size=8)
    model = G.model(cfg, ours=True)
    import onnx

    proto = onnx.load_from_string(model)
    for value in proto.graph.input:
        if value.name == "query":
            value.type.tensor_type.elem_type = TensorProto.FLOAT16
    got = error_of(lambda: ortsparse.inference_session(proto))
    assert "PopcountGroupQueryAttention" in got and "float16" in got


def test_fuzzed_shapes_and_lengths_never_crash():
    """Random shapes, lengths and buffers: each call succeeds with finite outputs or fails with the op's
    one-line error (the sanitizer build runs this too: no read past a buffer)."""
    rng = np.random.default_rng(7)
    sessions = {}
    outcomes = {"ok": 0, "error": 0}
    for _ in range(300):
        hkv = int(rng.integers(1, 3))
        h = hkv * int(rng.integers(1, 3))
        d = 2 * int(rng.integers(1, 5))
        packed = bool(rng.integers(0, 2))
        rotary = bool(rng.integers(0, 2))
        cfg = G.Gqa(num_heads=h, kv_num_heads=hkv, head_size=d, packed=packed, rotary=rotary,
                    rotary_dim=2 * int(rng.integers(1, d // 2 + 1)) if rotary else None)
        select = str(rng.choice(["none", "pages", "popcount", "energy"]))
        key = (cfg, select)
        if key not in sessions:
            sessions[key] = G.session(cfg, ours=True, free=True, select=select, topk=2, min_keys=0)
        sess = sessions[key]
        b = int(rng.integers(0, 4))
        s = int(rng.integers(1, 5))
        buffer = int(rng.integers(s, 12))
        width = cfg.hidden + (2 * cfg.kv_hidden if packed else 0)
        if rng.random() < 0.5:  # a first prompt (right-padded), else a token / later-prompt call
            total = s
            seqlens = rng.integers(0, s, b)
        else:
            s = 1 if b != 1 else s
            seqlens = rng.integers(s - 1, buffer, b)
            total = int(seqlens.max(initial=0)) + 1
        cos_rows = buffer + 1
        # then break one thing, or nothing
        broken = int(rng.integers(0, 8))
        lengths = b
        if broken == 1:
            width += int(rng.choice([-1, 1]))
        elif broken == 2:
            seqlens = seqlens + int(rng.choice([-buffer - 1, buffer + 1]))
        elif broken == 3:
            total = int(rng.integers(-1, total + 1))
        elif broken == 4:
            cos_rows = int(rng.integers(0, buffer))
        elif broken == 5:
            lengths = max(0, b + int(rng.choice([-1, 1])))
            seqlens = np.resize(seqlens, lengths)
        elif broken == 6:
            buffer = int(rng.integers(0, buffer))
        feeds = {"query": rng.standard_normal((b, s, width), dtype=np.float32),
                 "seqlens_k": np.asarray(seqlens, np.int32).reshape(lengths),
                 "total_sequence_length": np.asarray([total], np.int32),
                 "past_key": np.zeros((b, hkv, buffer, d), np.float32),
                 "past_value": np.zeros((b, hkv, buffer, d), np.float32)}
        if not packed:
            feeds["key"] = rng.standard_normal((b, s, cfg.kv_hidden), dtype=np.float32)
            feeds["value"] = rng.standard_normal((b, s, cfg.kv_hidden), dtype=np.float32)
        if rotary:
            feeds["cos_cache"] = np.ones((cos_rows, cfg.half), np.float32)
            feeds["sin_cache"] = np.zeros((cos_rows, cfg.half), np.float32)
        try:
            out = sess.run(None, feeds)
        except (ort.capi.onnxruntime_pybind11_state.InvalidArgument, ort.capi.onnxruntime_pybind11_state.Fail) as error:
            text = str(error)
            assert "PopcountGroupQueryAttention" in text, text
            outcomes["error"] += 1
            continue
        assert all(np.isfinite(o).all() for o in out)
        outcomes["ok"] += 1
    print(outcomes)
    assert outcomes["ok"] > 50 and outcomes["error"] > 50, outcomes


def test_fuzzed_window_buffers_never_crash():
    """sliding_window_cache=1 with random windows, buffers (some below the window), lengths far past
    the buffer, prompts and chunks: each call succeeds with finite outputs or fails with the op's
    one-line error."""
    rng = np.random.default_rng(11)
    sessions = {}
    outcomes = {"ok": 0, "error": 0}
    for _ in range(300):
        window = int(rng.integers(1, 6))
        cfg = G.Gqa(num_heads=4, kv_num_heads=2, head_size=8, local_window=window, rotary=bool(rng.integers(0, 2)))
        select = str(rng.choice(["none", "pages"]))
        key = (cfg, select)
        if key not in sessions:
            sessions[key] = G.session(cfg, ours=True, free=True, select=select, topk=2, min_keys=0,
                                      sliding_window_cache=1)
        b = int(rng.integers(1, 4))
        s = int(rng.integers(1, 12))
        buffer = int(rng.integers(window - 1, window + 6))
        if rng.random() < 0.4:
            total = s
            seqlens = rng.integers(0, s, b) if rng.random() < 0.3 else np.full(b, s - 1)
        else:
            s = 1 if b != 1 else s
            seqlens = rng.integers(s - 1, max(s, 4 * buffer + 2), b)
            total = int(seqlens.max()) + 1
        if rng.random() < 0.15:
            seqlens = seqlens + int(rng.choice([-100, 100]))
        feeds = {"query": rng.standard_normal((b, s, cfg.hidden), dtype=np.float32),
                 "key": rng.standard_normal((b, s, cfg.kv_hidden), dtype=np.float32),
                 "value": rng.standard_normal((b, s, cfg.kv_hidden), dtype=np.float32),
                 "seqlens_k": np.asarray(seqlens, np.int32), "total_sequence_length": np.asarray([total], np.int32),
                 "past_key": rng.standard_normal((b, 2, buffer, 8), dtype=np.float32),
                 "past_value": rng.standard_normal((b, 2, buffer, 8), dtype=np.float32)}
        if cfg.rotary:
            feeds["cos_cache"] = np.ones((int(rng.integers(1, 6 * buffer + 12)), cfg.half), np.float32)
            feeds["sin_cache"] = np.zeros_like(feeds["cos_cache"])
        try:
            out = sessions[key].run(None, feeds)
        except (ort.capi.onnxruntime_pybind11_state.InvalidArgument, ort.capi.onnxruntime_pybind11_state.Fail) as error:
            assert "PopcountGroupQueryAttention" in str(error), str(error)
            outcomes["error"] += 1
            continue
        assert all(np.isfinite(o).all() for o in out) and out[1].shape == (b, 2, buffer, 8)
        outcomes["ok"] += 1
    assert outcomes["ok"] > 50 and outcomes["error"] > 30, outcomes
