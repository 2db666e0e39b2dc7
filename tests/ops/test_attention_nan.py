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
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
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


# ---------------------------------------------------------------- prompts (the tiled path)
# A prompt (>= prefill_rows query rows) is computed exactly whatever `select` says. A NaN / Inf moves
# only the rows that read it to the row path: every other row, head and batch entry is computed as
# without it, bit for bit, and the rows that read it get what exact attention gives (issue 36: one
# NaN used to send the whole call row by row, where rows with >= min_keys keys selected).

def sink_reference(cfg: G.Gqa, feeds: dict) -> np.ndarray:
    """onnxruntime's GroupQueryAttention through its sink path (head_sink = -inf adds exp(-inf) = 0),
    whose NaN handling is the op's contract (see the test at the end of the file)."""
    theirs_cfg = dataclasses.replace(cfg, extra=cfg.extra + ("head_sink",))
    sink = {"head_sink": np.full(cfg.num_heads, -np.inf, np.float32)}
    return G.session(theirs_cfg, ours=False).run(None, {**feeds, **sink})[0]


def untouched_rows_equal(ours: np.ndarray, clean: np.ndarray, heads: int, what: str) -> None:
    """Every (entry, position, head) output row holding no NaN / Inf is bit for bit the NaN-free call's."""
    rows = ours.reshape(ours.shape[0], ours.shape[1], heads, -1)
    untouched = np.isfinite(rows).all(axis=-1)
    same = rows[untouched] == clean.reshape(rows.shape)[untouched]
    assert same.all(), f"{what}: rows the non-finite input does not reach changed ({(~same.all(axis=-1)).sum()} rows)"


def test_one_nan_in_a_long_prompt_changes_no_other_row():
    """The reported case: PopcountGroupQueryAttention with its defaults (select=pages, min_keys 2048),
    a 2600-token prompt, NaN in one element of the last key: only the last row of that key's KV
    group is NaN; rows 2047.. of every head used to differ from GroupQueryAttention by up to 0.26."""
    cfg = G.Gqa(num_heads=4, kv_num_heads=2, head_size=16, past=False)
    s = 2600
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, s, w), dtype=np.float32) for w in (cfg.hidden, cfg.kv_hidden, cfg.kv_hidden))
    sess = G.session(cfg, ours=True)
    feeds = {"query": q, "key": k, "value": v, "seqlens_k": np.array([s - 1], np.int32),
             "total_sequence_length": np.array([s], np.int32)}
    clean = sess.run(None, feeds)[0]
    k = k.copy()
    k[0, s - 1, 16 + 3] = np.nan  # KV head 1: query heads 2, 3
    feeds["key"] = k
    ours = sess.run(None, feeds)[0]
    assert_same_nonfinite(ours, sink_reference(cfg, feeds), "defaults, 2600-token prompt")
    assert np.isnan(ours.reshape(s, 4, 16)[s - 1, 2:]).all()
    untouched_rows_equal(ours, clean, cfg.num_heads, "defaults, 2600-token prompt")


def test_one_nan_in_a_long_4d_prompt_changes_no_other_row():
    """The same on PopcountAttention with its defaults (select=popcount, min_keys 1024, topk 256),
    causal, 1300 query rows over 1300 keys, against the float64 reference."""
    from . import attention_reference as ref
    h, hkv, s, d = 4, 2, 1300, 16
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, h, s, d), dtype=np.float32)
    k = rng.standard_normal((1, hkv, s, d), dtype=np.float32)
    v = rng.standard_normal((1, hkv, s, d), dtype=np.float32)
    sess = ortsparse.inference_session(ref.attention_model(is_causal=1))
    clean = sess.run(None, {"Q": q, "K": k, "V": v})[0]
    k[0, 1, s - 1, 3] = np.nan
    ours = sess.run(None, {"Q": q, "K": k, "V": v})[0]
    assert_same_nonfinite(ours, ref.attention(q, k, v, causal=True).astype(np.float32), "4-D defaults")
    assert np.isnan(ours[0, 2:, s - 1]).all()
    untouched_rows_equal(ours.transpose(0, 2, 1, 3), clean.transpose(0, 2, 1, 3), h, "4-D defaults")


PROPERTY = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])
# Selectors that would select rows past 16 keys, if a prompt row were not exact.
PROMPT_SELECT = {
    "pages": {"select": "pages", "topk": 4, "candidates": 2.0, "page_size": 4, "min_keys": 16, "keep_first": 1,
              "keep_recent": 2},
    "pages_certified": {"select": "pages", "topk": 4, "candidates": 0.0, "page_size": 4, "min_keys": 16},
    "popcount": {"select": "popcount", "topk": 4, "candidates": 2.0, "min_keys": 16, "keep_first": 1,
                 "keep_recent": 2},
    "energy": {"select": "energy", "topk": 4, "min_keys": 16},
    "none": {"select": "none"},
}


@st.composite
def poisoned_prompt(draw):
    """A GroupQueryAttention prompt call (a first prompt, or a later chunk over a past) with one to
    three non-finite entries at random places of query, key, value, past_key, past_value or
    attention_bias."""
    heads, kv_heads = draw(st.sampled_from([(4, 2), (4, 1), (2, 2), (6, 3)]))
    head_size = draw(st.sampled_from([8, 16]))
    window = draw(st.sampled_from([-1, -1, 3, 17, 70]))
    bias = draw(st.booleans())
    cfg = G.Gqa(num_heads=heads, kv_num_heads=kv_heads, head_size=head_size, local_window=window,
                extra=("attention_bias",) if bias else ())
    s = draw(st.integers(16, 150))
    past = draw(st.sampled_from([0, 0, 1, 40, 100]))
    sites = []
    names = ["query", "key", "value"] + (["past_key", "past_value"] if past else []) + (["attention_bias"] if bias else [])
    for _ in range(draw(st.integers(1, 3))):
        name = draw(st.sampled_from(names))
        shape = {"query": (1, s, cfg.hidden), "key": (1, s, cfg.kv_hidden), "value": (1, s, cfg.kv_hidden),
                 "past_key": (1, kv_heads, past, head_size), "past_value": (1, kv_heads, past, head_size),
                 "attention_bias": (1, heads, s, past + s)}[name]
        index = tuple(draw(st.integers(0, n - 1)) for n in shape)
        sites.append((name, index, draw(st.sampled_from([np.nan, np.inf, -np.inf]))))
    return cfg, s, past, sites, draw(st.sampled_from(sorted(PROMPT_SELECT))), draw(st.integers(0, 2**31))


@functools.lru_cache(maxsize=None)
def prompt_session(cfg: G.Gqa, select: str) -> ort.InferenceSession:
    return G.session(cfg, ours=True, pack_cache=0, **PROMPT_SELECT[select])


def gqa_reference(cfg: G.Gqa, feeds: dict) -> np.ndarray:
    """GroupQueryAttention's output by the float64 reference of the 4-D op (attention_reference.py;
    its NaN / Inf semantics are the contract's): one entry, past rows then the new ones, causal,
    the local window as the keys kept, attention_bias added."""
    from . import attention_reference as ref
    _, s, _ = feeds["query"].shape
    h, hkv, d = cfg.num_heads, cfg.kv_num_heads, cfg.head_size
    past = feeds["past_key"].shape[2]
    q = feeds["query"].reshape(1, s, h, d).transpose(0, 2, 1, 3)
    k, v = (np.concatenate([feeds[f"past_{n}"], feeds[n].reshape(1, s, hkv, d).transpose(0, 2, 1, 3)], axis=2)
            for n in ("key", "value"))
    keep = None
    if cfg.local_window >= 0:
        first = past + np.arange(s)[:, None] - cfg.local_window + 1
        keep = np.broadcast_to(np.arange(past + s)[None, :] >= first, (1, h, s, past + s))
    with np.errstate(invalid="ignore"):  # inf - inf in the reference: the NaN it is asked for
        y = ref.attention(q, k, v, feeds.get("attention_bias"), causal=True, keep=keep)
    return y.transpose(0, 2, 1, 3).reshape(1, s, h * d).astype(np.float32)


@PROPERTY
@given(poisoned_prompt())
def test_property_nan_in_a_prompt_reaches_exactly_what_exact_attention_reaches(case):
    cfg, s, past, sites, select, seed = case
    rng = np.random.default_rng(seed)
    total = past + s
    feeds = {"query": rng.standard_normal((1, s, cfg.hidden), dtype=np.float32),
             "key": rng.standard_normal((1, s, cfg.kv_hidden), dtype=np.float32),
             "value": rng.standard_normal((1, s, cfg.kv_hidden), dtype=np.float32),
             "past_key": rng.standard_normal((1, cfg.kv_num_heads, past, cfg.head_size), dtype=np.float32),
             "past_value": rng.standard_normal((1, cfg.kv_num_heads, past, cfg.head_size), dtype=np.float32),
             "seqlens_k": np.array([total - 1], np.int32), "total_sequence_length": np.array([total], np.int32)}
    if cfg.extra:
        feeds["attention_bias"] = rng.standard_normal((1, cfg.num_heads, s, total), dtype=np.float32)
    sess = prompt_session(cfg, select)
    clean = sess.run(None, feeds)[0]
    for name, index, value in sites:
        feeds[name] = feeds[name].copy()
        feeds[name][index] = value
    ours = sess.run(None, feeds)[0]
    what = f"select={select} {cfg} S={s} past={past} sites={sites}"
    assert_same_nonfinite(ours, gqa_reference(cfg, feeds), what)
    if all(np.isnan(value) for _, _, value in sites):  # a NaN reaches every row that reads it
        untouched_rows_equal(ours, clean, cfg.num_heads, what)


@PROPERTY
@given(h_hkv=st.sampled_from([(4, 2), (2, 1), (3, 3)]), sq=st.integers(16, 90), extra_keys=st.integers(0, 40),
       causal=st.booleans(), mask=st.sampled_from([None, "float", "bool"]), select=st.sampled_from(sorted(PROMPT_SELECT)),
       n_sites=st.integers(1, 3), seed=st.integers(0, 2**31))
def test_property_nan_in_a_4d_prompt_reaches_exactly_what_exact_attention_reaches(h_hkv, sq, extra_keys, causal, mask,
                                                                                  select, n_sites, seed):
    """PopcountAttention: a prompt of sq >= 16 rows over sq + extra_keys keys, NaN / Inf at random
    entries of Q, K, V (and a float mask), against the float64 reference."""
    from . import attention_reference as ref
    h, hkv = h_hkv
    skv, d = sq + extra_keys, 8
    rng = np.random.default_rng(seed)
    feeds = {"Q": rng.standard_normal((1, h, sq, d), dtype=np.float32),
             "K": rng.standard_normal((1, hkv, skv, d), dtype=np.float32),
             "V": rng.standard_normal((1, hkv, skv, d), dtype=np.float32)}
    mask_type = None
    if mask == "float":
        mask_type, feeds["attn_mask"] = TensorProto.FLOAT, rng.standard_normal((1, h, sq, skv), dtype=np.float32)
    elif mask == "bool":
        mask_type, feeds["attn_mask"] = TensorProto.BOOL, rng.random((1, 1, sq, skv)) < 0.8
    attrs = {key: value for key, value in PROMPT_SELECT[select].items()}
    sess = ortsparse.inference_session(ref.attention_model(mask_type=mask_type, is_causal=int(causal), **attrs))
    clean = sess.run(None, feeds)[0]
    names = ["Q", "K", "V"] + (["attn_mask"] if mask == "float" else [])
    sites = []
    for _ in range(n_sites):
        name = names[int(rng.integers(len(names)))]
        index = tuple(int(rng.integers(n)) for n in feeds[name].shape)
        value = [np.nan, np.inf, -np.inf][int(rng.integers(3))]
        feeds[name] = feeds[name].copy()
        feeds[name][index] = value
        sites.append((name, index, value))
    ours = sess.run(None, feeds)[0]
    with np.errstate(invalid="ignore"):  # inf - inf in the reference: the NaN it is asked for
        want = ref.attention(feeds["Q"], feeds["K"], feeds["V"], feeds.get("attn_mask"), causal=causal)
    what = f"select={select} causal={causal} mask={mask} sq={sq} skv={skv} sites={sites}"
    assert_same_nonfinite(ours, want.astype(np.float32), what)
    if all(np.isnan(value) for _, _, value in sites):  # a NaN reaches every row that reads it
        untouched_rows_equal(ours.transpose(0, 2, 1, 3), clean.transpose(0, 2, 1, 3), h, what)


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
