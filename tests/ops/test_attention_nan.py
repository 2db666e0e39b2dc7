"""NaN and Inf in any input of the attention ops reach the output as they do in onnxruntime's own op
(docs/ops.md, "NaN/Inf"): PopcountGroupQueryAttention against com.microsoft.GroupQueryAttention on
the same inputs, PopcountAttention against ai.onnx Attention-23 (its CPU kernel; without causal
masking, whose alignment differs). Found empirically on onnxruntime 1.32 (the cases below):

- a NaN score of a key the query attends (NaN in q, in that key's K row, in its attention_bias /
  attn_mask entry) makes the query head's whole output row NaN; a NaN head_sink every row of its head;
- a non-finite V entry (V, past_value) of any key in [0, keys) reaches that output column of every
  query of the KV head: the attended ones through p·v, the causally masked or out-of-window ones
  through 0·NaN (onnxruntime multiplies the probabilities with all of V);
- K rows outside a query's causal range / local window are not read for it;
- a row whose scores are all -inf gets 0·V; a NaN or +inf head_sink gives NaN.
onnxruntime's plain softmax (no head_sink, no smooth_softmax: MLAS) returns 0 for some rows holding a
NaN score; the op gives NaN there, as onnxruntime's sink path does (the test at the end shows both).

With a selector (select != none) the same holds for q, K, the bias and head_sink: a NaN score is kept
(or the row computed exactly), never dropped from the top-k. V rows of keys outside the selection are
never read (test_nonfinite.py). Compared: NaN positions, +-Inf positions, finite entries within
1e-5 of the output scale. Every ISA (a child process per ORTSPARSE_ISA)."""
from __future__ import annotations

import dataclasses
import functools

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import ortsparse

from .isa_runs import ISAS, run_file_under_isa
from . import gqa_graphs as G

H, HKV, D = 4, 2, 8
CFG = G.Gqa(num_heads=H, kv_num_heads=HKV, head_size=D, extra=("attention_bias", "head_sink"))
# (window, phase): phase "prompt" = 6 new rows, no past; "decode" = one row after 7 past rows;
# "long" = one row after 47 past rows (more keys than the selectors' topk).
PHASES = {"prompt": (6, 0), "decode": (1, 7), "long": (1, 47)}
SELECT = {
    "none": {"select": "none"},
    "popcount": {"select": "popcount", "topk": 4, "candidates": 2.0, "min_keys": 0, "keep_first": 1,
                 "keep_recent": 2},
    "pages": {"select": "pages", "topk": 4, "candidates": 2.0, "page_size": 4, "min_keys": 0, "keep_first": 1,
              "keep_recent": 2},
    "pages_certified": {"select": "pages", "topk": 4, "candidates": 0.0, "page_size": 4, "min_keys": 0,
                        "keep_first": 0, "keep_recent": 0},
    "energy": {"select": "energy", "topk": 4, "min_keys": 0},
}


@functools.lru_cache(maxsize=None)
def gqa_session(window: int, ours: bool, select: str = "none") -> ort.InferenceSession:
    cfg = G.Gqa(num_heads=H, kv_num_heads=HKV, head_size=D, local_window=window, extra=CFG.extra)
    return G.session(cfg, ours=ours, **(SELECT[select] if ours else {}))


def gqa_feeds(phase: str, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    s, past = PHASES[phase]
    total = s + past
    return {"query": rng.standard_normal((1, s, H * D), dtype=np.float32),
            "key": rng.standard_normal((1, s, HKV * D), dtype=np.float32),
            "value": rng.standard_normal((1, s, HKV * D), dtype=np.float32),
            "past_key": rng.standard_normal((1, HKV, past, D), dtype=np.float32),
            "past_value": rng.standard_normal((1, HKV, past, D), dtype=np.float32),
            "seqlens_k": np.array([total - 1], np.int32), "total_sequence_length": np.array([total], np.int32),
            "attention_bias": rng.standard_normal((1, H, s, total), dtype=np.float32),
            "head_sink": rng.standard_normal(H).astype(np.float32)}


def poison_sites(phase: str) -> list[tuple[str, tuple]]:
    """(input, index) of one entry to make non-finite: first / last rows, heads of both KV groups."""
    s, past = PHASES[phase]
    sites = [("query", (0, 0, 1 * D + 2)), ("query", (0, s - 1, 3 * D)), ("key", (0, 0, 3)),
             ("key", (0, s - 1, D + 5)), ("value", (0, 0, 3)), ("value", (0, s - 1, D + 1)),
             ("attention_bias", (0, 1, 0, 0)), ("attention_bias", (0, 2, s - 1, s + past - 1)),
             ("attention_bias", (0, 3, 0, s + past - 1)), ("head_sink", (2,))]
    if past:
        sites += [("past_key", (0, 0, 0, 1)), ("past_key", (0, 1, past // 2, 0)), ("past_value", (0, 0, 0, 3)),
                  ("past_value", (0, 1, past - 1, 7))]
    return sites


def assert_same_nonfinite(ours: np.ndarray, theirs: np.ndarray, what: str, finite_values: bool = True) -> None:
    """NaN positions equal, +-Inf positions equal and (finite_values) the finite entries within 1e-5
    of the output scale."""
    for name, test in (("NaN", np.isnan), ("+Inf", np.isposinf), ("-Inf", np.isneginf)):
        differ = test(ours) != test(theirs)
        assert not differ.any(), (f"{what}: {name} at {np.argwhere(differ)[:6].tolist()} differs "
                                  f"(ours {ours[differ][:6]}, onnxruntime {theirs[differ][:6]})")
    finite = np.isfinite(theirs)
    if finite_values and finite.any():
        scale = max(float(np.abs(theirs[finite]).max()), 1e-30)
        assert np.abs(ours[finite] - theirs[finite]).max() <= 1e-5 * scale, what


def gqa_case(window: int, phase: str, name: str, index: tuple, value: float, select: str = "none"):
    feeds = gqa_feeds(phase)
    feeds[name] = feeds[name].copy()
    feeds[name][index] = value
    theirs = gqa_session(window, False).run(None, feeds)[0]
    ours = gqa_session(window, True, select).run(None, feeds)[0]
    return ours, theirs


CASES = [(window, phase, name, index) for window in (-1, 3) for phase in PHASES for name, index in poison_sites(phase)]


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("window,phase,name,index", CASES)
def test_gqa_exact_nonfinite_matches_onnxruntime(window, phase, name, index, value):
    ours, theirs = gqa_case(window, phase, name, index, value)
    assert_same_nonfinite(ours, theirs, f"{name}{list(index)}={value} window={window} {phase}")


def test_gqa_nan_query_and_all_nan_bias_row_are_nan_not_zero():
    """The reported case: select=none, one NaN in query (or a bias row all NaN) gave 0 for the head."""
    feeds = gqa_feeds("prompt")
    feeds["query"][0, 2, 1 * D + 4] = np.nan
    ours = gqa_session(-1, True).run(None, feeds)[0].reshape(1, 6, H, D)
    assert np.isnan(ours[0, 2, 1]).all() and np.isfinite(np.delete(ours[0, 2], 1, axis=0)).all()
    feeds = gqa_feeds("decode")
    feeds["attention_bias"][0, 3, 0, :] = np.nan
    ours = gqa_session(-1, True).run(None, feeds)[0].reshape(1, 1, H, D)
    assert np.isnan(ours[0, 0, 3]).all() and np.isfinite(ours[0, 0, :3]).all()


SELECTION_SITES = [(name, index) for name, index in poison_sites("long") if name not in ("value", "past_value")]


@pytest.mark.parametrize("select", [s for s in SELECT if s != "none"])
@pytest.mark.parametrize("window", [-1, 30])
@pytest.mark.parametrize("name,index", SELECTION_SITES)
def test_gqa_selection_keeps_nan_scores(select, window, name, index):
    """47 past keys, topk 4: a NaN score is never dropped from the selection (its head row is NaN
    exactly where onnxruntime's is); V is not compared (rows outside the selection are not read)."""
    ours, theirs = gqa_case(window, "long", name, index, np.nan, select)
    assert_same_nonfinite(ours, theirs, f"{select}: {name}{list(index)} window={window}", finite_values=False)


@pytest.mark.parametrize("select", list(SELECT))
@pytest.mark.parametrize("shared", [False, True])
def test_gqa_nan_key_summarised_in_an_earlier_call_stays_visible(select, shared):
    """A NaN key written by the prompt is in the kept key summaries of later decode calls (pack_cache):
    every later query still attends it, so every output is NaN for that KV group, as in onnxruntime."""
    rng = np.random.default_rng(5)
    cfg = G.Gqa(num_heads=H, kv_num_heads=HKV, head_size=D, extra=CFG.extra)
    runs = []
    for ours in (False, True):
        sess = gqa_session(-1, ours, select)
        stepper = G.Stepper(sess, cfg, batch=1, buffer=64, shared=shared)
        rng = np.random.default_rng(5)
        outs = []
        for start, s in ((0, 40), (40, 1), (41, 1), (42, 3)):
            q, k, v = (rng.standard_normal((1, s, w), dtype=np.float32) for w in (H * D, HKV * D, HKV * D))
            if start == 0:
                k[0, 17, D + 2] = np.nan  # KV head 1, key 17
            total = start + s
            bias = rng.standard_normal((1, H, s, total), dtype=np.float32)
            sink = rng.standard_normal(H).astype(np.float32)
            outs.append(stepper.step(q, k, v, [total - 1], total if start else s, attention_bias=bias, head_sink=sink))
        runs.append(outs)
    for step, (theirs, ours) in enumerate(zip(*runs)):
        assert_same_nonfinite(ours, theirs, f"{select} step {step}", finite_values=select == "none")
        assert np.isnan(theirs.reshape(theirs.shape[0], theirs.shape[1], H, D)[:, -1, 2:]).all()


# ---------------------------------------------------------------- PopcountAttention (4-D)

def onnx_attention_session(mask_type) -> ort.InferenceSession:
    f = TensorProto.FLOAT
    names = ["Q", "K", "V"] + (["M"] if mask_type is not None else [])
    inputs = [helper.make_tensor_value_info(n, f, None) for n in "QKV"]
    if mask_type is not None:
        inputs.append(helper.make_tensor_value_info("M", mask_type, None))
    node = helper.make_node("Attention", names, ["Y"])
    graph = helper.make_graph([node], "a", inputs, [helper.make_tensor_value_info("Y", f, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=10)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def popcount_session(mask_type, select: str) -> ort.InferenceSession:
    f = TensorProto.FLOAT
    names = ["Q", "K", "V"] + (["M"] if mask_type is not None else [])
    inputs = [helper.make_tensor_value_info(n, f, None) for n in "QKV"]
    if mask_type is not None:
        inputs.append(helper.make_tensor_value_info("M", mask_type, None))
    attrs = {k: v for k, v in SELECT[select].items()}
    node = helper.make_node("PopcountAttention", names, ["Y"], domain="ai.ortsparse", name="attn", **attrs)
    graph = helper.make_graph([node], "a", inputs, [helper.make_tensor_value_info("Y", f, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.ortsparse", 1)],
                              ir_version=9)
    return ortsparse.inference_session(model.SerializeToString())


def attention_feeds(mask_type, skv: int, seed: int = 1) -> dict:
    rng = np.random.default_rng(seed)
    feeds = {"Q": rng.standard_normal((1, H, 3, D), dtype=np.float32),
             "K": rng.standard_normal((1, H, skv, D), dtype=np.float32),
             "V": rng.standard_normal((1, H, skv, D), dtype=np.float32)}
    if mask_type == TensorProto.BOOL:
        keep = rng.random((1, 1, 3, skv)) < 0.8
        keep[..., 0] = True  # no fully masked row
        feeds["M"] = keep
    elif mask_type == TensorProto.FLOAT:
        feeds["M"] = rng.standard_normal((1, H, 3, skv), dtype=np.float32)
    return feeds


MASKS = {"no_mask": None, "bool_mask": TensorProto.BOOL, "float_mask": TensorProto.FLOAT}


@pytest.mark.parametrize("select", ["none", "popcount", "pages", "energy"])
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("name,index", [("Q", (0, 1, 0, 2)), ("Q", (0, 3, 2, 7)), ("K", (0, 0, 5, 1)),
                                        ("K", (0, 2, 39, 0)), ("M", (0, 0, 1, 4)), ("M", (0, 0, 2, 0))])
def test_popcount_attention_nan_matches_onnx_attention(select, mask, name, index):
    """Q NaN gave 0 for its head before; a NaN K row or mask entry of an attended key gives NaN."""
    mask_type = MASKS[mask]
    if name == "M" and mask_type != TensorProto.FLOAT:
        pytest.skip("NaN needs a float mask")
    skv = 40 if select != "none" else 6
    if name == "K" and index[2] >= skv:
        pytest.skip("key outside this case")
    feeds = attention_feeds(mask_type, skv)
    feeds[name] = feeds[name].copy()
    if mask_type == TensorProto.FLOAT and name == "M":
        feeds["M"][index[0], index[1] + 1, index[2], index[3]] = np.nan  # one head only
    else:
        feeds[name][index] = np.nan
    theirs = onnx_attention_session(mask_type).run(None, feeds)[0]
    ours = popcount_session(mask_type, select).run(None, feeds)[0]
    assert np.isnan(theirs).any()
    assert_same_nonfinite(ours, theirs, f"{select} {mask} {name}{list(index)}", finite_values=select == "none")


@pytest.mark.parametrize("value", [np.nan, np.inf])
@pytest.mark.parametrize("mask", list(MASKS))
def test_popcount_attention_exact_nonfinite_value_matches_onnx_attention(mask, value):
    """A non-finite V entry of a masked key reaches its column too (0·NaN), as in onnxruntime."""
    mask_type = MASKS[mask]
    feeds = attention_feeds(mask_type, 6)
    feeds["V"][0, 1, 4, 3] = value
    if mask_type == TensorProto.BOOL:
        feeds["M"][..., 4] = False
    elif mask_type == TensorProto.FLOAT:
        feeds["M"][:, :, :, 4] = -np.inf
    theirs = onnx_attention_session(mask_type).run(None, feeds)[0]
    ours = popcount_session(mask_type, "none").run(None, feeds)[0]
    assert_same_nonfinite(ours, theirs, f"{mask} V={value}")


def test_popcount_attention_causal_nan_value_outside_the_range_reaches_its_column():
    """is_causal (bottom-right): query 0 of 3 over 6 keys does not attend keys 4, 5; onnxruntime's
    attention multiplies their V rows by 0, so a NaN there is NaN in that column of every query."""
    feeds = attention_feeds(None, 6)
    feeds["V"][0, 2, 5, 6] = np.nan
    model = helper.make_model(helper.make_graph(
        [helper.make_node("PopcountAttention", ["Q", "K", "V"], ["Y"], domain="ai.ortsparse", name="attn",
                          select="none", is_causal=1)], "a",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in "QKV"],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)]),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.ortsparse", 1)], ir_version=9)
    y = ortsparse.inference_session(model.SerializeToString()).run(None, feeds)[0]
    nan = np.isnan(y)
    assert nan[0, 2, :, 6].all() and nan.sum() == 3


# ---------------------------------------------------------------- every ISA

@pytest.mark.parametrize("isa", ISAS)
def test_every_isa_propagates_nan_the_same_way(isa):
    """The cases above under each ISA's kernels (ORTSPARSE_ISA is read once per process)."""
    run_file_under_isa(__file__, isa)


def test_gqa_without_sink_gives_nan_where_onnxruntime_plain_softmax_gives_zero():
    """Without head_sink and smooth_softmax, onnxruntime 1.32's softmax (MLAS) returns 0 for some rows
    holding a NaN score — which ones depends on where the NaN falls (here: a row whose only key, or
    last key, scores NaN). The op gives NaN there, as onnxruntime's sink path does on the same
    softmax (head_sink = -inf adds exp(-inf) = 0): a 0 would be the silent wrong answer of issue 23."""
    cfg = G.Gqa(num_heads=2, kv_num_heads=2, head_size=8, past=False)
    sink_cfg = dataclasses.replace(cfg, extra=("head_sink",))
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 6, 16), dtype=np.float32) for _ in range(3))
    q[0, 0, 4] = np.nan  # row 0, head 0: its only key scores NaN
    k[0, 1, 4] = np.nan  # key 1, head 0: the last key of row 1, inside rows 2..5
    feeds = {"query": q, "key": k, "value": v, "seqlens_k": np.array([5], np.int32),
             "total_sequence_length": np.array([6], np.int32)}
    plain = G.session(cfg, ours=False).run(None, feeds)[0].reshape(6, 2, 8)
    sink = G.session(sink_cfg, ours=False).run(None, {**feeds, "head_sink": np.full(2, -np.inf, np.float32)})[0]
    ours = G.session(cfg, ours=True, select="none").run(None, feeds)[0]
    assert (plain[:2, 0] == 0).all() and np.isnan(plain[2:, 0]).all()  # the MLAS behaviour deviated from
    assert np.isnan(ours.reshape(6, 2, 8)[:, 0]).all()
    assert_same_nonfinite(ours, sink, "no sink vs onnxruntime's sink path")


@pytest.mark.parametrize("phase", ["prompt", "decode"])
@pytest.mark.parametrize("sink", [0.5, np.inf, np.nan])
def test_gqa_all_masked_row_with_a_sink_is_zero_weights_times_v(phase, sink):
    """Every key of a row masked by attention_bias = -inf: with a finite sink the keys' weights are 0,
    so y = 0·V — NaN in the column of a NaN V entry, 0 elsewhere; a +inf or NaN sink gives NaN."""
    feeds = gqa_feeds(phase)
    s = feeds["query"].shape[1]
    feeds["attention_bias"][0, 1, s - 1, :] = -np.inf
    feeds["head_sink"][1] = sink
    feeds["value"][0, 0, 5] = np.nan  # KV head 0 (query heads 0, 1), column 5
    theirs = gqa_session(-1, False).run(None, feeds)[0]
    ours = gqa_session(-1, True).run(None, feeds)[0]
    assert_same_nonfinite(ours, theirs, f"sink={sink} {phase}")
    row = ours.reshape(1, s, H, D)[0, s - 1, 1]
    assert np.isnan(row).all() if not np.isfinite(sink) else (np.isnan(row[5]) and (np.delete(row, 5) == 0).all())
