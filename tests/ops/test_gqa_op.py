"""PopcountGroupQueryAttention against onnxruntime's own com.microsoft.GroupQueryAttention: with
exact attention (select=none, or fewer keys than min_keys) the outputs agree within 1e-5 of the
output scale and present_key / present_value are bit-identical, for prompt, token and later-prompt
calls, both buffer modes (one buffer bound as past and present, as onnxruntime-genai does, or
separate tensors), packed or separate Q/K/V, rotary (half split, interleaved, partial), local
windows, soft-capping, smooth softmax, head sinks, attention bias and position ids."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import ortsparse

from . import gqa_graphs as G

EXACT = {"select": "none"}


def assert_matches(ours: np.ndarray, theirs: np.ndarray, rows=None) -> None:
    """Outputs agree within 1e-5 of the output scale (rows: per batch entry, the valid query rows)."""
    if rows is not None:
        ours = np.concatenate([ours[b, :n].ravel() for b, n in enumerate(rows)])
        theirs = np.concatenate([theirs[b, :n].ravel() for b, n in enumerate(rows)])
    scale = max(float(np.abs(theirs).max()), 1e-30)
    assert np.abs(ours - theirs).max() <= 1e-5 * scale, np.abs(ours - theirs).max() / scale


def new_rows(rng, cfg: G.Gqa, batch: int, s: int):
    width = cfg.hidden + (2 * cfg.kv_hidden if cfg.packed else 0)
    q = rng.standard_normal((batch, s, width), dtype=np.float32)
    if cfg.packed:
        return q, None, None
    return (q, rng.standard_normal((batch, s, cfg.kv_hidden), dtype=np.float32),
            rng.standard_normal((batch, s, cfg.kv_hidden), dtype=np.float32))


def extra_feeds(rng, cfg: G.Gqa, batch: int, s: int, total: int, past) -> dict:
    feeds = {}
    if "head_sink" in cfg.extra:
        feeds["head_sink"] = rng.standard_normal(cfg.num_heads).astype(np.float32)
    if "attention_bias" in cfg.extra:
        feeds["attention_bias"] = rng.standard_normal((batch, 1, s, total)).astype(np.float32)
    if "position_ids" in cfg.extra:
        pos = np.asarray(past)[:, None] + np.arange(s)[None, :] + rng.integers(0, 3, (batch, s))
        feeds["position_ids"] = pos.astype(np.int64)
    return feeds


class Pair:
    """onnxruntime's op and ours, fed the same calls, each keeping its own K/V state."""

    def __init__(self, rng, cfg: G.Gqa, *, batch: int, buffer: int, shared: bool, threads: int = 1,
                 attrs=None, smooth: int = 0, past_k=None, past_v=None):
        self.rng, self.cfg, self.batch = rng, cfg, batch
        cos = sin = None
        if cfg.rotary:
            cos, sin = G.rotary_tables(rng, buffer + 8, cfg.half)
        extra = {"smooth_softmax": smooth} if smooth else {}
        self.theirs = G.Stepper(G.session(cfg, ours=False, threads=threads, **extra), cfg, batch=batch, buffer=buffer,
                                shared=shared, cos=cos, sin=sin, past_k=past_k, past_v=past_v)
        self.ours = G.Stepper(G.session(cfg, ours=True, threads=threads, **extra, **(attrs or EXACT)), cfg,
                              batch=batch, buffer=buffer, shared=shared, cos=cos, sin=sin,
                              past_k=None if past_k is None else past_k.copy(),
                              past_v=None if past_v is None else past_v.copy())

    def call(self, s: int, lengths, past=None) -> None:
        """One call of s new rows per entry; lengths: keys after the call (seqlens_k + 1)."""
        past = [0] * self.batch if past is None else past
        first_prompt = all(p == 0 for p in past)
        total = s if first_prompt else max(lengths)  # the first prompt: total_sequence_length == S
        q, k, v = new_rows(self.rng, self.cfg, self.batch, s)
        extra = extra_feeds(self.rng, self.cfg, self.batch, s, total, past)
        seqlens = [n - 1 for n in lengths]
        theirs = self.theirs.step(q, k, v, seqlens, total, **extra)
        ours = self.ours.step(q, k, v, seqlens, total, **extra)
        valid = [min(s, n) for n in lengths] if first_prompt else None
        assert_matches(ours, theirs, valid)
        assert np.array_equal(self.ours.k, self.theirs.k) and np.array_equal(self.ours.v, self.theirs.v)


CONFIGS = [
    G.Gqa(),
    G.Gqa(packed=True),
    G.Gqa(num_heads=6, kv_num_heads=3, head_size=32, rotary=True),
    G.Gqa(num_heads=6, kv_num_heads=3, head_size=32, rotary=True, interleaved=True, packed=True),
    G.Gqa(num_heads=9, kv_num_heads=3, head_size=64, rotary=True, rotary_dim=32),
    G.Gqa(num_heads=8, kv_num_heads=1, head_size=40, local_window=5),
    G.Gqa(num_heads=4, kv_num_heads=4, head_size=16, softcap=20.0, scale=0.3),
    G.Gqa(num_heads=6, kv_num_heads=2, head_size=32, rotary=True, extra=("position_ids", "attention_bias", "head_sink")),
    G.Gqa(num_heads=6, kv_num_heads=2, head_size=32, local_window=0),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in dataclasses.asdict(c).items()
                                                               if v != getattr(G.Gqa(), k)) or "default")
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("smooth", [0, 1])
def test_prompt_then_tokens_match_onnxruntime(cfg, shared, smooth, rng):
    pair = Pair(rng, cfg, batch=3, buffer=40, shared=shared, smooth=smooth)
    lengths = [11, 7, 1]  # right-padded prompt of 11 rows
    pair.call(11, lengths)
    for _ in range(4):
        past = list(lengths)
        lengths = [n + 1 for n in lengths]
        pair.call(1, lengths, past)


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("packed", [False, True])
def test_later_prompt_chunks_match_onnxruntime(shared, packed, rng):
    cfg = G.Gqa(num_heads=6, kv_num_heads=2, head_size=32, rotary=True, packed=packed)
    pair = Pair(rng, cfg, batch=1, buffer=64, shared=shared)
    pair.call(9, [9])
    pair.call(13, [22], [9])  # a second prompt chunk after a past (batch 1)
    pair.call(1, [23], [22])


@pytest.mark.parametrize("context", [128, 4096])
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("attrs", [EXACT, {"select": "pages", "min_keys": 100000},
                                   # mass mode whose budget covers every page and whose eps no batch meets:
                                   # every key scored and kept, so exact
                                   {"select": "pages", "min_keys": 0, "topk": 64, "candidates": 1024.0,
                                    "keep_first": 4, "keep_recent": 64, "mass_eps": 1e-30}],
                         ids=["none", "below_min_keys", "mass_every_page"])
def test_decode_64_tokens_matches_onnxruntime(context, shared, threads, attrs, rng):
    """A real decode: a past of context - 64 tokens, then 64 steps of one token."""
    cfg = G.Gqa(num_heads=9, kv_num_heads=3, head_size=64, rotary=True, packed=True)
    start = context - 64
    buffer = context if shared else start
    past_k = np.zeros((1, 3, buffer, 64), np.float32)
    past_v = np.zeros((1, 3, buffer, 64), np.float32)
    past_k[:, :, :start] = rng.standard_normal((1, 3, start, 64), dtype=np.float32)
    past_v[:, :, :start] = rng.standard_normal((1, 3, start, 64), dtype=np.float32)
    pair = Pair(rng, cfg, batch=1, buffer=context, shared=shared, threads=threads, attrs=attrs,
                past_k=past_k, past_v=past_v)
    for n in range(start, context):
        pair.call(1, [n + 1], [n])


def test_batch_entries_of_different_lengths_decode_independently(rng):
    cfg = G.Gqa(num_heads=4, kv_num_heads=2, head_size=16, rotary=True)
    pair = Pair(rng, cfg, batch=4, buffer=48, shared=True)
    lengths = [20, 3, 17, 8]
    pair.call(20, lengths)
    for _ in range(6):
        past = list(lengths)
        lengths = [n + 1 for n in lengths]
        pair.call(1, lengths, past)


def test_prompt_without_past_inputs(rng):
    cfg = G.Gqa(num_heads=6, kv_num_heads=3, head_size=32, rotary=True, past=False)
    pair = Pair(rng, cfg, batch=2, buffer=16, shared=False)
    pair.call(16, [16, 12])


def test_metrics_of_the_gqa_form(rng):
    cfg = G.Gqa(num_heads=4, kv_num_heads=2, head_size=16)
    sess = G.session(cfg, ours=True, node_name="gqa_metrics", select="pages", topk=4, min_keys=0, keep_first=0,
                     keep_recent=0, prefill_rows=0)  # a 40-row prompt selecting as decode steps do
    stepper = G.Stepper(sess, cfg, batch=1, buffer=64, shared=True)
    ortsparse.reset_metrics()
    q, k, v = new_rows(rng, cfg, 1, 40)
    stepper.step(q, k, v, [39], 40)
    m = ortsparse.metrics()["PopcountGroupQueryAttention/gqa_metrics"]
    assert m["op"] == "PopcountGroupQueryAttention" and m["calls"] == 1
    assert m["keys_packed"] == 2 * 40  # every key row of both kv heads summarised once
    assert 0 < m["pages.visited_ratio"] <= 1 and 0 <= m["pages.certified_ratio"] <= 1
    assert m["keys_exact"] < m["keys_total"]


# -- kernels -------------------------------------------------------------------------------------

ISAS = __import__("ortsparse._kernels", fromlist=["supported_isas"]).supported_isas()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("d", [1, 7, 8, 15, 16, 33, 64, 128, 130])
@pytest.mark.parametrize("n", [1, 3, 4, 5, 17])
@pytest.mark.parametrize("gathered", [False, True])
def test_dot_rows_every_isa_against_float64(isa, d, n, gathered, rng):
    from ortsparse import _kernels as K

    q = rng.standard_normal(d).astype(np.float32)
    keys = rng.standard_normal((40, d)).astype(np.float32)
    rows = rng.integers(0, 40, n).astype(np.int32) if gathered else None
    got = K.dot_rows(isa, q, keys if gathered else keys[:n], rows)
    picked = keys[rows] if gathered else keys[:n]
    want = picked.astype(np.float64) @ q.astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(picked).sum(1).max())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("d", [1, 7, 8, 16, 33, 64, 130])
def test_dot_rows_of_a_row_does_not_depend_on_its_place_in_the_list(isa, d, rng):
    """A row's dot is the same bits alone, in a group of four or in the tail of a list (the AVX
    kernels reduced the two in different orders): equal keys score equal, so ties go to the lower
    key, and a page's bound is the same when event-driven reuse bounds it alone."""
    from ortsparse import _kernels as K

    q = rng.standard_normal(d).astype(np.float32)
    keys = rng.standard_normal((9, d)).astype(np.float32)
    alone = np.array([K.dot_rows(isa, q, keys[j:j + 1])[0] for j in range(9)], np.float32)
    for n in range(1, 10):
        np.testing.assert_array_equal(K.dot_rows(isa, q, keys[:n]), alone[:n])
    rows = np.array([8, 0, 3, 3, 5, 1, 7], np.int32)
    np.testing.assert_array_equal(K.dot_rows(isa, q, keys, rows), alone[rows])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("half", [1, 3, 8, 16, 17, 32])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rotate_every_isa_is_bit_identical_to_the_scalar_twin(isa, half, interleaved, rng):
    """fma is exactly rounded: every ISA gives the scalar twin's bits (and onnxruntime's on AVX2)."""
    from ortsparse import _kernels as K

    x = rng.standard_normal(2 * half).astype(np.float32) * 10
    angle = rng.random(half).astype(np.float32) * 6.28
    cos, sin = np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)
    got = K.rotate(isa, x, cos, sin, interleaved)
    assert np.array_equal(got, K.rotate("scalar", x, cos, sin, interleaved))
    re, im = (x[0::2], x[1::2]) if interleaved else (x[:half], x[half:])
    want_re = re.astype(np.float64) * cos - im.astype(np.float64) * sin
    got_re = got[0::2] if interleaved else got[:half]
    np.testing.assert_allclose(got_re, want_re, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("n", [1, 7, 8, 16, 17, 100])
def test_exp_every_isa_is_bit_identical_and_accurate(isa, n, rng):
    from ortsparse import _kernels as K

    x = np.concatenate([rng.uniform(-90, 0, n), [-np.inf, np.nan, -87.5, -86.9, 0.0, -1e-30]]).astype(np.float32)
    got, total = K.exp_sub(isa, x, np.float32(0.0))
    ref_bits, _ = K.exp_sub("scalar", x, np.float32(0.0))
    assert np.array_equal(got.view(np.uint32), ref_bits.view(np.uint32))
    want = np.exp(x.astype(np.float64))
    want[x < -87] = 0.0
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=3e-7, atol=0)
    assert np.isnan(got[~finite & ~np.isneginf(x)]).all() and got[np.isneginf(x)].tolist() == [0.0]
    assert np.isnan(total)
    shifted, total = K.exp_sub(isa, x[:n], np.float32(-3.0))
    np.testing.assert_allclose(total, np.exp(x[:n].astype(np.float64) + 3.0)[x[:n] + 3 >= -87].sum(), rtol=1e-6)
