"""The key summaries of PopcountGroupQueryAttention across calls. A call reuses the previous call's
summaries (page bounds, packed bits, energies) only for rows the facts vouch for: the previous call
wrote its K into the buffer this call's past rows come from (the same buffer when past and present
share it, the past tensor otherwise), and only rows [0, past length). A new prompt, a rewound
cache, another buffer: resummarised. verify_keys=1 also hashes every reused row.

The reference is the same op with pack_cache=0 (every call summarises every key): with a budgeted
page selection the kept keys depend on every bound, so any stale summary changes the output."""
from __future__ import annotations

import threading

import numpy as np
import pytest

import ortsparse

from . import gqa_graphs as G

CFG = G.Gqa(num_heads=4, kv_num_heads=2, head_size=16, rotary=True)
SELECT = dict(select="pages", topk=4, page_size=4, candidates=1.5, min_keys=0, keep_first=1, keep_recent=2)


class Twin:
    """Our op with the key cache and without (pack_cache=0), fed the same calls."""

    def __init__(self, rng, *, shared=True, batch=2, buffer=96, verify=0, select=None, name="cache"):
        self.rng, self.batch, self.buffer, self.shared = rng, batch, buffer, shared
        self.cos, self.sin = G.rotary_tables(rng, buffer, CFG.half)
        attrs = {**(select or SELECT), "verify_keys": verify}
        self.cached_session = G.session(CFG, ours=True, node_name=name, **attrs)
        self.fresh_session = G.session(CFG, ours=True, node_name=name + "_fresh", pack_cache=0, **attrs)
        self.name = name
        self.cached, self.fresh = self.stepper(self.cached_session), self.stepper(self.fresh_session)

    def stepper(self, session):
        return G.Stepper(session, CFG, batch=self.batch, buffer=self.buffer, shared=self.shared, cos=self.cos,
                         sin=self.sin)

    def call(self, s, lengths, first_prompt=False, steppers=None):
        cached, fresh = steppers or (self.cached, self.fresh)
        q = self.rng.standard_normal((self.batch, s, CFG.hidden), dtype=np.float32)
        k = self.rng.standard_normal((self.batch, s, CFG.kv_hidden), dtype=np.float32)
        v = self.rng.standard_normal((self.batch, s, CFG.kv_hidden), dtype=np.float32)
        total = s if first_prompt else max(lengths)
        seqlens = [n - 1 for n in lengths]
        a = cached.step(q, k, v, seqlens, total)
        b = fresh.step(q, k, v, seqlens, total)
        rows = [min(s, n) for n in lengths] if first_prompt else [s] * self.batch
        for i, n in enumerate(rows):
            assert np.array_equal(a[i, :n], b[i, :n])
        return a

    def packed(self):
        return ortsparse.metrics()[f"PopcountGroupQueryAttention/{self.name}"]["keys_packed"]


def test_decode_summarises_only_the_new_rows(rng):
    twin = Twin(rng)
    ortsparse.reset_metrics()
    lengths = [30, 17]
    twin.call(30, lengths, first_prompt=True)
    assert twin.packed() == 2 * (30 + 17)  # every valid row of both kv heads
    for _ in range(20):
        lengths = [n + 1 for n in lengths]
        twin.call(1, lengths)
    assert twin.packed() == 2 * (30 + 17) + 20 * 2 * 2  # then one row per entry and kv head per step


def test_new_prompt_rewind_and_chunks_are_resummarised(rng):
    twin = Twin(rng, batch=1)
    ortsparse.reset_metrics()
    lengths = [40]
    twin.call(40, lengths, first_prompt=True)
    for _ in range(5):
        lengths = [lengths[0] + 1]
        twin.call(1, lengths)
    twin.call(1, [31])          # rewound to 30 past rows: the boundary page is rebuilt
    twin.call(1, [32])
    twin.call(12, [44])         # a later prompt chunk
    twin.call(25, [25], first_prompt=True)  # a new prompt in the same session
    twin.call(1, [26])
    assert twin.packed() == 2 * (40 + 5 + 1 + 1 + 12 + 25 + 1)


def test_another_buffer_is_resummarised(rng):
    twin = Twin(rng, batch=1)
    other = (twin.stepper(twin.cached_session), twin.stepper(twin.fresh_session))
    twin.call(20, [20], first_prompt=True)
    twin.call(20, [20], first_prompt=True, steppers=other)
    for n in range(21, 30):  # alternate between the two buffers
        twin.call(1, [n])
        twin.call(1, [n], steppers=other)


def test_separate_buffers_reuse_the_previous_present(rng):
    twin = Twin(rng, shared=False)
    ortsparse.reset_metrics()
    lengths = [12, 20]
    twin.call(20, lengths, first_prompt=True)
    for _ in range(10):
        lengths = [n + 1 for n in lengths]
        twin.call(1, lengths)
    assert twin.packed() == 2 * (12 + 20) + 10 * 2 * 2


def test_a_row_changed_behind_the_ops_back(rng):
    """Provenance trusts the rows this kernel wrote into the buffer: an app that edits them must
    set verify_keys=1, which hashes every reused row and resummarises from the first change."""
    for verify in (0, 1):
        twin = Twin(rng, batch=1, verify=verify, name=f"edit{verify}")
        twin.call(40, [40], first_prompt=True)
        for buffer in (twin.cached.k, twin.fresh.k):
            buffer[0, :, 5] = 3.0  # the same edit in both
        ortsparse.reset_metrics()
        if verify:
            twin.call(1, [41])
            assert twin.packed() == 2 * (41 - 5)  # resummarised from row 5 on
        else:
            q = rng.standard_normal((1, 1, CFG.hidden), dtype=np.float32)
            k = rng.standard_normal((1, 1, CFG.kv_hidden), dtype=np.float32)
            twin.cached.step(q, k, k, [40], 41)
            assert twin.packed() == 2  # only the new row: the edit is not seen


def test_rows_the_kernel_did_not_write_are_never_reused(rng):
    """A past the app filled itself (the kernel never saw a call starting at row 0) is not trusted:
    every call resummarises all rows, so replacing them (even in the same buffer, at the same
    length) is seen. Reuse needs the trusted prefix: rows the kernel wrote from row 0 on."""
    twin = Twin(rng, batch=1, name="prefilled")
    for _ in range(2):
        rows = rng.standard_normal((2, 30, CFG.head_size)).astype(np.float32)
        for buffer in (twin.cached.k, twin.fresh.k):
            buffer[0, :, :30] = rows
        ortsparse.reset_metrics()
        twin.call(1, [31])  # past 30: rows the app wrote
        assert twin.packed() == 2 * 31
        twin.call(1, [32])
        assert twin.packed() == 2 * 31 + 2 * 32


def test_rows_written_below_min_keys_count_as_the_kernels_own(rng):
    """A prompt shorter than min_keys runs exact and builds no summaries, but the rows it writes are
    the kernel's: once a step reaches min_keys they are summarised once, then only new rows."""
    twin = Twin(rng, batch=1, name="crossing", select={**SELECT, "min_keys": 24})
    ortsparse.reset_metrics()
    twin.call(20, [20], first_prompt=True)
    for n in range(21, 24):
        twin.call(1, [n])
    assert twin.packed() == 0
    twin.call(1, [24])
    assert twin.packed() == 2 * 24
    for n in range(25, 30):
        twin.call(1, [n])
    assert twin.packed() == 2 * 24 + 5 * 2


def test_concurrent_runs_on_different_buffers(rng):
    twin = Twin(rng, batch=1)
    steppers = [(twin.stepper(twin.cached_session), twin.stepper(twin.fresh_session)) for _ in range(3)]
    errors = []

    def work(pair, seed):
        local = np.random.default_rng(seed)
        try:
            for n in range(30, 45):
                q = local.standard_normal((1, 1 if n > 30 else 30, CFG.hidden), dtype=np.float32)
                k = local.standard_normal((1, q.shape[1], CFG.kv_hidden), dtype=np.float32)
                outs = [st.step(q, k, k, [n - 1], n if n > 30 else 30) for st in pair]
                assert np.array_equal(outs[0], outs[1])
        except AssertionError as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(pair, i)) for i, pair in enumerate(steppers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


@pytest.mark.parametrize("select", [dict(select="popcount", topk=4, candidates=2.0, min_keys=0, proj_bits=64),
                                    dict(select="energy", topk=6, min_keys=0)], ids=["popcount", "energy"])
def test_other_selectors_reuse_by_provenance_too(select, rng):
    twin = Twin(rng, select=select, buffer=320, name=f"sel_{select['select']}")
    lengths = [300, 260]  # past the popcount center rows (256)
    twin.call(300, lengths, first_prompt=True)
    for _ in range(6):
        lengths = [n + 1 for n in lengths]
        twin.call(1, lengths)
    twin.call(1, [200, 200])  # rewound below the center rows: repacked
