"""PopcountAttention reuse_rows=1 (re-encoding, ops/attention/reencode.h): every call's output
equals a full re-run of the same node with the mode off, while the metrics show rows were reused
or corrected rather than recomputed."""
from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest
from onnx import TensorProto

import ortsparse
from ortsparse import _kernels as K

from .isa_runs import run_file_under_isa
from . import attention_reference as ref

ISAS = K.supported_isas()
H, HKV, S, D = 4, 2, 64, 16


def sessions(node, mask_type=None, mask_shape=None, **attrs):
    """(re-encoding session, full re-run session) of one PopcountAttention node (select none)."""
    attrs = {"select": "none", **attrs}
    ours = ref.attention_model(mask_type=mask_type, mask_shape=mask_shape, node_name=node, reuse_rows=1, **attrs)
    full = ref.attention_model(mask_type=mask_type, mask_shape=mask_shape, node_name=node + ".full", **attrs)
    return (ortsparse.inference_session(ours, intra_op_num_threads=1),
            ortsparse.inference_session(full, intra_op_num_threads=1))


def feeds(q, k, v, mask=None):
    out = {"Q": q, "K": k, "V": v}
    if mask is not None:
        out["attn_mask"] = mask
    return out


def counters(node):
    return ortsparse.metrics().get(f"PopcountAttention.reencode/{node}", {})


def check_close(got, want):
    assert np.abs(got - want).max() <= 1e-5 * max(np.abs(want).max(), 1e-30)


def change_tokens(rng, x, tokens):
    """x with the rows of `tokens` (positions, per batch entry) replaced, every head."""
    x = x.copy()
    for b, positions in enumerate(tokens):
        x[b][:, positions, :] = rng.standard_normal((x.shape[1], len(positions), x.shape[3])).astype(np.float32)
    return x


def make_mask(kind, batch, rng):
    if kind is None:
        return None, None, None
    if kind == "bool":  # key padding, as an encoder's attention mask: [B, 1, 1, S]
        keep = np.ones((batch, 1, 1, S), dtype=bool)
        keep[:, :, :, -5:] = False
        return keep, TensorProto.BOOL, [batch, 1, 1, S]
    add = rng.standard_normal((1, H, S, S)).astype(np.float32)  # per head and query
    add[rng.random(add.shape) < 0.2] = -1e9
    add[..., 0] = 0.0
    return add, TensorProto.FLOAT, [1, H, S, S]


FRACTIONS = {"none": 0, "one": 1, "tenth": S // 10, "all": S}


@pytest.mark.parametrize("isa", ISAS)
def test_every_isa_reencodes_the_same(isa):
    """This file's tests under each ISA's kernels (ORTSPARSE_ISA is read once per process)."""
    run_file_under_isa(__file__, isa)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("mask", [None, "bool", "float"])
@pytest.mark.parametrize("changed", sorted(FRACTIONS))
def test_reencoding_equals_a_full_rerun(batch, mask, changed):
    rng = np.random.default_rng(7)
    node = f"re.{batch}.{mask}.{changed}"
    mask_value, mask_type, mask_shape = make_mask(mask, batch, rng)
    ours, full = sessions(node, mask_type, mask_shape)
    q, k, v = ref_qkv(rng, batch)
    count = FRACTIONS[changed]
    for call in range(4):
        if call > 0:
            tokens = [rng.choice(S, count, replace=False) for _ in range(batch)]
            q, k, v = (change_tokens(rng, x, tokens) for x in (q, k, v))
        f = feeds(q, k, v, mask_value)
        check_close(ours.run(None, f)[0], full.run(None, f)[0])
    m = counters(node)
    rows = batch * H * S
    assert m["calls_applied"] == 4 and m["resets"] == 1
    assert m["rows_reused"] + m["rows_corrected"] + m["rows_recomputed"] == 4 * rows
    changed_rows = 3 * batch * H * count
    if count == 0:
        assert m["rows_reused"] == 3 * rows and m["rows_recomputed"] == rows
    elif count == S:
        assert m["rows_recomputed"] == 4 * rows
    else:  # the changed tokens' rows are recomputed; every other row attends them: corrected
        masked_out = mask == "bool"  # a changed token among the 5 padding keys changes no other row
        assert m["rows_recomputed"] == rows + changed_rows
        assert m["rows_corrected"] + m["rows_reused"] == 3 * rows - changed_rows
        assert m["rows_corrected"] > 0 or masked_out


def ref_qkv(rng, batch, s=S):
    q = rng.standard_normal((batch, H, s, D)).astype(np.float32)
    k = rng.standard_normal((batch, HKV, s, D)).astype(np.float32)
    v = rng.standard_normal((batch, HKV, s, D)).astype(np.float32)
    return q, k, v


def change_kv_tokens(rng, q, k, v, tokens):
    return change_tokens(rng, q, tokens), change_tokens(rng, k, tokens), change_tokens(rng, v, tokens)


@pytest.mark.parametrize("causal", [0, 1])
def test_causal_rows_reuse_when_only_later_keys_changed(causal, rng):
    node = f"re.causal.{causal}"
    ours, full = sessions(node, is_causal=causal)
    q, k, v = ref_qkv(rng, 1)
    for f in (feeds(q, k, v), feeds(*change_kv_tokens(rng, q, k, v, [[S - 1]]))):
        check_close(ours.run(None, f)[0], full.run(None, f)[0])
    m = counters(node)
    if causal:  # only the last query attends the last key: every other row is reused
        assert m["rows_reused"] == H * (S - 1) and m["rows_recomputed"] == H * S + H
    else:
        assert m["rows_corrected"] == H * (S - 1)


def test_a_changed_mask_row_is_recomputed(rng):
    mask_value, mask_type, mask_shape = make_mask("float", 1, rng)
    node = "re.mask.changes"
    ours, full = sessions(node, mask_type, mask_shape)
    q, k, v = ref_qkv(rng, 1)
    for call in range(3):
        if call == 2:
            mask_value = mask_value.copy()
            mask_value[0, 1, 5, 7] += 1.0  # one entry of one row (head 1, query 5)
        f = feeds(q, k, v, mask_value)
        check_close(ours.run(None, f)[0], full.run(None, f)[0])
    m = counters(node)
    assert m["rows_recomputed"] == H * S + 1 and m["rows_reused"] == 2 * H * S - 1


def test_many_small_corrections_stay_exact(rng):
    """Forty calls, each changing one key: the state is corrected again and again (and refreshed by
    the precision guard when the mass through a running sum grows); outputs stay within 1e-5."""
    node = "re.drift"
    ours, full = sessions(node)
    q, k, v = ref_qkv(rng, 1)
    k *= 3.0  # peaked softmaxes: changing a dominant key removes most of a row's mass
    for _ in range(40):
        j = int(rng.integers(S))
        k = k.copy()
        v = v.copy()
        k[0, :, j] = 3.0 * rng.standard_normal((HKV, D)).astype(np.float32)
        v[0, :, j] = rng.standard_normal((HKV, D)).astype(np.float32)
        f = feeds(q, k, v)
        check_close(ours.run(None, f)[0], full.run(None, f)[0])
    m = counters(node)
    assert m["rows_corrected"] > 30 * H * S  # nearly every row of every call after the first


def test_sliding_window_over_a_stream(rng):
    """A window of S rows sliding over a stream by 3 rows per call: every row's content moves, so
    nothing is reused by position; a ring buffer (the new rows overwrite the oldest slots) keeps
    the other rows in place: corrected. Both equal the full re-run."""
    stream = [rng.standard_normal((1, n, 400, D)).astype(np.float32) for n in (H, HKV, HKV)]
    for layout in ("shift", "ring"):
        node = f"re.window.{layout}"
        ours, full = sessions(node)
        ring = [x[:, :, :S].copy() for x in stream]
        for start in range(0, 60, 3):
            if layout == "shift":
                q, k, v = (x[:, :, start:start + S] for x in stream)
            else:
                for x, r in zip(stream, ring):
                    for t in range(start, start + 3):
                        r[:, :, (S + t) % S] = x[:, :, S + t]
                q, k, v = ring
            f = feeds(np.ascontiguousarray(q), np.ascontiguousarray(k), np.ascontiguousarray(v))
            check_close(ours.run(None, f)[0], full.run(None, f)[0])
        m = counters(node)
        if layout == "shift":
            assert m["rows_reused"] == 0 and m["rows_corrected"] == 0
        else:  # 3 slots recomputed per call; the others corrected (or refreshed by the precision guard)
            assert m["rows_recomputed"] >= H * S + 19 * H * 3
            assert m["rows_corrected"] >= 0.9 * 19 * H * (S - 3)


def test_a_shape_change_resets_the_state(rng):
    node = "re.shapes"
    ours, full = sessions(node)
    for s in (S, 48, 48, S):
        q, k, v = ref_qkv(np.random.default_rng(s), 1, s)
        f = feeds(q, k, v)
        check_close(ours.run(None, f)[0], full.run(None, f)[0])
    m = counters(node)
    assert m["resets"] == 3 and m["rows_reused"] == H * 48


@pytest.mark.concurrency
def test_two_threads_on_one_session_are_never_wrong(rng):
    """ORT may run one kernel from two threads: a call that finds the state busy computes in full,
    and no call sees another's half-updated state."""
    node = "re.threads"
    ours, full = sessions(node)
    base = ref_qkv(rng, 1)
    inputs = [change_kv_tokens(np.random.default_rng(t), *base, [[t % S, (7 * t) % S]]) for t in range(24)]
    wants = [full.run(None, feeds(*x))[0] for x in inputs]
    errors = []

    def worker(offset):
        for t in itertools.chain(range(offset, 24, 2), range(offset, 24, 2)):
            got = ours.run(None, feeds(*inputs[t]))[0]
            if not np.abs(got - wants[t]).max() <= 1e-5 * np.abs(wants[t]).max():
                errors.append(t)

    threads = [threading.Thread(target=worker, args=(o,)) for o in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    m = counters(node)
    assert m["calls"] == 48 and m["calls_applied"] + m["calls_busy"] == 48
    assert m["rows_corrected"] > 0


def test_tolerance_reuses_rows_within_it_and_refreshes_beyond(rng):
    node = "re.tol"
    ours, full = sessions(node, reuse_tol=1e-3)
    q, k, v = ref_qkv(rng, 1)
    ours.run(None, feeds(q, k, v))
    jitter = [x * (1 + 1e-5 * rng.standard_normal(x.shape)).astype(np.float32) for x in (q, k, v)]
    f = feeds(*jitter)
    got, want = ours.run(None, f)[0], full.run(None, f)[0]
    assert np.abs(got - want).max() <= 1e-3 * np.abs(want).max()
    assert counters(node)["rows_reused"] == H * S  # every row within 1e-3: all reused
    moved = change_kv_tokens(rng, *jitter, [[3]])  # one token far beyond the tolerance
    f = feeds(*moved)
    got, want = ours.run(None, f)[0], full.run(None, f)[0]
    assert np.abs(got - want).max() <= 1e-3 * np.abs(want).max()
    m = counters(node)  # token 3's query rows recomputed, every other row corrected for its key
    assert m["rows_recomputed"] == H * S + H and m["rows_corrected"] == H * (S - 1)


@pytest.mark.parametrize("tol", [0.0, 0.1])
def test_non_finite_inputs_fall_back_to_the_full_path(tol, rng):
    """A NaN is never within a tolerance: the call runs the engine (NaN where it puts it) and the
    next call rebuilds the state."""
    node = f"re.nan.{tol}"
    ours, full = sessions(node, reuse_tol=tol)
    q, k, v = ref_qkv(rng, 1)
    ours.run(None, feeds(q, k, v))
    v = v.copy()
    v[0, 1, 9, 2] = np.nan
    f = feeds(q, k, v)
    got, want = ours.run(None, f)[0], full.run(None, f)[0]
    assert np.isnan(want).any()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert counters(node)["calls_applied"] == 1  # the NaN call ran the engine
    v[0, 1, 9, 2] = 0.5
    f = feeds(q, k, v)
    check_close(ours.run(None, f)[0], full.run(None, f)[0])
    assert counters(node)["resets"] == 2


def test_bad_reuse_rows_is_a_clear_error():
    model = ref.attention_model(node_name="re.bad", reuse_rows=2, select="none")
    with pytest.raises(Exception, match="reuse_rows=2 must be 0 or 1"):
        ortsparse.inference_session(model)
