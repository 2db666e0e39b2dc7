"""The tiled (flash) prompt path of PopcountGroupQueryAttention / PopcountAttention: the
flash_tile kernel on every ISA against its scalar twin and a float64 softmax (tails of rows, keys
and value columns; NaN-filled scratch), and whole calls against onnxruntime's GroupQueryAttention
and the row path (prefill_rows=0) — causal, local window, soft-cap, attention_bias, head_sink,
batches with different lengths, later prompt chunks over a past, non-finite inputs."""
from __future__ import annotations

import numpy as np
import pytest

from ortsparse import _kernels as K

from . import gqa_graphs as G
from .isa_runs import run_file_under_isa

ISAS = K.supported_isas()
TILE = K.FLASH_KEYS


def softmax_reference(q, keys, values, scale, softcap=0.0, bias=None, lo=None, hi=None):
    """Per row: (max, sum of exp(s - max), unnormalised output) in float64; -inf max: no key."""
    s = (q.astype(np.float64) @ keys.astype(np.float64).T) * scale
    if softcap:
        s = softcap * np.tanh(s / softcap)
    if bias is not None:
        s = s + bias
    if lo is not None:
        j = np.arange(keys.shape[0])[None, :]
        s = np.where((j >= lo[:, None]) & (j < hi[:, None]), s, -np.inf)
    mx = s.max(axis=1)
    safe = np.where(np.isfinite(mx), mx, 0.0)
    e = np.exp(s - safe[:, None])
    return mx, e.sum(axis=1), e @ values.astype(np.float64)


def run_tiles(isa, q, keys, values, scale, softcap=0.0, bias=None, lo=None, hi=None):
    """The kernel over every TILE-key tile of keys in order (the running state carried over)."""
    m, dv = q.shape[0], values.shape[1]
    row_max = np.full(m, -np.inf, np.float32)
    row_sum = np.zeros(m, np.float32)
    o = np.zeros((m, dv), np.float32)
    for t0 in range(0, keys.shape[0], TILE):
        t1 = min(t0 + TILE, keys.shape[0])
        kw = {}
        if bias is not None:
            kw["bias"] = np.ascontiguousarray(bias[:, t0:t1])
        if lo is not None:
            kw["lo"] = np.clip(lo - t0, 0, t1 - t0).astype(np.int32)
            kw["hi"] = np.maximum(np.clip(hi - t0, 0, t1 - t0), kw["lo"]).astype(np.int32)
        row_max, row_sum, o = K.flash_tile(isa, q, keys[t0:t1], values[t0:t1], scale, softcap, row_max=row_max,
                                           row_sum=row_sum, o=o, **kw)
    return row_max, row_sum, o


def check_against_reference(got, want):
    mx, sm, o = got
    rmx, rsm, ro = want
    live = np.isfinite(rmx)
    assert np.array_equal(np.isfinite(mx), live)
    # compare the normalised outputs (the running max may differ by rounding only)
    y = o[live] / sm[live, None]
    ry = ro[live] / rsm[live, None]
    np.testing.assert_allclose(y, ry, rtol=0, atol=2e-6 * max(1.0, np.abs(ry).max()))
    np.testing.assert_allclose(mx[live], rmx[live], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", list(range(1, 14)))  # row groups of 6 (AVX-512) / 2 (AVX2): 1..2*6+1
@pytest.mark.parametrize("n", [1, 15, 17, 31, 33, 63, 64])
def test_flash_tile_rows_and_keys_tails(isa, m, n):
    rng = np.random.default_rng(m * 100 + n)
    d, dv = 24, 40
    q = rng.standard_normal((m, d), dtype=np.float32)
    keys = rng.standard_normal((n, d), dtype=np.float32)
    values = rng.standard_normal((n, dv), dtype=np.float32)
    got = run_tiles(isa, q, keys, values, 0.3)
    check_against_reference(got, softmax_reference(q, keys, values, 0.3))
    scalar = run_tiles("scalar", q, keys, values, 0.3)
    np.testing.assert_allclose(got[2] / got[1][:, None], scalar[2] / scalar[1][:, None], rtol=0, atol=2e-6)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dv", [1, 7, 8, 9, 15, 16, 17, 33, 63, 64, 65, 100, 129])  # value chunks of 64 / 32: tails
@pytest.mark.parametrize("d", [1, 5, 64])
def test_flash_tile_value_column_tails(isa, dv, d):
    rng = np.random.default_rng(dv * 7 + d)
    m, n = 6, 50
    q = rng.standard_normal((m, d), dtype=np.float32)
    keys = rng.standard_normal((n, d), dtype=np.float32)
    values = rng.standard_normal((n, dv), dtype=np.float32)
    got = run_tiles(isa, q, keys, values, 1.0 / np.sqrt(d))
    check_against_reference(got, softmax_reference(q, keys, values, 1.0 / np.sqrt(d)))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("n_keys", [1, 64, 65, 129, 200])  # 1..2*TILE+1 keys over several tiles
def test_flash_tile_online_softmax_over_tiles_with_ranges_bias_softcap(isa, n_keys):
    rng = np.random.default_rng(n_keys)
    m, d, dv = 9, 32, 48
    q = rng.standard_normal((m, d), dtype=np.float32) * 2
    keys = rng.standard_normal((n_keys, d), dtype=np.float32)
    values = rng.standard_normal((n_keys, dv), dtype=np.float32)
    lo = rng.integers(0, n_keys, m).astype(np.int32)
    hi = np.minimum(n_keys, lo + rng.integers(0, n_keys + 1, m)).astype(np.int32)
    hi[0] = lo[0]  # a row with no key: stays at -inf, output untouched
    bias = np.where(rng.random((m, n_keys)) < 0.2, -np.inf, rng.standard_normal((m, n_keys))).astype(np.float32)
    for kw in ({"lo": lo, "hi": hi}, {"softcap": 5.0}, {"bias": bias}, {"bias": bias, "softcap": 3.0, "lo": lo, "hi": hi}):
        got = run_tiles(isa, q, keys, values, 0.25, **kw)
        check_against_reference(got, softmax_reference(q, keys, values, 0.25, **kw))
        if "lo" in kw:
            assert got[0][0] == -np.inf and not got[2][0].any()


def test_flash_tile_refuses_bad_shapes():
    q = np.zeros((2, 4), np.float32)
    with pytest.raises(ValueError):
        K.flash_tile("scalar", q, np.zeros((TILE + 1, 4), np.float32), np.zeros((TILE + 1, 3), np.float32), 1.0,
                     row_max=np.zeros(2, np.float32), row_sum=np.zeros(2, np.float32), o=np.zeros((2, 3), np.float32))


# --- whole calls ---------------------------------------------------------------------------------

def gqa_prompt(cfg, s, seed=0, batch=1, **feeds_extra):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, s, cfg.hidden), dtype=np.float32)
    k = rng.standard_normal((batch, s, cfg.kv_hidden), dtype=np.float32)
    v = rng.standard_normal((batch, s, cfg.kv_hidden), dtype=np.float32)
    return q, k, v


def run_three(cfg, q, k, v, seqlens, total, feeds=None, **attrs):
    """onnxruntime's op, ours tiled, ours row by row (prefill_rows=0) on one first-prompt call."""
    feeds = feeds or {}
    outs = []
    for ours, extra in ((False, {}), (True, {}), (True, {"prefill_rows": 0})):
        sess = G.session(cfg, ours=ours, **({"select": "none", **attrs, **extra} if ours else {}))
        st = G.Stepper(sess, cfg, batch=q.shape[0], buffer=0, shared=False)
        outs.append(st.step(q, k, v, seqlens, total, **feeds))
    return outs


CASES = {
    "causal": dict(),
    "window": dict(local_window=45),
    "window-short": dict(local_window=3),
    "softcap": dict(softcap=20.0),
    "bias": dict(extra=("attention_bias",)),
    "sink": dict(extra=("head_sink",)),
    "mha": dict(num_heads=4, kv_num_heads=4),
    "d80": dict(head_size=80),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_tiled_prompt_matches_onnxruntime_and_the_row_path(case):
    spec = dict(num_heads=9, kv_num_heads=3, head_size=32, past=False)
    spec.update(CASES[case])
    cfg = G.Gqa(**spec)
    s = 203  # several query blocks and key tiles, ragged ends
    q, k, v = gqa_prompt(cfg, s)
    rng = np.random.default_rng(1)
    feeds = {}
    if "attention_bias" in cfg.extra:
        bias = np.where(rng.random((1, cfg.num_heads, s, s)) < 0.3, -np.inf, rng.standard_normal((1, cfg.num_heads, s, s)))
        bias[..., 0] = 0.0
        feeds["attention_bias"] = bias.astype(np.float32)
    if "head_sink" in cfg.extra:
        feeds["head_sink"] = rng.standard_normal(cfg.num_heads).astype(np.float32)
    theirs, tiled, rows = run_three(cfg, q, k, v, [s - 1], s, feeds)
    scale = np.abs(theirs).max()
    assert np.abs(tiled - theirs).max() <= 1e-5 * scale
    assert np.abs(tiled - rows).max() <= 1e-5 * scale


def test_a_selecting_prompt_is_computed_exactly_and_prefill_rows_0_selects_it():
    """select=pages: a 300-row prompt (>= prefill_rows) is exact, every row (tiled, within float
    rounding of select=none) and its keys are still summarised for the decode steps after it;
    prefill_rows=0 selects row by row as decode steps do (what quality measurement uses)."""
    import ortsparse
    cfg = G.Gqa(num_heads=4, kv_num_heads=2, head_size=16, past=False)
    s = 300
    q, k, v = gqa_prompt(cfg, s)
    outs, metrics = {}, {}
    for rows in (0, 64):
        sess = G.session(cfg, ours=True, node_name=f"n{rows}", select="pages", topk=8, min_keys=96, candidates=1.0,
                         keep_first=0, keep_recent=0, prefill_rows=rows)
        outs[rows] = G.Stepper(sess, cfg, batch=1, buffer=0, shared=False).step(q, k, v, [s - 1], s)
        metrics[rows] = ortsparse.metrics()[f"PopcountGroupQueryAttention/n{rows}"]
    assert metrics[64]["pack.keys_exact_ratio"] == 1.0 > metrics[0]["pack.keys_exact_ratio"]
    assert metrics[64]["keys_packed"] == metrics[0]["keys_packed"] > 0  # the key cache is built either way
    _, tiled, by_rows = run_three(cfg, q, k, v, [s - 1], s)
    np.testing.assert_allclose(outs[64], tiled, rtol=0, atol=1e-5)  # exact, like select=none
    assert np.abs(outs[0][:, 96:] - by_rows[:, 96:]).max() > 1e-3  # the selecting rows differ from exact
    np.testing.assert_allclose(tiled, by_rows, rtol=0, atol=1e-5)


def test_tiled_prompt_batches_of_different_lengths_and_a_later_chunk():
    """B = 3 first prompts with padding (seqlens_k differ), then a later 96-row chunk over a past."""
    cfg = G.Gqa(num_heads=6, kv_num_heads=2, head_size=32, past=True)
    b, s, buffer = 3, 130, 300
    lengths = [130, 77, 1]
    outs = []
    for ours in (False, True):
        sess = G.session(cfg, ours=ours, **({"select": "none"} if ours else {}))
        st = G.Stepper(sess, cfg, batch=b, buffer=buffer, shared=True)
        q = np.random.default_rng(4).standard_normal((b, s, cfg.hidden), dtype=np.float32)
        k = np.random.default_rng(5).standard_normal((b, s, cfg.kv_hidden), dtype=np.float32)
        v = np.random.default_rng(6).standard_normal((b, s, cfg.kv_hidden), dtype=np.float32)
        first = st.step(q, k, v, [n - 1 for n in lengths], s)
        # valid rows only: onnxruntime leaves padded rows of a shorter entry unspecified
        outs.append([first[i, :n] for i, n in enumerate(lengths)])
    for theirs, ours in zip(*outs):
        assert np.abs(ours - theirs).max() <= 1e-5 * np.abs(theirs).max()
    # a later prompt chunk (B = 1) over a 150-row past
    outs = []
    for ours in (False, True):
        sess = G.session(cfg, ours=ours, **({"select": "none"} if ours else {}))
        st = G.Stepper(sess, cfg, batch=1, buffer=buffer, shared=True)
        draw = np.random.default_rng(10)
        for rows, seqlen in ((150, 149), (96, 245)):
            q = draw.standard_normal((1, rows, cfg.hidden), dtype=np.float32)
            k = draw.standard_normal((1, rows, cfg.kv_hidden), dtype=np.float32)
            v = draw.standard_normal((1, rows, cfg.kv_hidden), dtype=np.float32)
            out = st.step(q, k, v, [seqlen], seqlen + 1)
        outs.append(out)
    assert np.abs(outs[1] - outs[0]).max() <= 1e-5 * np.abs(outs[0]).max()


@pytest.mark.parametrize("where", ["q", "k", "v", "bias"])
def test_tiled_prompt_leaves_only_the_rows_that_read_a_non_finite_input_to_the_row_path(where):
    """NaN / Inf semantics belong to the row path, for the rows that read the NaN: NaN where the row
    path (prefill_rows=0) has NaN, the finite entries within rounding of it — and every row whose
    output holds no NaN is still the tiled kernel's, bit for bit what it gives without the NaN."""
    cfg = G.Gqa(num_heads=4, kv_num_heads=2, head_size=16, past=False, extra=("attention_bias",))
    s = 100
    q, k, v = gqa_prompt(cfg, s)
    bias = np.zeros((1, 1, s, s), np.float32)
    _, clean, _ = run_three(cfg, q, k, v, [s - 1], s, {"attention_bias": bias})
    {"q": q, "k": k, "v": v}.get(where, bias.reshape(1, s, s))[0, 40, 3] = np.nan
    _, tiled, rows = run_three(cfg, q, k, v, [s - 1], s, {"attention_bias": bias})
    np.testing.assert_array_equal(np.isnan(tiled), np.isnan(rows))
    np.testing.assert_allclose(tiled, rows, rtol=0, atol=1e-5 * np.abs(clean).max())
    heads = tiled.reshape(s, cfg.num_heads, cfg.head_size)
    untouched = ~np.isnan(heads).any(axis=-1)  # (position, head) rows the NaN does not reach
    assert untouched.any() and not untouched.all()
    np.testing.assert_array_equal(heads[untouched], clean.reshape(s, cfg.num_heads, cfg.head_size)[untouched])


# --- the 4-D PopcountAttention ----------------------------------------------------------------------

MASKS_4D = [None, ("bool", (2, 4, 40, 90)), ("float", (1, 4, 1, 90)), ("float", (40, 90)), ("finfo", (1, 1, 40, 90)),
            ("empty-row", (2, 1, 40, 90))]


@pytest.mark.parametrize("mask_spec", MASKS_4D, ids=lambda m: "none" if m is None else f"{m[0]}{list(m[1])}")
@pytest.mark.parametrize("causal", [0, 1])
@pytest.mark.parametrize("h,hkv", [(4, 4), (4, 2), (4, 1)])
def test_tiled_4d_attention_matches_the_float64_reference_and_the_row_path(mask_spec, causal, h, hkv):
    from . import attention_reference as ref
    from .test_popcount_attention import exact_model, qkv, run
    rng = np.random.default_rng(11)
    q, k, v = qkv(rng, 2, h, hkv, 40, 90, 24, dv=33)
    mask = None
    if mask_spec is not None:
        kind, shape = mask_spec
        if kind == "bool":
            mask = rng.random(shape) < 0.7
        elif kind == "float":
            mask = np.where(rng.random(shape) < 0.3, -np.inf, rng.standard_normal(shape)).astype(np.float32)
        elif kind == "finfo":
            mask = np.zeros(shape, np.float32)
            mask[..., 50:] = np.finfo(np.float32).min
        else:  # every key of query row 7 masked out: y = 0
            mask = np.ones(shape, bool)
            mask[:, :, 7] = False
    tiled = run(exact_model(mask, is_causal=causal), q, k, v, mask)
    rows = run(exact_model(mask, is_causal=causal, prefill_rows=0), q, k, v, mask)
    np.testing.assert_allclose(tiled, ref.attention(q, k, v, mask, causal=bool(causal)), rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(tiled, rows, rtol=1e-5, atol=2e-6)
    if mask_spec is not None and mask_spec[0] == "empty-row":
        assert not tiled[:, :, 7].any()


def test_tiled_4d_causal_with_more_queries_than_keys_gives_zero_rows():
    from . import attention_reference as ref
    from .test_popcount_attention import exact_model, qkv, run
    rng = np.random.default_rng(12)
    q, k, v = qkv(rng, 1, 2, 1, 70, 30, 16)
    y = run(exact_model(is_causal=1), q, k, v)
    assert not y[:, :, :40].any()  # query i sits at position 30 - 70 + i: the first 40 see no key
    np.testing.assert_allclose(y, ref.attention(q, k, v, causal=True), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("ours_4d", [False, True])
def test_negative_prefill_rows_is_a_clear_error(ours_4d):
    from . import attention_reference as ref
    if ours_4d:
        with pytest.raises(Exception, match="prefill_rows=-1 must be >= 0"):
            import ortsparse
            ortsparse.inference_session(ref.attention_model(prefill_rows=-1))
    else:
        with pytest.raises(Exception, match="prefill_rows=-1 must be >= 0"):
            G.session(G.Gqa(), ours=True, prefill_rows=-1)


@pytest.mark.parametrize("isa", ISAS)
def test_every_isa_computes_whole_calls_the_same_way(isa):
    """The whole-call cases above under each ISA's kernels (ORTSPARSE_ISA is read once per process;
    the flash_tile cases take the ISA as an argument)."""
    run_file_under_isa(__file__, isa, deselect="every_isa or flash_tile")
