"""PopcountAttention through ONNX Runtime (and the raw engine) against the numpy reference."""
import os
import subprocess
import sys

import numpy as np
import pytest
from onnx import TensorProto

import ortsparse

from . import attention_reference as ref


def qkv(rng, b, h, hkv, sq, skv, d, dv=None):
    dv = d if dv is None else dv
    q = rng.standard_normal((b, h, sq, d)).astype(np.float32)
    k = rng.standard_normal((b, hkv, skv, d)).astype(np.float32)
    v = rng.standard_normal((b, hkv, skv, dv)).astype(np.float32)
    return q, k, v


def run(model, q, k, v, mask=None):
    session = ortsparse.inference_session(model)
    feeds = {"Q": q, "K": k, "V": v}
    if mask is not None:
        feeds["attn_mask"] = mask
    return session.run(None, feeds)[0]


def mask_type(mask):
    if mask is None:
        return None
    return TensorProto.BOOL if mask.dtype == np.bool_ else TensorProto.FLOAT


def exact_model(mask=None, **attrs):
    return ref.attention_model(mask_type=mask_type(mask), select="none", **attrs)


@pytest.mark.parametrize("h,hkv", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("sq,skv", [(1, 1), (1, 37), (3, 37), (5, 5), (4, 130)])
@pytest.mark.parametrize("d", [1, 17, 64, 100])
@pytest.mark.parametrize("causal", [0, 1])
def test_exact_mode_equals_reference(h, hkv, sq, skv, d, causal, rng):
    q, k, v = qkv(rng, 2, h, hkv, sq, skv, d, dv=d + 3)
    y = run(exact_model(is_causal=causal), q, k, v)
    expected = ref.attention(q, k, v, causal=bool(causal))
    assert y.shape == expected.shape
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=2e-6)


def test_scale_attribute(rng):
    q, k, v = qkv(rng, 1, 2, 2, 3, 20, 16)
    y = run(exact_model(scale=0.7), q, k, v)
    np.testing.assert_allclose(y, ref.attention(q, k, v, scale=0.7), rtol=1e-5, atol=2e-6)


MASK_SHAPES = [(11,), (1, 11), (3, 11), (2, 1, 3, 11), (1, 4, 1, 11), (2, 4, 3, 11), (4, 1, 1)]


@pytest.mark.parametrize("shape", MASK_SHAPES)
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("causal", [0, 1])
def test_exact_mode_masks_broadcast(shape, kind, causal, rng):
    q, k, v = qkv(rng, 2, 4, 2, 3, 11, 24)
    if kind == "bool":
        mask = rng.random(shape) < 0.7
    else:
        mask = np.where(rng.random(shape) < 0.3, np.float32(-np.inf), rng.standard_normal(shape)).astype(np.float32)
    y = run(exact_model(mask, is_causal=causal), q, k, v, mask)
    expected = ref.attention(q, k, v, mask, causal=bool(causal))
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=2e-6)


def test_fully_masked_rows_are_zero(rng):
    q, k, v = qkv(rng, 1, 2, 1, 3, 6, 8)
    mask = np.ones((1, 1, 3, 6), dtype=bool)
    mask[0, 0, 1] = False
    y = run(exact_model(mask), q, k, v, mask)
    assert np.all(y[:, :, 1] == 0)
    np.testing.assert_allclose(y, ref.attention(q, k, v, mask), rtol=1e-5, atol=2e-6)
    # Causal with more queries than keys: the first queries see no key.
    q2 = rng.standard_normal((1, 2, 8, 8)).astype(np.float32)
    y2 = run(exact_model(is_causal=1), q2, k, v)
    assert np.all(y2[:, :, :2] == 0)
    np.testing.assert_allclose(y2, ref.attention(q2, k, v, causal=True), rtol=1e-5, atol=2e-6)


def test_finite_large_negative_mask_matches_reference(rng):
    # Exported HF models mask with finfo(float32).min, not -inf: softmax stays well defined.
    q, k, v = qkv(rng, 1, 2, 2, 2, 9, 8)
    mask = np.zeros((1, 1, 2, 9), dtype=np.float32)
    mask[..., 4:] = np.finfo(np.float32).min
    y = run(exact_model(mask), q, k, v, mask)
    np.testing.assert_allclose(y, ref.attention(q, k, v, mask), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("bad,message", [
    (dict(q=(1, 3, 1, 8), k=(1, 2, 4, 8)), "multiple of K/V heads"),
    (dict(q=(1, 2, 1, 8), k=(1, 2, 4, 7)), "head dims of Q and K differ"),
    (dict(q=(1, 2, 1, 8), k=(1, 2, 4, 8), v=(1, 2, 5, 8)), "same [B, Hkv, Skv]"),
    (dict(q=(2, 2, 1, 8), k=(1, 2, 4, 8)), "batch sizes differ"),
    (dict(q=(2, 1, 8), k=(1, 2, 4, 8)), "input Q must be 4-D"),
])
def test_bad_shapes_are_clear_errors(bad, message):
    q = np.zeros(bad["q"], np.float32)
    k = np.zeros(bad["k"], np.float32)
    v = np.zeros(bad.get("v", bad["k"]), np.float32)
    with pytest.raises(Exception) as err:
        run(exact_model(), q, k, v)
    assert message in str(err.value) and "PopcountAttention node 'attn'" in str(err.value)


def test_bad_mask_shape_is_a_clear_error(rng):
    q, k, v = qkv(rng, 1, 2, 2, 3, 5, 8)
    mask = np.ones((3, 4), dtype=bool)
    with pytest.raises(Exception, match=r"attn_mask has shape \[3, 4\], not broadcastable to \[B, H, Sq, Skv\] = \[1, 2, 3, 5\]"):
        run(exact_model(mask), q, k, v, mask)
    with pytest.raises(Exception, match="attn_mask must be bool or float32"):
        m = np.ones((3, 5), dtype=np.int64)
        run(ref.attention_model(mask_type=TensorProto.INT64, select="none"), q, k, v, m)


@pytest.mark.parametrize("attrs,message", [
    (dict(mode="quaternary"), "mode='quaternary' is not one of sign, binary, ternary"),
    (dict(select="magic"), "select='magic'"),
    (dict(topk=-1), "topk=-1"),
    (dict(density_max=0.0), "density_max=0"),
    (dict(candidates=0.5), "candidates=0.5"),
    (dict(select="energy", topk=0), "needs select='popcount'"),
    (dict(is_causal=2), "is_causal=2"),
    (dict(keep_first=-1), "keep_first=-1"),
    (dict(keep_recent=-2), "keep_recent=-2"),
    (dict(pack_cache=3), "pack_cache=3"),
])
def test_bad_attributes_are_clear_errors(attrs, message):
    with pytest.raises(Exception) as err:
        ortsparse.inference_session(ref.attention_model(**attrs))
    assert message in str(err.value)


# ---- the raw engine: every ISA and popcount path --------------------------------------------

from ortsparse import _kernels  # noqa: E402

ISAS = _kernels.supported_isas()
PATHS = _kernels.popcnt_paths()
MODES = ["sign", "binary", "ternary"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("d", [1, 5, 63, 64, 65, 128, 130, 200])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 33])
def test_popcount_counts_every_path(path, mode, d, n, rng):
    eps = 0.3
    q = rng.standard_normal(d).astype(np.float32)
    keys = rng.standard_normal((n, d)).astype(np.float32)
    keys[:, ::3] = 0  # exact zeros: never a bit in any mode
    counts, gq, gk = _kernels.popcount_counts(path, mode, q, keys, eps)
    qp, qn, gq_ref = ref.pack(q[None], mode, eps)
    kp, kn, gk_ref = ref.pack(keys, mode, eps)
    expected = ref.approx_counts((qp, qn), (kp, kn), mode, d)[0]
    assert counts.tolist() == expected.tolist()
    np.testing.assert_allclose(gq, gq_ref[0], rtol=1e-6)
    np.testing.assert_allclose(gk, gk_ref, rtol=1e-6)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("d", [3, 16, 64, 70])
def test_engine_exact_every_isa(isa, d, rng):
    q, k, v = qkv(rng, 1, 6, 2, 3, 45, d, dv=d + 1)
    mask = rng.random((1, 1, 3, 45)) < 0.8
    y, stats = _kernels.popcount_attention(q, k, v, mask, is_causal=True, select="none", isa=isa)
    np.testing.assert_allclose(y, ref.attention(q, k, v, mask, causal=True), rtol=1e-5, atol=2e-6)
    assert not stats["packed"]


def centered(k):
    return k - k.astype(np.float64).mean(axis=2, keepdims=True).astype(np.float32)


def selection_case(rng, sq, causal, mask_kind, d=40, skv=70):
    q, k, v = qkv(rng, 2, 6, 2, sq, skv, d)
    # Keys of varied norms so energy selection has no near-ties.
    k *= rng.uniform(0.5, 2.0, size=(2, 2, skv, 1)).astype(np.float32)
    mask = None
    if mask_kind == "bool":
        mask = rng.random((2, 1, sq, skv)) < 0.8
    elif mask_kind == "float":
        mask = np.where(rng.random((1, 6, 1, skv)) < 0.2, np.float32(-np.inf), np.float32(0.0)).astype(np.float32)
    return q, k, v, mask


SELECT_CASES = [("popcount", m) for m in MODES] + [("energy", "sign")]


@pytest.mark.parametrize("select,mode", SELECT_CASES)
@pytest.mark.parametrize("sq,causal", [(1, False), (1, True), (4, True), (3, False)])
@pytest.mark.parametrize("mask_kind", [None, "bool", "float"])
def test_selected_keys_match_reference(select, mode, sq, causal, mask_kind, rng):
    q, k, v, mask = selection_case(rng, sq, causal, mask_kind)
    eps, topk = 0.5, 9
    keep = ref.selected_keys(q, k, mask, causal=causal, select=select, mode=mode, eps=eps, topk=topk)
    expected = ref.attention(q, k, v, mask, causal=causal, keep=keep)
    for path in PATHS:
        y, stats = _kernels.popcount_attention(q, k, v, mask, is_causal=causal, select=select, mode=mode, eps=eps,
                                               topk=topk, min_keys=0, density_max=1.0, popcnt=path)
        assert stats["packed"]
        np.testing.assert_allclose(y, expected, rtol=1e-5, atol=2e-6, err_msg=path)
    # Through ORT with a mask of the same shape.
    model = ref.attention_model(mask_type=mask_type(mask), is_causal=int(causal), select=select, mode=mode, eps=eps,
                                topk=topk, min_keys=0, density_max=1.0)
    np.testing.assert_allclose(run(model, q, k, v, mask), expected, rtol=1e-5, atol=2e-6)
    # The selection really drops keys: the exact result differs.
    exact = ref.attention(q, k, v, mask, causal=causal)
    assert np.abs(exact - expected).max() > 1e-3


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("candidates", [2.0, 3.5])
def test_candidates_rescored_exactly(mode, candidates, rng):
    q, k, v, mask = selection_case(rng, 2, True, "bool")
    keep = ref.selected_keys(q, k, mask, causal=True, mode=mode, eps=0.5, topk=6, candidates=candidates)
    assert keep.sum(-1).max() == 6
    expected = ref.attention(q, k, v, mask, causal=True, keep=keep)
    y, stats = _kernels.popcount_attention(q, k, v, mask, is_causal=True, mode=mode, eps=0.5, topk=6, min_keys=0,
                                           density_max=1.0, candidates=candidates)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=2e-6)
    assert stats["keys_exact"] > 6 * 2 * 6 * 2  # the candidates were all scored exactly


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("path", PATHS)
def test_topk_zero_is_the_approximate_formula(mode, path, rng):
    q, k, v, mask = selection_case(rng, 3, True, "float", d=70)
    expected = ref.approximate_attention(q, k, v, mask, causal=True, mode=mode, eps=0.4)
    y, stats = _kernels.popcount_attention(q, k, v, mask, is_causal=True, mode=mode, eps=0.4, topk=0, min_keys=0,
                                           density_max=1.0, popcnt=path)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=2e-6)
    assert stats["packed"] and stats["keys_exact"] == 0


def test_min_keys_falls_back_to_exact(rng):
    q, k, v = qkv(rng, 1, 4, 2, 1, 60, 32)
    exact = ref.attention(q, k, v)
    y, stats = _kernels.popcount_attention(q, k, v, topk=8, min_keys=61)
    assert not stats["packed"]
    np.testing.assert_allclose(y, exact, rtol=1e-5, atol=2e-6)
    y, stats = _kernels.popcount_attention(q, k, v, topk=8, min_keys=60)
    assert stats["packed"] and stats["keys_exact"] == 8 * 4
    assert np.abs(y - exact).max() > 1e-3
    # topk >= Skv: nothing to select, exact.
    y, stats = _kernels.popcount_attention(q, k, v, topk=60, min_keys=0)
    np.testing.assert_allclose(y, exact, rtol=1e-5, atol=2e-6)


def test_fewer_attendable_keys_than_topk_is_exact(rng):
    q, k, v = qkv(rng, 1, 2, 1, 1, 50, 16)
    mask = np.zeros((1, 1, 1, 50), dtype=bool)
    mask[..., [3, 10, 20, 33, 49]] = True
    y, _ = _kernels.popcount_attention(q, k, v, mask, topk=8, min_keys=0)
    np.testing.assert_allclose(y, ref.attention(q, k, v, mask), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("mode", ["binary", "ternary"])
def test_density_auto_disable(mode, rng):
    q, k, v = qkv(rng, 1, 2, 2, 1, 64, 32)
    exact = ref.attention(q, k, v)
    # |k| > 2.0 for ~4.5% of standard normal entries: sparse, the pack is used.
    y, stats = _kernels.popcount_attention(q, k, v, mode=mode, eps=2.0, topk=8, min_keys=0, density_max=0.15)
    density = stats["bits_set"] / stats["bits_total"]
    expected_density = np.mean(np.abs(centered(k)) > 2.0)  # keys are packed centered
    assert density == pytest.approx(expected_density) and stats["packed"]
    # eps = 0.1: ~92% dense -> above density_max: exact for this call.
    y, stats = _kernels.popcount_attention(q, k, v, mode=mode, eps=0.1, topk=8, min_keys=0, density_max=0.15)
    assert not stats["packed"] and stats["bits_set"] / stats["bits_total"] > 0.85
    np.testing.assert_allclose(y, exact, rtol=1e-5, atol=2e-6)
    # density_max = 1 never disables.
    _, stats = _kernels.popcount_attention(q, k, v, mode=mode, eps=0.1, topk=8, min_keys=0, density_max=1.0)
    assert stats["packed"]


def test_sign_mode_ignores_density(rng):
    q, k, v = qkv(rng, 1, 2, 2, 1, 64, 32)
    _, stats = _kernels.popcount_attention(q, k, v, mode="sign", topk=8, min_keys=0, density_max=0.15)
    assert stats["packed"]


def test_metrics(rng):
    ortsparse.reset_metrics()
    q, k, v = qkv(rng, 1, 4, 2, 1, 40, 32)
    model = ref.attention_model(node_name="attn_metrics", mode="ternary", eps=1.5, topk=8, min_keys=30)
    session = ortsparse.inference_session(model)
    session.run(None, {"Q": q, "K": k, "V": v})
    session.run(None, {"Q": q, "K": k[:, :, :20], "V": v[:, :, :20]})  # below min_keys: exact
    m = ortsparse.metrics()["PopcountAttention/attn_metrics"]
    assert m["pack.enabled"] == 1 and m["pack.mode"] == 3 and m["pack.active"] == 0.5
    assert m["pack.density"] == pytest.approx(np.mean(np.abs(centered(k)) > 1.5))
    assert m["pack.popcnt"] == {"portable": 0, "popcnt": 1, "vpopcntdq": 2}[_kernels.active_popcnt()]
    assert m["calls"] == 2 and m["keys_exact"] == 4 * 8 + 4 * 20


POPCNT_SCRIPT = """
import json, numpy as np, ortsparse, sys
sys.path.insert(0, {tests!r})
from ops import attention_reference as ref
rng = np.random.default_rng(0)
q = rng.standard_normal((1, 2, 1, 64)).astype(np.float32)
k = rng.standard_normal((1, 1, 50, 64)).astype(np.float32)
s = ortsparse.inference_session(ref.attention_model(node_name="p", topk=8, min_keys=0))
y = s.run(None, {{"Q": q, "K": k, "V": k}})[0]
keep = ref.selected_keys(q, k, topk=8)
np.testing.assert_allclose(y, ref.attention(q, k, k, keep=keep), rtol=1e-5, atol=2e-6)
print(int(ortsparse.metrics()["PopcountAttention/p"]["pack.popcnt"]))
"""


@pytest.mark.parametrize("path", PATHS)
def test_forced_popcount_path_through_ort(path):
    tests_dir = os.path.dirname(os.path.dirname(__file__))
    out = subprocess.run([sys.executable, "-c", POPCNT_SCRIPT.format(tests=tests_dir)],
                         env=dict(os.environ, ORTSPARSE_POPCNT=path), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) == {"portable": 0, "popcnt": 1, "vpopcntdq": 2}[path]


def test_unknown_popcount_path_is_a_clear_error():
    code = ("import ortsparse, sys; sys.path.insert(0, %r); from ops import attention_reference as ref; "
            "ortsparse.inference_session(ref.attention_model())") % os.path.dirname(os.path.dirname(__file__))
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, ORTSPARSE_POPCNT="sse9"),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "ORTSPARSE_POPCNT=sse9 is not one of portable, popcnt, vpopcntdq" in out.stderr


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("d", [1, 9, 16, 63, 64, 65, 100, 130])
def test_pack_every_isa(isa, mode, d, rng):
    keys = rng.standard_normal((13, d)).astype(np.float32)
    keys[:, ::4] = 0
    keys[:, 1::7] = 0.4  # exactly on eps: not active
    q = rng.standard_normal(d).astype(np.float32)
    counts, gq, gk = _kernels.popcount_counts("portable", mode, q, keys, 0.4, isa=isa)
    qp, qn, gq_ref = ref.pack(q[None], mode, 0.4)
    kp, kn, gk_ref = ref.pack(keys, mode, 0.4)
    assert counts.tolist() == ref.approx_counts((qp, qn), (kp, kn), mode, d)[0].tolist()
    np.testing.assert_allclose(gk, gk_ref, rtol=1e-6)
    np.testing.assert_allclose(gq, gq_ref[0], rtol=1e-6)


@pytest.mark.parametrize("select,mode", SELECT_CASES)
@pytest.mark.parametrize("topk", [5, 40, 300])
def test_selection_at_long_context(select, mode, topk, rng):
    """Skv large enough for the sampled-threshold path of the top-k (n >= 512, n > 4 k)."""
    q, k, v = qkv(rng, 1, 4, 2, 1, 1500, 64)
    k *= rng.uniform(0.5, 2.0, size=(1, 2, 1500, 1)).astype(np.float32)
    keep = ref.selected_keys(q, k, select=select, mode=mode, eps=0.5, topk=topk)
    expected = ref.attention(q, k, v, keep=keep)
    y, stats = _kernels.popcount_attention(q, k, v, select=select, mode=mode, eps=0.5, topk=topk, min_keys=0,
                                           density_max=1.0)
    assert stats["keys_exact"] == 4 * topk
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=2e-6)


def test_packed_keys_are_reused_while_the_cache_grows(rng):
    q, k, v = qkv(rng, 1, 4, 2, 1, 60, 64)
    op = _kernels.PopcountAttention(topk=8, min_keys=0, is_causal=True, center=False)
    for n, packed in ((50, 100), (51, 2), (52, 2), (52, 0)):
        y, stats = op(q, k[:, :, :n], v[:, :, :n])
        keep = ref.selected_keys(q, k[:, :, :n], causal=True, topk=8, center=False)
        np.testing.assert_allclose(y, ref.attention(q, k[:, :, :n], v[:, :, :n], causal=True, keep=keep),
                                   rtol=1e-5, atol=2e-6)
        assert stats["keys_packed"] == packed
    # A changed row (26 of 0..52): every row from the first change on is summarised again.
    k2 = k.copy()
    k2[:, :, 26] += 1.0
    y, stats = op(q, k2[:, :, :53], v[:, :, :53])
    assert stats["keys_packed"] == 2 * (53 - 26)
    keep = ref.selected_keys(q, k2[:, :, :53], causal=True, topk=8, center=False)
    np.testing.assert_allclose(y, ref.attention(q, k2[:, :, :53], v[:, :, :53], causal=True, keep=keep),
                               rtol=1e-5, atol=2e-6)
    # A different sequence of the same length: repack.
    k3 = rng.standard_normal(k.shape).astype(np.float32)
    y, stats = op(q, k3[:, :, :53], v[:, :, :53])
    assert stats["keys_packed"] == 2 * 53
    keep = ref.selected_keys(q, k3[:, :, :53], causal=True, topk=8, center=False)
    np.testing.assert_allclose(y, ref.attention(q, k3[:, :, :53], v[:, :, :53], causal=True, keep=keep),
                               rtol=1e-5, atol=2e-6)
    # Off: every call packs everything.
    op = _kernels.PopcountAttention(topk=8, min_keys=0, pack_cache=False, center=False)
    op(q, k[:, :, :50], v[:, :, :50])
    assert op(q, k[:, :, :51], v[:, :, :51])[1]["keys_packed"] == 2 * 51


@pytest.mark.parametrize("center", [False, True])
@pytest.mark.parametrize("select", ["popcount", "energy"])
def test_warm_cache_gives_the_fresh_answer(select, center, rng):
    """The output never depends on what an earlier call left in the key cache: a K that agrees with
    the cached one on its first, middle and last rows but differs elsewhere, a rewound (shorter) K
    and a K that shares only a prefix all give what a fresh kernel gives."""
    q, k, v = qkv(rng, 1, 4, 2, 1, 300, 32)
    settings = dict(select=select, topk=8, min_keys=0, is_causal=True, center=center, proj_bits=64)
    warm = _kernels.PopcountAttention(**settings)
    warm(q, k[:, :, :290], v[:, :, :290])
    variants = []
    edited = k.copy()
    for row in (1, 100, 200, 288):  # not the first / middle / last rows of 290
        edited[:, :, row] *= -1.0
    variants.append(edited[:, :, :290])
    variants.append(k[:, :, :120])  # rewound
    prefix = k.copy()
    prefix[:, :, 150:] = rng.standard_normal(prefix[:, :, 150:].shape).astype(np.float32)
    variants.append(prefix[:, :, :295])  # same prefix, then another continuation
    for kk in variants:
        n = kk.shape[2]
        y_warm, _ = warm(q, kk, v[:, :, :n])
        y_fresh, _ = _kernels.PopcountAttention(**settings)(q, kk, v[:, :, :n])
        assert np.array_equal(y_warm, y_fresh)


def test_energy_norms_are_reused(rng):
    q, k, v = qkv(rng, 1, 2, 1, 1, 40, 16)
    op = _kernels.PopcountAttention(select="energy", topk=8, min_keys=0)
    op(q, k[:, :, :30], v[:, :, :30])
    y, stats = op(q, k[:, :, :31], v[:, :, :31])
    assert stats["keys_packed"] == 1
    keep = ref.selected_keys(q, k[:, :, :31], select="energy", topk=8)
    np.testing.assert_allclose(y, ref.attention(q, k[:, :, :31], v[:, :, :31], keep=keep), rtol=1e-5, atol=2e-6)


def test_decode_through_ort_reuses_packed_keys(rng):
    ortsparse.reset_metrics()
    q, k, v = qkv(rng, 1, 4, 2, 1, 40, 32)
    session = ortsparse.inference_session(ref.attention_model(node_name="dec", topk=8, min_keys=0, is_causal=1,
                                                              center=0))
    for n in range(30, 35):
        y = session.run(None, {"Q": q, "K": k[:, :, :n], "V": v[:, :, :n]})[0]
        keep = ref.selected_keys(q, k[:, :, :n], causal=True, topk=8, center=False)
        np.testing.assert_allclose(y, ref.attention(q, k[:, :, :n], v[:, :, :n], causal=True, keep=keep),
                                   rtol=1e-5, atol=2e-6)
    assert ortsparse.metrics()["PopcountAttention/dec"]["keys_packed"] == 2 * 30 + 4 * 2


@pytest.mark.parametrize("keep_first,keep_recent", [(1, 0), (0, 5), (3, 4)])
@pytest.mark.parametrize("candidates", [1.0, 2.0])
@pytest.mark.parametrize("select,mode", [("popcount", "sign"), ("popcount", "ternary"), ("energy", "sign")])
def test_protected_sink_and_recent_keys(keep_first, keep_recent, candidates, select, mode, rng):
    q, k, v, mask = selection_case(rng, 3, True, "bool")
    kw = dict(select=select, mode=mode, eps=0.5, topk=6, candidates=candidates, keep_first=keep_first,
              keep_recent=keep_recent)
    keep = ref.selected_keys(q, k, mask, causal=True, **kw)
    # The protected keys are in (where not masked out).
    limit = np.arange(70 - 3 + 1, 70 + 1)
    allowed = ref.full_bias(mask, q, k, True) > -np.inf
    for i in range(3):
        protected = np.zeros(70, bool)
        protected[:keep_first] = True
        protected[limit[i] - keep_recent:limit[i]] = True
        assert np.all(keep[:, :, i][allowed[:, :, i] & protected])
    expected = ref.attention(q, k, v, mask, causal=True, keep=keep)
    y, _ = _kernels.popcount_attention(q, k, v, mask, is_causal=True, min_keys=0, density_max=1.0, **kw)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=2e-6)
    model = ref.attention_model(mask_type=mask_type(mask), is_causal=1, min_keys=0, density_max=1.0, **kw)
    np.testing.assert_allclose(run(model, q, k, v, mask), expected, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("mode", MODES)
def test_uncentered_packing(mode, rng):
    q, k, v, mask = selection_case(rng, 2, True, "float")
    k += 0.7  # a common offset: centering changes the bits
    kw = dict(mode=mode, eps=0.5, topk=7)
    keep = ref.selected_keys(q, k, mask, causal=True, center=False, **kw)
    assert not np.array_equal(keep, ref.selected_keys(q, k, mask, causal=True, **kw))
    y, _ = _kernels.popcount_attention(q, k, v, mask, is_causal=True, min_keys=0, density_max=1.0, center=False, **kw)
    np.testing.assert_allclose(y, ref.attention(q, k, v, mask, causal=True, keep=keep), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("proj_bits", [64, 100, 256])
@pytest.mark.parametrize("mode", ["sign", "ternary"])
def test_random_projection_bits(proj_bits, mode, rng):
    q, k, v, mask = selection_case(rng, 2, True, "bool", d=48)
    kw = dict(mode=mode, eps=0.5, topk=7, proj_bits=proj_bits)
    keep = ref.selected_keys(q, k, mask, causal=True, **kw)
    expected = ref.attention(q, k, v, mask, causal=True, keep=keep)
    y, stats = _kernels.popcount_attention(q, k, v, mask, is_causal=True, min_keys=0, density_max=1.0, **kw)
    # The projection is computed in float32 (op) vs float64 (reference): a bit whose projection
    # is ~0 may differ, so allow a few of the 24 query rows to pick another key set.
    rows_equal = np.isclose(y, expected, rtol=1e-5, atol=2e-6).all(axis=-1)
    assert rows_equal.mean() >= 0.9
    assert stats["bits_total"] == 2 * 2 * 70 * proj_bits  # B * Hkv heads
    r = _kernels.projection_matrix(48, proj_bits)
    assert r.shape == (48, proj_bits) and abs(r.mean()) < 0.1 and abs(r.std() - 1) < 0.1
    np.testing.assert_array_equal(r, _kernels.projection_matrix(48, proj_bits))  # fixed, part of the op


@pytest.mark.concurrency
@pytest.mark.parametrize("intra_op_threads", [1, 2], ids=["caller", "pool"])
def test_concurrent_runs_with_different_sequences(rng, intra_op_threads):
    """Threads share one session, each decoding its own sequence: the packed-key cache is a
    snapshot, so a cache of another sequence is never reused (results equal the reference)."""
    import threading

    session = ortsparse.inference_session(ref.attention_model(node_name="conc", topk=6, min_keys=0, is_causal=1,
                                                              center=0), intra_op_num_threads=intra_op_threads)
    seqs = [qkv(np.random.default_rng(s), 1, 4, 2, 1, 48, 32) for s in range(4)]
    expected = {}
    for s, (q, k, v) in enumerate(seqs):
        for n in range(40, 48):
            keep = ref.selected_keys(q, k[:, :, :n], causal=True, topk=6, center=False)
            expected[s, n] = ref.attention(q, k[:, :, :n], v[:, :, :n], causal=True, keep=keep)
    errors = []

    def worker(s):
        q, k, v = seqs[s]
        try:
            for _ in range(20):
                for n in range(40, 48):
                    y = session.run(None, {"Q": q, "K": k[:, :, :n].copy(), "V": v[:, :, :n].copy()})[0]
                    np.testing.assert_allclose(y, expected[s, n], rtol=1e-5, atol=2e-6)
        except BaseException as error:  # noqa: BLE001
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:2]


def test_centered_cache_extends_only_past_the_center_rows(rng):
    """center = 1: mu = mean of the first 256 keys. Below 256 keys every call repacks (mu still
    changes); from 256 on the cache grows by the new rows only, and results never depend on the
    call history."""
    q, k, v = qkv(rng, 1, 2, 1, 1, 300, 32)
    op = _kernels.PopcountAttention(topk=8, min_keys=0, is_causal=True)
    fresh = lambda n: _kernels.popcount_attention(q, k[:, :, :n], v[:, :, :n], topk=8, min_keys=0, is_causal=True)
    for n, packed in ((100, 100), (101, 101), (256, 256), (257, 1), (300, 43)):
        y, stats = op(q, k[:, :, :n], v[:, :, :n])
        assert stats["keys_packed"] == packed
        np.testing.assert_array_equal(y, fresh(n)[0])
        keep = ref.selected_keys(q, k[:, :, :n], causal=True, topk=8)
        np.testing.assert_allclose(y, ref.attention(q, k[:, :, :n], v[:, :, :n], causal=True, keep=keep),
                                   rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("select", ["popcount", "energy"])
def test_finite_min_mask_keys_are_out_of_the_selection(select, rng):
    """An HF-style causal mask (finfo.min above the diagonal, no is_causal) selects like is_causal:
    masked keys are neither candidates nor protected recent keys."""
    q, k, v = qkv(rng, 1, 4, 2, 6, 70, 32)
    allowed = ref.causal_allowed(6, 70)
    mask = np.where(allowed, np.float32(0), np.finfo(np.float32).min).astype(np.float32)[None, None]
    # keep_recent counts from the end of the causal prefix with is_causal, from Skv with a mask
    # only (the same keys at decode, Sq = 1), so it is left out of the equality below.
    keep = ref.selected_keys(q, k, mask, select=select, topk=8, keep_recent=5, center=False)
    assert not np.any(keep & ~allowed[None, None])
    kw = dict(select=select, topk=8, keep_first=2, center=False)
    keep = ref.selected_keys(q, k, mask, **kw)
    assert not np.any(keep & ~allowed[None, None])  # no masked key kept (each row has > 15 keys)
    assert np.array_equal(keep, ref.selected_keys(q, k, causal=True, **kw))
    y, _ = _kernels.popcount_attention(q, k, v, mask, min_keys=0, density_max=1.0, **kw)
    np.testing.assert_allclose(y, ref.attention(q, k, v, mask, keep=keep), rtol=1e-5, atol=2e-6)
    y_causal, _ = _kernels.popcount_attention(q, k, v, is_causal=True, min_keys=0, density_max=1.0, **kw)
    np.testing.assert_allclose(y, y_causal, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("select,extra", [("popcount", {}), ("popcount", {"proj_bits": 128, "mode": "ternary"}),
                                          ("energy", {})])
def test_long_decode_extends_the_cache_in_place_and_past_its_capacity(select, extra, rng):
    """Grow the cache one key per call from 40 to 200 keys (past the first allocation's headroom):
    every step packs only the new row and equals a fresh kernel's result."""
    q, k, v = qkv(rng, 1, 4, 2, 1, 200, 32)
    kw = dict(select=select, topk=8, min_keys=0, is_causal=True, center=False, density_max=1.0, eps=0.3, **extra)
    op = _kernels.PopcountAttention(**kw)
    for n in range(40, 201):
        y, stats = op(q, k[:, :, :n], v[:, :, :n])
        assert stats["keys_packed"] == (2 * 40 if n == 40 else 2)
        fresh, _ = _kernels.popcount_attention(q, k[:, :, :n], v[:, :, :n], **kw)
        np.testing.assert_array_equal(y, fresh)


def _nh_reference(x: np.ndarray, key: np.ndarray) -> tuple[int, int]:
    """NH (UMAC) of the row's 32-bit words, twice (the key shifted by two words), in Python ints."""
    words = [int(w) for w in x.view(np.uint32)]
    if len(words) % 2:
        words.append(0)
    key = [int(k) for k in key]
    out = []
    for shift in (0, 2):
        h = 0
        for i in range(0, len(words), 2):
            h += ((words[i] + key[i + shift]) % 2**32) * ((words[i + 1] + key[i + 1 + shift]) % 2**32)
        out.append(h % 2**64)
    return tuple(out)


@pytest.mark.parametrize("isa", ISAS)
def test_row_hash_every_isa_matches_the_reference(isa, rng):
    for d in list(range(1, 40)) + [63, 64, 65, 127, 128, 129]:
        x = rng.standard_normal(d).astype(np.float32)
        key = rng.integers(0, 2**32, size=(d + 1) // 2 * 2 + 2, dtype=np.uint64).astype(np.uint32)
        assert _kernels.row_hash(isa, x, key) == _nh_reference(x, key), d
        # One flipped bit anywhere changes the hash.
        y = x.copy()
        y.view(np.uint32)[int(rng.integers(d))] ^= 1 << int(rng.integers(32))
        assert _kernels.row_hash(isa, y, key) != _kernels.row_hash(isa, x, key)
