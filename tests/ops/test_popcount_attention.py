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
])
def test_bad_attributes_are_clear_errors(attrs, message):
    with pytest.raises(Exception) as err:
        ortsparse.inference_session(ref.attention_model(**attrs))
    assert message in str(err.value)
