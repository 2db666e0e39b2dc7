"""Selective prefill (prefill_select) on the tiled prompt path of PopcountAttention /
PopcountGroupQueryAttention: exact is today's path bit for bit; certified with eps = 0 is exact up to
float rounding, and with eps > 0 skips tiles only while the dropped softmax mass stays <= eps (the
output error bound holds, and skipping happened: prefill.skipped_ratio); budget keeps the sink and
recent tiles and the best-bound ones, matching a float64 reference of the same choice, and is
deterministic; bad attribute values are one-line errors naming the node."""
from __future__ import annotations

import math

import numpy as np
import pytest

import ortsparse
from ortsparse import _kernels as K

from . import attention_reference as ref
from . import gqa_graphs as G
from .isa_runs import ISAS, run_file_under_isa

TILE = K.FLASH_KEYS
BLOCK_ROWS = 64  # query rows per block of the tiled path (positions x the heads of a KV group)


def run4d(q, k, v, node="attn", threads=1, **attrs):
    """The 4-D op, causal, one call (every row a prompt row: the tiled path); (y, metrics)."""
    model = ref.attention_model(node_name=node, is_causal=1, **{"select": "none", **attrs})
    session = ortsparse.inference_session(model, intra_op_num_threads=threads)
    y = session.run(None, {"Q": q, "K": k, "V": v})[0]
    return y, ortsparse.metrics()[f"PopcountAttention/{node}"]


def tiled_keys(rng, h, hkv, s, d, offsets, alpha=4.0, noise=0.1):
    """Q along a direction u (plus noise), K tile t along offsets[t]·u (plus noise), V standard
    normal: a tile's scores, and its bound, grow with its offset."""
    u = rng.standard_normal(d)
    u /= np.linalg.norm(u)
    q = alpha * u + noise * rng.standard_normal((1, h, s, d))
    k = np.repeat(np.asarray(offsets, np.float64), TILE)[:s, None] * u + noise * rng.standard_normal((1, hkv, s, d))
    v = rng.standard_normal((1, hkv, s, d))
    return q.astype(np.float32), k.astype(np.float32), v.astype(np.float32)


def selected_tiles(q, k, budget_tiles, sink_keys=1, recent_keys=TILE, min_keys=0):
    """Per (kv head, block start): the tiles budget mode skips (float64 bounds), as the op chooses:
    selectable = tiles every row attends whole, past the sink keys and before every row's recent
    keys; a block with >= min_keys keys per row and more than budget_tiles (and >= 2) selectable
    keeps the budget_tiles best by max over its rows of sum_d max(q_d·min_d, q_d·max_d)."""
    _, h, s, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    bq = max(1, BLOCK_ROWS // g)
    skipped = {}
    for hk in range(hkv):
        keys = k[0, hk].astype(np.float64)
        for i0 in range(0, s, bq):
            hi_min = i0 + 1  # causal, skv == sq: position p attends keys [0, p]
            selectable = [t for t in range((s + TILE - 1) // TILE)
                          if t * TILE + TILE <= hi_min and t * TILE >= sink_keys and t * TILE + TILE + recent_keys <= hi_min]
            if hi_min < min_keys or len(selectable) < max(budget_tiles + 1, 2):
                skipped[hk, i0] = set()
                continue
            rows = q[0, hk * g:(hk + 1) * g, i0:i0 + bq].reshape(-1, d).astype(np.float64)
            bound = {}
            for t in selectable:
                tile = keys[t * TILE:(t + 1) * TILE]
                bound[t] = np.maximum(rows * tile.max(0), rows * tile.min(0)).sum(1).max()
            order = sorted(selectable, key=lambda t: (-bound[t], t))
            skipped[hk, i0] = set(order[budget_tiles:])
    return skipped


def attention_without(q, k, v, skipped, mask=None):
    """float64 causal attention, each block's rows without the keys of its skipped tiles (mask:
    [Sq, Skv] bool, False = not attended)."""
    _, h, s, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    bq = max(1, BLOCK_ROWS // g)
    y = np.zeros(q.shape, np.float64)
    for hh in range(h):
        hk = hh // g
        for i in range(s):
            drop = skipped[hk, i // bq * bq]
            j = np.array([j for j in range(i + 1) if j // TILE not in drop and (mask is None or mask[i, j])])
            sc = (k[0, hk, j].astype(np.float64) @ q[0, hh, i].astype(np.float64)) / math.sqrt(d)
            p = np.exp(sc - sc.max())
            y[0, hh, i] = (p / p.sum()) @ v[0, hk, j].astype(np.float64)
    return y


def test_exact_is_the_tiled_path_bit_for_bit_and_an_ineligible_block_too(rng):
    """prefill_select=exact (the default) is the path without the attribute; certified / budget
    on blocks that may not select (rows with fewer than min_keys keys) take that same path."""
    q, k, v = ref_qkv(rng, 6, 2, 300, 32)
    base, m_base = run4d(q, k, v, node="plain")
    same, _ = run4d(q, k, v, node="exact", prefill_select="exact")
    np.testing.assert_array_equal(same, base)
    for mode in ("certified", "budget"):
        y, m = run4d(q, k, v, node=f"off-{mode}", prefill_select=mode, prefill_eps=0.5, prefill_budget=0, min_keys=400)
        np.testing.assert_array_equal(y, base)
        assert m["prefill.tiles"] == m_base["prefill.tiles"] > 0 and m["prefill.skipped_ratio"] == 0
    np.testing.assert_allclose(base, ref.attention(q, k, v, causal=True), rtol=1e-5, atol=2e-6)


def ref_qkv(rng, h, hkv, s, d):
    return (rng.standard_normal((1, h, s, d)).astype(np.float32), rng.standard_normal((1, hkv, s, d)).astype(np.float32),
            rng.standard_normal((1, hkv, s, d)).astype(np.float32))


def test_certified_with_eps_0_visits_every_tile_and_is_exact(rng):
    q, k, v = tiled_keys(rng, 6, 2, 700, 32, rng.uniform(-3, 3, 11))
    exact, _ = run4d(q, k, v, node="e")
    y, m = run4d(q, k, v, node="c0", prefill_select="certified", prefill_eps=0.0, min_keys=0)
    assert m["prefill.skipped_ratio"] == 0
    assert np.abs(y - exact).max() <= 1e-6 * np.abs(exact).max()  # other tile order: rounding only


@pytest.mark.parametrize("eps", [1e-4, 1e-3, 1e-2])
def test_certified_skips_tiles_and_drops_at_most_eps_of_the_softmax_mass(eps, rng):
    """Tiles at graded distances from the queries; V's column 0 is 1 on the keys of the 'far'
    tiles (all but every third), 0 elsewhere, so column 0 of y is the softmax mass on far keys and
    dropping mass delta of them moves it by delta·(1 - F) / (1 - delta) <= delta / (1 - eps) (F: the
    far mass). Certified must skip tiles and keep every row's error in column 0 within that."""
    s, d = 1100, 32
    tiles = (s + TILE - 1) // TILE
    offsets = rng.uniform(-6.0, 7.0, tiles)
    near = np.arange(tiles) % 3 == 0
    offsets[near] = 8.0
    q, k, v = tiled_keys(rng, 6, 2, s, d, offsets, alpha=6.0)
    v[..., 0] = np.repeat(~near, TILE)[:s]
    exact = ref.attention(q, k, v, causal=True)
    y, m = run4d(q, k, v, node=f"cert{eps}", prefill_select="certified", prefill_eps=eps, min_keys=0)
    assert m["prefill.skipped_ratio"] > 0.05
    assert m["pack.keys_exact_ratio"] < 1.0
    err = np.abs(y[..., 0] - exact[..., 0]).max()
    assert err <= eps / (1 - eps) + 2e-6
    # skipping the same kind of tiles without the certificate (budget 0: sink and recent only)
    # moves the far mass far more: the data leave room to break the bound
    far, _ = run4d(q, k, v, node=f"far{eps}", prefill_select="budget", prefill_budget=0, min_keys=0)
    assert np.abs(far[..., 0] - exact[..., 0]).max() > 1.2 * eps


@pytest.mark.parametrize("h,hkv", [(6, 2), (4, 4), (64, 1)])
@pytest.mark.parametrize("budget", [0, 64, 150])
def test_budget_keeps_sink_recent_and_best_bound_tiles(h, hkv, budget, rng):
    """The best ceil(budget / 64) tiles by bound, the sink tile and every row's recent tiles: the
    output of a float64 reference of that choice, and prefill.skipped_ratio its skipped count."""
    s, d = 900, 16
    offsets = rng.permutation(np.linspace(-3.0, 3.0, (s + TILE - 1) // TILE))
    q, k, v = tiled_keys(rng, h, hkv, s, d, offsets)
    budget_tiles = -(-budget // TILE)
    skipped = selected_tiles(q, k, budget_tiles)
    want = attention_without(q, k, v, skipped)
    y, m = run4d(q, k, v, node=f"b{h}-{hkv}-{budget}", prefill_select="budget", prefill_budget=budget, min_keys=0)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=2e-6)
    bq = max(1, BLOCK_ROWS // (h // hkv))
    tiles = sum((min(i0 + bq, s) - 1) // TILE + 1 for i0 in range(0, s, bq)) * hkv
    n_skipped = sum(len(t) for t in skipped.values())
    assert n_skipped > 0
    assert m["prefill.tiles"] == tiles
    assert m["prefill.skipped_ratio"] == pytest.approx(n_skipped / tiles, rel=1e-12)
    assert np.abs(y - ref.attention(q, k, v, causal=True)).max() > 1e-3  # the skipped tiles mattered


def test_budget_with_a_mask_ranks_as_without_and_applies_it(rng):
    """A bool mask with scattered False entries (no whole tile masked) leaves every tile's bound
    as it is: the same tiles are kept, and the mask applies within them."""
    s, d = 900, 16
    offsets = rng.permutation(np.linspace(-3.0, 3.0, (s + TILE - 1) // TILE))
    q, k, v = tiled_keys(rng, 6, 2, s, d, offsets)
    mask = rng.random((s, s)) > 0.1
    mask[:, 0] = True
    skipped = selected_tiles(q, k, 2)
    model = ref.attention_model(node_name="masked", is_causal=1, select="none", mask_type=ref.TensorProto.BOOL,
                                prefill_select="budget", prefill_budget=128, min_keys=0)
    session = ortsparse.inference_session(model)  # a node's metrics live as long as its session
    y = session.run(None, {"Q": q, "K": k, "V": v, "attn_mask": mask})[0]
    np.testing.assert_allclose(y, attention_without(q, k, v, skipped, mask), rtol=1e-5, atol=2e-6)
    assert ortsparse.metrics()["PopcountAttention/masked"]["prefill.skipped_ratio"] > 0


def test_budget_keeps_the_tiles_of_keep_first_and_keep_recent(rng):
    """keep_first / keep_recent widen the always-computed sink and recent tiles."""
    s, d = 900, 16
    offsets = np.linspace(3.0, -3.0, (s + TILE - 1) // TILE)  # the first tiles bound highest
    q, k, v = tiled_keys(rng, 6, 2, s, d, offsets)
    skipped = selected_tiles(q, k, 1, sink_keys=130, recent_keys=200)
    y, _ = run4d(q, k, v, node="keeps", prefill_select="budget", prefill_budget=64, keep_first=130, keep_recent=200,
                 min_keys=0)
    np.testing.assert_allclose(y, attention_without(q, k, v, skipped), rtol=1e-5, atol=2e-6)


def test_budget_and_certified_are_deterministic_across_threads(rng):
    q, k, v = tiled_keys(rng, 6, 2, 1000, 32, rng.uniform(-4, 4, 16))
    for mode in ("certified", "budget"):
        runs = [run4d(q, k, v, node=f"det-{mode}-{t}", threads=t, prefill_select=mode, prefill_eps=1e-3,
                      prefill_budget=128, min_keys=0)[0] for t in (1, 2, 2)]
        np.testing.assert_array_equal(runs[0], runs[1])
        np.testing.assert_array_equal(runs[0], runs[2])


def test_gqa_form_selects_as_the_4d_form(rng):
    """PopcountGroupQueryAttention reads the same attributes and takes the same tiles."""
    cfg = G.Gqa(num_heads=6, kv_num_heads=2, head_size=32, past=False)
    s = 800
    q, k, v = tiled_keys(rng, 6, 2, s, 32, rng.uniform(-8, 8, 13), alpha=6.0)
    to_bsh = lambda x: np.ascontiguousarray(x.transpose(0, 2, 1, 3).reshape(1, s, -1))  # noqa: E731
    attrs = dict(select="none", min_keys=0, keep_first=0, keep_recent=0)
    for mode in ("exact", "certified", "budget"):
        sess = G.session(cfg, ours=True, node_name=f"g-{mode}", prefill_select=mode, prefill_eps=1e-3,
                         prefill_budget=128, **attrs)
        y = G.Stepper(sess, cfg, batch=1, buffer=0, shared=False).step(to_bsh(q), to_bsh(k), to_bsh(v), [s - 1], s)
        want, m4 = run4d(q, k, v, node=f"g4-{mode}", prefill_select=mode, prefill_eps=1e-3, prefill_budget=128, min_keys=0)
        np.testing.assert_allclose(y, to_bsh(want), rtol=1e-5, atol=2e-6)
        m = ortsparse.metrics()[f"PopcountGroupQueryAttention/g-{mode}"]
        assert m["prefill.skipped_ratio"] == m4["prefill.skipped_ratio"]
        assert (m["prefill.skipped_ratio"] > 0) == (mode != "exact")


@pytest.mark.parametrize("mode", ["certified", "budget"])
def test_a_later_prompt_chunk_over_a_past_selects_as_the_4d_form(mode, rng):
    """A second prompt chunk (queries at positions 300..699 over 700 keys in a shared KV buffer)
    takes the tiles the 4-D op takes for the same queries at the end of the same keys."""
    cfg = G.Gqa(num_heads=6, kv_num_heads=2, head_size=32, past=True)
    first, second = 300, 400
    s = first + second
    q, k, v = tiled_keys(rng, 6, 2, s, 32, rng.uniform(-8, 8, 11), alpha=6.0)
    to_bsh = lambda x: np.ascontiguousarray(x.transpose(0, 2, 1, 3).reshape(1, x.shape[2], -1))  # noqa: E731
    gap = {}
    for select in ("exact", mode):
        attrs = dict(select="none", min_keys=0, keep_first=0, keep_recent=0, prefill_select=select, prefill_eps=1e-3,
                     prefill_budget=64)
        sess = G.session(cfg, ours=True, node_name=f"chunks-{mode}-{select}", **attrs)
        st = G.Stepper(sess, cfg, batch=1, buffer=s, shared=True)
        st.step(to_bsh(q[:, :, :first]), to_bsh(k[:, :, :first]), to_bsh(v[:, :, :first]), [first - 1], first)
        y = st.step(to_bsh(q[:, :, first:]), to_bsh(k[:, :, first:]), to_bsh(v[:, :, first:]), [s - 1], s)
        want, m4 = run4d(np.ascontiguousarray(q[:, :, first:]), k, v, node=f"chunks4-{mode}-{select}", **attrs)
        gap[select] = np.abs(y - to_bsh(want)).max()
    assert m4["prefill.skipped_ratio"] > 0
    # the two forms round differently (scores ~50 here); a different tile choice would differ by ~1e-2
    assert gap[mode] <= 2 * gap["exact"] + 2e-6
    if mode == "budget":  # certified drops at most eps of the mass; budget 64 drops much more here
        assert np.abs(want - ref.attention(np.ascontiguousarray(q[:, :, first:]), k, v, causal=True)).max() > 1e-3


@pytest.mark.parametrize("mode", [dict(prefill_select="budget", prefill_budget=128, min_keys=0),
                                  dict(prefill_select="certified", prefill_eps=0.5, min_keys=0)], ids=["budget", "certified"])
@pytest.mark.parametrize("site", ["q", "k"])
def test_a_nan_leaves_the_other_kv_heads_selection_unchanged(mode, site, rng):
    """The rows that read a NaN go to the row path (exact: NaN where exact attention has it); the
    blocks of the other KV head choose and compute their tiles as without the NaN, bit for bit (a
    NaN used to send the whole call row by row)."""
    h, hkv, s, d = 4, 2, 640, 16
    q, k, v = (rng.standard_normal(shape, dtype=np.float32) for shape in ((1, h, s, d), (1, hkv, s, d), (1, hkv, s, d)))
    clean, metrics = run4d(q, k, v, node=f"nan_clean_{site}", **mode)
    assert metrics["prefill.skipped_ratio"] > 0 or mode["prefill_select"] == "certified"
    if site == "q":
        q[0, 0, 500, 3] = np.nan  # query head 0 (KV head 0), position 500
    else:
        k[0, 0, 100, 2] = np.nan  # KV head 0, key 100: rows 100.. of query heads 0, 1
    y, _ = run4d(q, k, v, node=f"nan_{site}", **mode)
    nan_rows = np.isnan(y).any(axis=-1)[0]
    want = np.zeros((h, s), bool)
    if site == "q":
        want[0, 500] = True
    else:
        want[:2, 100:] = True
    assert np.array_equal(nan_rows, want) and np.isnan(y[0][want]).all()
    assert np.array_equal(y[0, 2:], clean[0, 2:])


def test_decode_steps_and_short_prompts_are_unchanged(rng):
    """A call below prefill_rows (a decode step) and a prompt with no selectable tiles give the
    same bits with and without selective prefill."""
    cfg = G.Gqa(num_heads=4, kv_num_heads=2, head_size=16, past=True)
    draw = np.random.default_rng(3)
    outs = []
    for mode in ("exact", "budget"):
        sess = G.session(cfg, ours=True, node_name=f"steps-{mode}", select="none", prefill_select=mode,
                         prefill_budget=0, min_keys=0)
        st = G.Stepper(sess, cfg, batch=1, buffer=400, shared=True)
        draw = np.random.default_rng(3)
        got = []
        for rows, seqlen in ((150, 149), (1, 150), (1, 151), (8, 159)):
            q = draw.standard_normal((1, rows, cfg.hidden), dtype=np.float32)
            k = draw.standard_normal((1, rows, cfg.kv_hidden), dtype=np.float32)
            v = draw.standard_normal((1, rows, cfg.kv_hidden), dtype=np.float32)
            got.append(st.step(q, k, v, [seqlen], seqlen + 1))
        outs.append(got)
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("attr,value,words", [
    ("prefill_select", "fast", "prefill_select='fast' is not one of exact, certified, budget"),
    ("prefill_eps", -0.1, "prefill_eps=-0.1 must be in [0, 1)"),
    ("prefill_eps", 1.0, "prefill_eps=1 must be in [0, 1)"),
    ("prefill_budget", -64, "prefill_budget=-64 must be >= 0"),
])
@pytest.mark.parametrize("form", ["4d", "gqa"])
def test_bad_prefill_attributes_are_one_line_errors_naming_node_and_value(attr, value, words, form):
    with pytest.raises(Exception) as error:
        if form == "gqa":
            G.session(G.Gqa(), ours=True, node_name="badnode", **{attr: value})
        else:
            ortsparse.inference_session(ref.attention_model(node_name="badnode", **{attr: value}))
    text = str(error.value)
    assert words in text and "badnode" in text
    assert "Traceback" not in text


@pytest.mark.parametrize("isa", ISAS)
def test_every_isa_selects_as_the_reference(isa):
    """The cases above under each ISA's kernels (ORTSPARSE_ISA is read once per process)."""
    run_file_under_isa(__file__, isa)
