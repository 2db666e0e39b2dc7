"""PopcountGroupQueryAttention with window-sized KV buffers (sliding_window_cache=1, what
onnxruntime-genai's builder writes for sliding-window layers) against onnxruntime's own op over the
same calls: with exact attention the outputs agree within 1e-5 of the output scale and the resident
rows of present_key / present_value (rows [0, L(T)), onnxruntime's layout) are bit-identical — over
decodes that wrap the buffer many times, prompts shorter and longer than the buffer, later prompt
chunks that evict rows their own queries read (the staged path), batches of different lengths, both
buffer modes (one buffer bound as past and present, as onnxruntime-genai does, or separate tensors)."""
from __future__ import annotations

import numpy as np
import pytest

import ortsparse

from . import gqa_graphs as G
from .test_gqa_op import EXACT, assert_matches, new_rows


def resident(total: int, capacity: int, window: int) -> int:
    """onnxruntime's L(T) (docs/contrib_ops/cpu/gqa.md of onnxruntime), written out independently."""
    if total <= capacity:
        return total
    block = capacity - window + 1
    return total - block * -(-(total - capacity) // block)


class WindowPair:
    """onnxruntime's op and ours on window-sized buffers of `capacity` rows, fed the same calls."""

    def __init__(self, rng, cfg: G.Gqa, *, batch: int, capacity: int, shared: bool, attrs=None):
        self.rng, self.cfg, self.batch, self.capacity = rng, cfg, batch, capacity
        cos = sin = None
        if cfg.rotary:
            cos, sin = G.rotary_tables(rng, 512, cfg.half)
        window = {"sliding_window_cache": 1}
        self.theirs = G.Stepper(G.session(cfg, ours=False, **window), cfg, batch=batch, buffer=capacity, shared=True,
                                cos=cos, sin=sin)
        self.ours = G.Stepper(G.session(cfg, ours=True, **window, **(attrs or EXACT)), cfg, batch=batch,
                              buffer=capacity, shared=True, cos=cos, sin=sin)
        # Separate tensors: window-sized past fed, window-sized present returned (never growing).
        self.theirs.shared = self.ours.shared = shared

    def call(self, s: int, lengths, past=None, exact: bool = True) -> np.ndarray:
        """One call of s new rows per entry; lengths: positions after the call (seqlens_k + 1)."""
        past = [0] * self.batch if past is None else past
        first_prompt = all(p == 0 for p in past)
        total = s if first_prompt else max(lengths)
        q, k, v = new_rows(self.rng, self.cfg, self.batch, s)
        seqlens = [n - 1 for n in lengths]
        theirs = self.theirs.step(q, k, v, seqlens, total)
        ours = self.ours.step(q, k, v, seqlens, total)
        assert ours.shape == theirs.shape and self.ours.k.shape == (self.batch, self.cfg.kv_num_heads, self.capacity,
                                                                     self.cfg.head_size)
        if exact:
            assert_matches(ours, theirs, [min(s, n) for n in lengths] if first_prompt else None)
        for b, n in enumerate(lengths):
            rows = resident(n, self.capacity, self.cfg.local_window)
            assert np.array_equal(self.ours.k[b, :, :rows], self.theirs.k[b, :, :rows]), (b, n, rows)
            assert np.array_equal(self.ours.v[b, :, :rows], self.theirs.v[b, :, :rows]), (b, n, rows)
        return ours


@pytest.mark.parametrize("window,capacity", [(4, 4), (4, 6), (8, 24)], ids=["C=W", "C=W+2", "C=W+16"])
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("rotary", [False, True])
def test_decode_wrapping_the_window_buffer_matches_onnxruntime(window, capacity, shared, rotary, rng):
    cfg = G.Gqa(num_heads=4, kv_num_heads=2, head_size=16, local_window=window, rotary=rotary, packed=rotary)
    pair = WindowPair(rng, cfg, batch=1, capacity=capacity, shared=shared)
    pair.call(3, [3])
    for n in range(3, 3 + 4 * capacity):  # the buffer fills and compacts several times
        pair.call(1, [n + 1], [n])


@pytest.mark.parametrize("prompt", [5, 6, 7, 40], ids=lambda n: f"prompt{n}")
@pytest.mark.parametrize("shared", [True, False])
def test_prompt_then_tokens_match_onnxruntime(prompt, shared, rng):
    """A first prompt shorter than, as long as and longer than the buffer (staged), then tokens."""
    cfg = G.Gqa(num_heads=6, kv_num_heads=3, head_size=32, local_window=4, rotary=True)
    pair = WindowPair(rng, cfg, batch=1, capacity=6, shared=shared)
    pair.call(prompt, [prompt])
    for n in range(prompt, prompt + 9):
        pair.call(1, [n + 1], [n])


@pytest.mark.parametrize("shared", [True, False])
def test_later_prompt_chunks_that_evict_what_they_read_match_onnxruntime(shared, rng):
    """Chunks after a past: inside the slack (in place), and longer (staged: the chunk's first queries
    read rows the chunk evicts)."""
    cfg = G.Gqa(num_heads=4, kv_num_heads=2, head_size=16, local_window=4, rotary=True, packed=True)
    pair = WindowPair(rng, cfg, batch=1, capacity=6, shared=shared)
    total = 0
    for s in (3, 1, 1, 1, 2, 2, 3, 5, 1, 9, 1, 2, 2, 2, 30, 1):
        pair.call(s, [total + s], None if total == 0 else [total])
        total += s


def test_batch_entries_of_different_lengths_keep_their_own_windows(rng):
    """Decode steps of 4 entries at 11, 7, 2 and 5 positions (each entry's buffer as onnxruntime's op
    left it after its own prompt; it refuses right-padded prompts with this layout): each entry
    compacts at its own step."""
    cfg = G.Gqa(num_heads=4, kv_num_heads=2, head_size=16, local_window=4, rotary=True)
    lengths = [11, 7, 2, 5]
    first = [WindowPair(rng, cfg, batch=1, capacity=6, shared=True) for _ in lengths]
    for single, n in zip(first, lengths):
        single.call(n, [n])
    pair = WindowPair(rng, cfg, batch=4, capacity=6, shared=True)
    for stepper in (pair.theirs, pair.ours):
        stepper.cos, stepper.sin = first[0].theirs.cos, first[0].theirs.sin
        stepper.k = np.concatenate([single.theirs.k for single in first])
        stepper.v = np.concatenate([single.theirs.v for single in first])
    for _ in range(9):
        past = list(lengths)
        lengths = [n + 1 for n in lengths]
        pair.call(1, lengths, past)


def test_window_longer_than_min_keys_selects_and_keeps_the_layout(rng):
    """A window long enough for selection (min_keys below it): the selector runs over the window's
    keys (fewer exact scores than keys attended) and the buffer layout stays onnxruntime's; with
    min_keys above the window the same calls are exact."""
    cfg = G.Gqa(num_heads=4, kv_num_heads=2, head_size=16, local_window=48)
    selecting = {"select": "pages", "topk": 8, "min_keys": 16, "keep_first": 0, "keep_recent": 4, "page_size": 4,
                 "candidates": 1.0}
    ortsparse.reset_metrics()
    pair = WindowPair(rng, cfg, batch=1, capacity=56, shared=True, attrs=selecting)
    pair.call(30, [30], exact=False)
    for n in range(30, 150):
        out = pair.call(1, [n + 1], [n], exact=False)
        assert np.isfinite(out).all()
    m = ortsparse.metrics()["PopcountGroupQueryAttention/gqa"]
    assert m["keys_exact"] < m["keys_total"]
    exact = WindowPair(rng, cfg, batch=1, capacity=56, shared=True, attrs={**selecting, "min_keys": 49})
    exact.call(30, [30])
    for n in range(30, 150):
        exact.call(1, [n + 1], [n])


@pytest.mark.parametrize("capacity,past,message", [
    (3, True, "past_key holds 3 rows per head, fewer than local_window_size=4"),
    (6, False, "sliding_window_cache=1 needs the past_key / past_value inputs"),
])
def test_bad_window_buffers_are_refused_with_the_values(capacity, past, message, rng):
    cfg = G.Gqa(num_heads=4, kv_num_heads=2, head_size=16, local_window=4, past=past)
    stepper = G.Stepper(G.session(cfg, ours=True, sliding_window_cache=1), cfg, batch=1, buffer=capacity, shared=True)
    q, k, v = new_rows(rng, cfg, 1, 2)
    with pytest.raises(Exception) as info:
        stepper.step(q, k, v, [1], 2)
    assert "PopcountGroupQueryAttention node 'gqa'" in str(info.value) and message in str(info.value)


@pytest.mark.parametrize("shared", [True, False])
def test_key_summaries_reused_across_compactions_select_as_fresh_ones(shared, rng):
    """The key cache reuses the summaries of rows unchanged since the last call; rows moved by a
    compaction (or a staged chunk) are summarised anew: with selection on, reuse (pack_cache=1, by
    provenance) gives bit-identical outputs to summarising every row every call (pack_cache=0)."""
    cfg = G.Gqa(num_heads=4, kv_num_heads=2, head_size=16, local_window=40, rotary=True)
    selecting = {"select": "pages", "topk": 8, "min_keys": 16, "keep_first": 0, "keep_recent": 4, "page_size": 4,
                 "candidates": 1.0, "verify_keys": 0}
    cos, sin = G.rotary_tables(rng, 512, cfg.half)
    steppers = [G.Stepper(G.session(cfg, ours=True, sliding_window_cache=1, pack_cache=cache, **selecting), cfg,
                          batch=1, buffer=48, shared=True, cos=cos, sin=sin) for cache in (1, 0)]
    for stepper in steppers:
        stepper.shared = shared
    total = 0
    for s in [30] + [1] * 60 + [12, 1, 1, 50] + [1] * 30:
        q, k, v = new_rows(rng, cfg, 1, s)
        total += s
        reused, fresh = (stepper.step(q, k, v, [total - 1], total) for stepper in steppers)
        assert np.array_equal(reused, fresh), total
