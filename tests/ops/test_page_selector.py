"""select=pages: keys grouped in pages with per-page, per-dim min and max of K; pages are scored
exactly in descending bound order until no unvisited key could enter the top-k (certified) or the
budget of ceil(candidates·topk) scored keys is spent.

The kept set is read off the output: with V = identity (one row per key), y[j] > 0 exactly when key
j took part in the softmax. With candidates=0 it must equal the exact top-k of a float64 reference
(plus the protected first / recent keys) wherever the k-th and (k+1)-th scores are not a near-tie.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import ortsparse
from ortsparse import _kernels

from . import attention_reference as ref


def kept_sets(q, k, **attrs):
    """bool [B, H, Sq, Skv]: the keys the op attended (V = identity)."""
    b, hkv, skv, _ = k.shape
    v = np.broadcast_to(np.eye(skv, dtype=np.float32), (b, hkv, skv, skv)).copy()
    session = ortsparse.inference_session(ref.attention_model(select="pages", min_keys=0, **attrs))
    y = session.run(None, {"Q": q, "K": k, "V": v})[0]
    return y > 0


def reference_kept(q, k, *, topk, keep_first=0, keep_recent=0, causal=False, mask=None):
    """(kept, decided): the exact top-k of each row (float64 scores) plus the protected keys, and
    whether the row's k-th and (k+1)-th scores are far enough apart for float32 to agree."""
    b, h, sq, d = q.shape
    kk = ref.expand_kv(k, h).astype(np.float64)
    skv = k.shape[2]
    kept = np.zeros((b, h, sq, skv), bool)
    decided = np.ones((b, h, sq), bool)
    for idx in np.ndindex(b, h, sq):
        i = idx[2]
        hi = skv - sq + i + 1 if causal else skv
        scores = kk[idx[0], idx[1], :hi] @ q[idx].astype(np.float64)
        if mask is not None:
            scores = scores + mask[idx[0], idx[1], i, :hi]
        allowed = np.isfinite(scores) & (scores > -1e30)
        protected = np.zeros(hi, bool)
        protected[:min(keep_first, hi)] = True
        protected[max(0, hi - keep_recent):] = True
        middle = np.flatnonzero(~protected & allowed)
        order = middle[np.lexsort((middle, -scores[middle]))]
        chosen = order[:topk]
        kept[idx][np.flatnonzero(protected & allowed)] = True
        kept[idx][chosen] = True
        if len(order) > topk:
            gap = scores[order[topk - 1]] - scores[order[topk]]
            decided[idx] = gap > 1e-4 * max(1.0, abs(scores[order[topk - 1]]))
    return kept, decided


def structured_keys(rng, b, hkv, skv, d):
    """Keys with the structure of real ones: a shared offset, a few large dims, slow drift."""
    base = rng.standard_normal((b, hkv, 1, d)) * 2
    drift = np.cumsum(rng.standard_normal((b, hkv, skv, d)) * 0.3, axis=2)
    outliers = np.zeros(d)
    outliers[: max(1, d // 8)] = 6
    return (base + drift + rng.standard_normal((b, hkv, skv, d)) * outliers).astype(np.float32)


@pytest.mark.parametrize("page_size", [1, 3, 16, 64])
@pytest.mark.parametrize("topk,keep_first,keep_recent", [(5, 0, 0), (20, 2, 7), (40, 4, 16)])
@pytest.mark.parametrize("causal", [0, 1])
@pytest.mark.parametrize("structured", [False, True])
def test_certified_kept_sets_equal_the_exact_top_k(page_size, topk, keep_first, keep_recent, causal, structured, rng):
    b, h, hkv, sq, skv, d = 2, 4, 2, 3, 200, 16
    q = rng.standard_normal((b, h, sq, d), dtype=np.float32)
    k = structured_keys(rng, b, hkv, skv, d) if structured else rng.standard_normal((b, hkv, skv, d), dtype=np.float32)
    got = kept_sets(q, k, topk=topk, page_size=page_size, keep_first=keep_first, keep_recent=keep_recent,
                    candidates=0.0, is_causal=causal)
    want, decided = reference_kept(q, k, topk=topk, keep_first=keep_first, keep_recent=keep_recent, causal=bool(causal))
    assert decided.mean() > 0.9
    assert np.array_equal(got[decided], want[decided])


def test_ties_go_to_the_lower_key_index(rng):
    q = rng.standard_normal((1, 2, 1, 8), dtype=np.float32)
    k = np.ones((1, 1, 100, 8), np.float32)  # every score equal
    got = kept_sets(q, k, topk=10, page_size=7, candidates=0.0)
    assert np.array_equal(np.flatnonzero(got[0, 0, 0]), np.arange(10))
    assert np.array_equal(np.flatnonzero(got[0, 1, 0]), np.arange(10))


@pytest.mark.parametrize("kind", ["bool", "add"])
def test_masks_take_part_in_the_bounds(kind, rng):
    b, h, sq, skv, d = 1, 2, 2, 120, 8
    q = rng.standard_normal((b, h, sq, d), dtype=np.float32)
    k = rng.standard_normal((b, 1, skv, d), dtype=np.float32)
    if kind == "bool":
        mask = rng.random((b, h, sq, skv)) > 0.3
        additive = np.where(mask, 0.0, -np.inf)
    else:
        mask = (rng.standard_normal((b, h, sq, skv)) * 3).astype(np.float32)
        mask[..., ::5] = np.finfo(np.float32).min
        additive = mask.astype(np.float64)
    v = np.broadcast_to(np.eye(skv, dtype=np.float32), (b, 1, skv, skv)).copy()
    mtype = ref.TensorProto.BOOL if kind == "bool" else ref.TensorProto.FLOAT
    model = ref.attention_model(mask_type=mtype, select="pages", min_keys=0, topk=12, page_size=8, candidates=0.0,
                                scale=1.0)
    y = ortsparse.inference_session(model).run(None, {"Q": q, "K": k, "V": v, "attn_mask": mask})[0]
    want, decided = reference_kept(q, k, topk=12, mask=additive)
    assert np.array_equal((y > 0)[decided], want[decided])


def test_budget_caps_the_exactly_scored_keys(rng):
    b, h, sq, skv, d = 1, 4, 1, 2000, 16
    q = rng.standard_normal((b, h, sq, d), dtype=np.float32)
    k = rng.standard_normal((b, 2, skv, d), dtype=np.float32)
    v = rng.standard_normal((b, 2, skv, d), dtype=np.float32)
    model = ref.attention_model(select="pages", min_keys=0, topk=32, page_size=16, candidates=2.0, node_name="budget")
    session = ortsparse.inference_session(model)
    ortsparse.reset_metrics()
    session.run(None, {"Q": q, "K": k, "V": v})
    m = ortsparse.metrics()["PopcountAttention/budget"]
    # at most ceil(2·32) keys scored per row, plus the last page that crossed the budget
    assert m["keys_exact"] <= h * (64 + 16)
    assert m["pages.certified_ratio"] == 0.0  # random keys: the bounds never certify early


def test_peaked_attention_certifies_early(rng):
    """Keys far from the query except a few: the bounds separate them and the row stops early."""
    b, h, sq, skv, d = 1, 1, 1, 4096, 16
    k = rng.standard_normal((b, 1, skv, d), dtype=np.float32) * 0.1
    q = np.zeros((b, h, sq, d), np.float32)
    q[..., 0] = 10.0
    k[0, 0, 1000:1008, 0] = 5.0
    v = rng.standard_normal((b, 1, skv, d), dtype=np.float32)
    model = ref.attention_model(select="pages", min_keys=0, topk=8, page_size=16, candidates=0.0, node_name="peaked")
    ortsparse.reset_metrics()
    session = ortsparse.inference_session(model)  # kept alive: a kernel's metrics leave with it
    y = session.run(None, {"Q": q, "K": k, "V": v})[0]
    m = ortsparse.metrics()["PopcountAttention/peaked"]
    assert m["pages.certified_ratio"] == 1.0 and m["pages.visited_ratio"] < 0.05
    keep = np.zeros((b, h, sq, skv), bool)
    keep[..., 1000:1008] = True  # the top 8: exactly these keys attended
    np.testing.assert_allclose(y, ref.attention(q, k, v, keep=keep), rtol=1e-5, atol=1e-6)


def test_nan_in_keys_gives_nan_as_exact_attention(rng):
    q = rng.standard_normal((1, 2, 1, 8), dtype=np.float32)
    k = rng.standard_normal((1, 1, 300, 8), dtype=np.float32)
    v = rng.standard_normal((1, 1, 300, 8), dtype=np.float32)
    k[0, 0, 123, 3] = np.nan
    model = ref.attention_model(select="pages", min_keys=0, topk=8)
    y = ortsparse.inference_session(model).run(None, {"Q": q, "K": k, "V": v})[0]
    assert np.isnan(y).all()


def test_values_of_keys_outside_the_selection_are_never_read(rng):
    q = rng.standard_normal((1, 1, 1, 8), dtype=np.float32)
    k = structured_keys(rng, 1, 1, 400, 8)
    v = rng.standard_normal((1, 1, 400, 8), dtype=np.float32)
    kept = kept_sets(q, k, topk=8, candidates=0.0)[0, 0, 0]
    v[0, 0, ~kept] = np.inf
    model = ref.attention_model(select="pages", min_keys=0, topk=8, candidates=0.0)
    y = ortsparse.inference_session(model).run(None, {"Q": q, "K": k, "V": v})[0]
    assert np.isfinite(y).all()


@pytest.mark.parametrize("seed, keys, settings", [
    (3, 300, "candidates=0.0"),  # certified pages
    (5, 500, "candidates=6.0, keep_first=2, keep_recent=16, mass_eps=0.05"),  # mass mode
], ids=["certified", "mass"])
@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_every_isa_keeps_the_same_sets(isa, seed, keys, settings, rng):
    """The bounds and exact scores use the ISA's kernels; the kept sets do not depend on it (each
    SIMD ISA against the scalar twin; an ISA the CPU lacks is skipped)."""
    if isa not in _kernels.supported_isas():
        pytest.skip(f"no {isa} on this CPU")
    code = (
        "import numpy as np, sys; sys.path.insert(0, %r);"
        "from tests.ops.test_page_selector import kept_sets, structured_keys;"
        "rng = np.random.default_rng(%d); q = rng.standard_normal((1, 2, 2, 24), dtype=np.float32);"
        "k = structured_keys(rng, 1, 1, %d, 24);"
        "print(np.flatnonzero(kept_sets(q, k, topk=16, page_size=8, %s).ravel()).tolist())"
    ) % (os.getcwd(), seed, keys, settings)
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={**os.environ, "ORTSPARSE_ISA": name}, check=True).stdout for name in (isa, "scalar")]
    assert runs[0] == runs[1] and len(runs[0]) > 10
