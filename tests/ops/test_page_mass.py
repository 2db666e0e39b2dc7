"""select=pages, mass mode (mass_eps > 0): a per-row budget. Pages are scored exactly best bound first,
ceil(topk / page) pages at a time, up to ceil(candidates·topk) keys; a row stops after a batch that
carried <= mass_eps of the softmax mass seen so far (protected keys included), or — certified — when
the bound says the unvisited keys together carry <= mass_eps of it. Every scored key is kept.

The kept set is read off the output (V = identity: y[j] > 0 exactly when key j took part) and
compared with a float64 reference of the same rule wherever no stop decision is a near-tie.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

import ortsparse

from . import attention_reference as ref
from .test_page_selector import kept_sets, structured_keys


def _pages_of_row(kk, q, scale, mid_lo, mid_hi, page):
    """[(first key, end key, bound)] of the pages holding keys [mid_lo, mid_hi): the bound is over
    the whole page of the cache (every row of the call's K in it), as the op's key summaries are."""
    pages = []
    for pg in range(mid_lo // page, -(-mid_hi // page)):
        rows = kk[pg * page:min((pg + 1) * page, kk.shape[0])]
        bound = float(np.maximum(q * rows.min(axis=0), q * rows.max(axis=0)).sum()) * scale
        pages.append((max(mid_lo, pg * page), min(mid_hi, (pg + 1) * page), bound))
    return pages


def _mass_row(scores, pages, *, topk, candidates, page, mass_eps, protected):
    """(visited keys, decided) of one row under the mass rule (float64); decided is False when a
    stop decision lies within 1e-3 (relative) of its threshold."""
    batch = max(1, -(-topk // page))
    limit = min(len(pages), max(batch, -(-math.ceil(candidates * topk) // page)))
    order = sorted(range(len(pages)), key=lambda t: (-pages[t][2], t))
    top = scores[protected].max()
    total = np.exp(scores[protected] - top).sum()
    middle_left = sum(e - a for a, e, _ in pages)
    visited, decided, v = [], True, 0

    def near(lhs, rhs):
        return abs(lhs - rhs) <= 1e-3 * max(abs(rhs), 1e-300)

    while v < limit:
        if v > 0:
            rest = middle_left * math.exp(pages[order[v]][2] - top)
            decided &= not near(rest, mass_eps * total)
            if rest <= mass_eps * total:
                return visited, decided
        keys = np.concatenate([np.arange(pages[t][0], pages[t][1]) for t in order[v:min(limit, v + batch)]])
        batch_top = max(top, scores[keys].max())
        total = total * math.exp(top - batch_top)
        top = batch_top
        carried = np.exp(scores[keys] - top).sum()
        total += carried
        visited.extend(keys.tolist())
        middle_left -= keys.size
        v = min(limit, v + batch)
        decided &= not near(carried, mass_eps * total)
        if carried <= mass_eps * total:
            break
    return visited, decided


def reference_mass_kept(q, k, *, topk, candidates, page_size, mass_eps, keep_first, keep_recent, causal=False):
    """(kept, decided) [B, H, Sq, Skv] / [B, H, Sq]: the protected keys plus the pages the mass rule
    visits (rows with no more unprotected keys than topk attend everything, as the op)."""
    b, h, sq, d = q.shape
    skv = k.shape[2]
    kk = ref.expand_kv(k, h).astype(np.float64)
    scale = float(ref.scale_of(0.0, d))
    kept = np.zeros((b, h, sq, skv), bool)
    decided = np.ones((b, h, sq), bool)
    for idx in np.ndindex(b, h, sq):
        hi = skv - sq + idx[2] + 1 if causal else skv
        qrow = q[idx].astype(np.float64)
        scores = kk[idx[0], idx[1], :hi] @ qrow * scale
        first = min(hi, keep_first)
        recent = max(first, hi - min(hi, keep_recent))
        if recent - first <= topk:
            kept[idx][:hi] = True
            continue
        protected = np.r_[np.arange(first), np.arange(recent, hi)]
        pages = _pages_of_row(kk[idx[0], idx[1]], qrow, scale, first, recent, page_size)
        visited, decided[idx] = _mass_row(scores, pages, topk=topk, candidates=candidates, page=page_size,
                                          mass_eps=mass_eps, protected=protected)
        kept[idx][protected] = True
        kept[idx][visited] = True
    return kept, decided


@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("topk,keep_first,keep_recent", [(16, 2, 8), (32, 4, 32)])
@pytest.mark.parametrize("mass_eps", [0.02, 0.2])
@pytest.mark.parametrize("causal", [0, 1])
@pytest.mark.parametrize("structured", [False, True])
def test_mass_kept_sets_follow_the_rule(page_size, topk, keep_first, keep_recent, mass_eps, causal, structured, rng):
    b, h, hkv, sq, skv, d = 1, 4, 2, 3, 600, 16
    q = rng.standard_normal((b, h, sq, d), dtype=np.float32)
    k = structured_keys(rng, b, hkv, skv, d) if structured else rng.standard_normal((b, hkv, skv, d), dtype=np.float32)
    attrs = dict(topk=topk, candidates=6.0, page_size=page_size, mass_eps=mass_eps, keep_first=keep_first,
                 keep_recent=keep_recent)
    got = kept_sets(q, k, is_causal=causal, **attrs)
    want, decided = reference_mass_kept(q, k, causal=bool(causal), **attrs)
    assert decided.mean() > 0.8
    assert np.array_equal(got[decided], want[decided])


def _run_counted(q, k, v, name, **attrs):
    model = ref.attention_model(select="pages", min_keys=0, node_name=name, **attrs)
    session = ortsparse.inference_session(model)  # kept alive while the metrics are read
    ortsparse.reset_metrics()
    y = session.run(None, {"Q": q, "K": k, "V": v})[0]
    return y, ortsparse.metrics()[f"PopcountAttention/{name}"]


def test_eps_sets_how_far_a_row_reads(rng):
    """A large eps stops after one batch, a tiny one reads the whole budget; a budget over every
    page with a tiny eps is exact attention."""
    b, h, sq, skv, d = 1, 2, 1, 2000, 16
    q = rng.standard_normal((b, h, sq, d), dtype=np.float32)
    k = rng.standard_normal((b, 1, skv, d), dtype=np.float32)
    v = rng.standard_normal((b, 1, skv, d), dtype=np.float32)
    common = dict(topk=32, page_size=16, keep_first=16, keep_recent=64)  # every unprotected page whole
    _, loose = _run_counted(q, k, v, "loose", candidates=8.0, mass_eps=0.9, **common)
    _, tight = _run_counted(q, k, v, "tight", candidates=8.0, mass_eps=1e-9, **common)
    assert loose["keys_exact"] == h * (32 + 80)  # one batch (2 pages) + the protected keys
    assert tight["keys_exact"] == h * (256 + 80)  # the whole budget
    y, full = _run_counted(q, k, v, "full", candidates=1000.0, mass_eps=1e-9, **common)
    assert full["keys_exact"] == h * skv
    np.testing.assert_allclose(y, ref.attention(q, k, v), rtol=1e-4, atol=1e-5)


def test_peaked_attention_is_certified_after_one_batch(rng):
    """The weight sits on the recent keys and the bounds show the others cannot carry eps of it."""
    b, h, sq, skv, d = 1, 1, 1, 4096, 16
    k = rng.standard_normal((b, 1, skv, d), dtype=np.float32) * 0.1
    k[0, 0, -32:, 0] = 5.0
    q = np.zeros((b, h, sq, d), np.float32)
    q[..., 0] = 12.0
    v = rng.standard_normal((b, 1, skv, d), dtype=np.float32)
    y, m = _run_counted(q, k, v, "peaked", topk=64, candidates=8.0, page_size=16, keep_first=4, keep_recent=32,
                        mass_eps=1e-3)
    assert m["pages.certified_ratio"] == 1.0 and m["keys_exact"] == 64 + 36
    # what the row left out carries < 1e-3 of the mass: the output is within that of exact attention
    np.testing.assert_allclose(y, ref.attention(q, k, v), atol=2e-3 * np.abs(v).max())


def test_nan_in_keys_gives_nan_as_exact_attention(rng):
    q = rng.standard_normal((1, 2, 1, 8), dtype=np.float32)
    k = rng.standard_normal((1, 1, 300, 8), dtype=np.float32)
    v = rng.standard_normal((1, 1, 300, 8), dtype=np.float32)
    k[0, 0, 123, 3] = np.nan
    model = ref.attention_model(select="pages", min_keys=0, topk=8, candidates=4.0, mass_eps=0.01)
    y = ortsparse.inference_session(model).run(None, {"Q": q, "K": k, "V": v})[0]
    assert np.isnan(y).all()


@pytest.mark.parametrize("attrs,message", [
    (dict(select="pages", candidates=3.0, mass_eps=1.0), "mass_eps=1 must be in [0, 1)"),
    (dict(select="pages", candidates=0.0, mass_eps=0.1), "needs select='pages' with candidates > 0"),
    (dict(select="popcount", candidates=3.0, mass_eps=0.1), "needs select='pages' with candidates > 0"),
])
def test_bad_mass_eps_is_refused_naming_the_attribute(attrs, message):
    with pytest.raises(Exception, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        ortsparse.inference_session(ref.attention_model(topk=8, **attrs))
