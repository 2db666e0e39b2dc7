"""8 threads x 1000 Run() calls on one shared session per stateful op: no crash, every result is one
the documented semantics allow, counters add up. scripts/sanitize.sh tsan runs these under TSan."""
from __future__ import annotations

import threading

import numpy as np
import pytest

import ortsparse

from .onnx_builders import kwta_model
from .reference import kwta_matmul

THREADS, CALLS = 8, 1000
# Outputs from plain new/delete instead of onnxruntime's arena: onnxruntime is not instrumented, so
# TSan cannot see the arena hand a finished run's output block (still being copied out by numpy a
# moment before) to another run, and reports our kernel's write into it as a race.
NO_ARENA = {"enable_cpu_mem_arena": False}


def hammer(session, feeds, threads=THREADS, calls=CALLS):
    results: list[list[np.ndarray]] = [[] for _ in range(threads)]
    errors: list[BaseException] = []
    start = threading.Barrier(threads)

    def worker(slot):
        try:
            start.wait()
            for _ in range(calls):
                results[slot].append(session.run(None, feeds)[0])
        except BaseException as error:  # noqa: BLE001 - reported by the test
            errors.append(error)

    workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors, errors[:3]
    return [r for per_thread in results for r in per_thread]


@pytest.mark.concurrency
# "pool": ORT's intra-op pool also runs our tasks. TSan cannot follow ORT's (uninstrumented) pool
# hand-off, so scripts/sanitize.sh tsan runs only the "caller" variant (Run() on the caller threads).
@pytest.mark.parametrize("intra_op_threads", [1, 2], ids=["caller", "pool"])
@pytest.mark.parametrize("duty_mode", ["dense", "hold"])
def test_kwta_duty_under_concurrent_runs(duty_mode, intra_op_threads):
    rng = np.random.default_rng(8)
    k, n = 96, 40
    w = rng.standard_normal((k, n)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    x = rng.standard_normal((2, k)).astype(np.float32)
    name = f"conc_{duty_mode}_{intra_op_threads}"
    model = kwta_model(w, b, k_frac=0.4, duty=3, duty_mode=duty_mode, node_name=name)
    session = ortsparse.inference_session(model, intra_op_num_threads=intra_op_threads, **NO_ARENA)
    ortsparse.reset_metrics()
    results = hammer(session, {"X": x})
    gated = kwta_matmul(x, w, b, k_frac=0.4)[0]
    dense = x @ w + b
    is_gated = [np.allclose(r, gated, rtol=1e-4, atol=1e-4) for r in results]
    is_dense = [np.allclose(r, dense, rtol=1e-4, atol=1e-4) for r in results]
    assert all(g or d for g, d in zip(is_gated, is_dense))
    stats = ortsparse.metrics()[f"KwtaBlockMatMul/{name}"]
    assert stats["calls"] == THREADS * CALLS
    if duty_mode == "dense":
        # The step counter is shared: exactly every third call of the session is gated.
        assert sum(is_gated) == stats["kwta.duty_hits"] == THREADS * CALLS // 3 + (THREADS * CALLS % 3 > 0)
    else:
        # Same input every call: the held mask is always the one of x, so every call is gated.
        assert all(is_gated) and stats["kwta.duty_hits"] == -(-THREADS * CALLS // 3)


@pytest.mark.concurrency
@pytest.mark.parametrize("intra_op_threads", [1, 2], ids=["caller", "pool"])
def test_event_exact_mode_under_concurrent_runs(intra_op_threads):
    """Streams are shared by concurrent callers (documented); in exact mode every result is the dense
    one whatever the interleaving, and the counters add up."""
    from .onnx_builders import event_model

    rng = np.random.default_rng(9)
    k, n = 64, 24
    w = rng.standard_normal((k, n)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    name = f"ev_conc_{intra_op_threads}"
    model = event_model(w, b, axis="call", gap_every=7, node_name=name, topk=1.0, delta_theta=0.0,
                        stale_beta=1.0, stale_lambda=0.0)
    session = ortsparse.inference_session(model, intra_op_num_threads=intra_op_threads, **NO_ARENA)
    ortsparse.reset_metrics()
    inputs = [rng.standard_normal((2, k)).astype(np.float32) for _ in range(THREADS)]
    results, errors = [[] for _ in range(THREADS)], []
    start = threading.Barrier(THREADS)

    def worker(slot):
        try:
            start.wait()
            for j in range(CALLS):
                x = inputs[slot] + np.float32(1e-3 * (j % 7))
                results[slot].append((x, session.run(None, {"X": x})[0]))
        except BaseException as error:  # noqa: BLE001 - reported by the test
            errors.append(error)

    workers = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    assert not errors, errors[:3]
    for per_thread in results:
        for x, y in per_thread:
            np.testing.assert_allclose(y, x @ w + b, rtol=1e-4, atol=1e-4)
    stats = ortsparse.metrics()[f"EventDrivenMatMul/{name}"]
    assert stats["calls"] == THREADS * CALLS and stats["rows"] == 2 * THREADS * CALLS


@pytest.mark.concurrency
@pytest.mark.parametrize("intra_op_threads", [1, 2], ids=["caller", "pool"])
def test_popcount_attention_sequences_under_concurrent_runs(intra_op_threads):
    """One decoding sequence per thread on one session: the packed-key cache never serves another
    sequence's keys, so every result equals the reference selection + attention."""
    from . import attention_reference as ref

    session = ortsparse.inference_session(ref.attention_model(node_name="pop_conc", topk=6, min_keys=0,
                                                              is_causal=1, center=0),
                                          intra_op_num_threads=intra_op_threads, **NO_ARENA)
    seqs = []
    for s in range(THREADS):
        r = np.random.default_rng(100 + s)
        q = r.standard_normal((1, 4, 1, 32)).astype(np.float32)
        k = r.standard_normal((1, 2, 48, 32)).astype(np.float32)
        v = r.standard_normal((1, 2, 48, 32)).astype(np.float32)
        seqs.append((q, k, v))
    lengths = range(40, 48)
    expected = {}
    for s, (q, k, v) in enumerate(seqs):
        for n in lengths:
            keep = ref.selected_keys(q, k[:, :, :n], causal=True, topk=6, center=False)
            expected[s, n] = ref.attention(q, k[:, :, :n], v[:, :, :n], causal=True, keep=keep)
    feeds = {(s, n): {"Q": q, "K": np.ascontiguousarray(k[:, :, :n]), "V": np.ascontiguousarray(v[:, :, :n])}
             for s, (q, k, v) in enumerate(seqs) for n in lengths}
    errors, start = [], threading.Barrier(THREADS)

    def worker(s):
        try:
            start.wait()
            for j in range(CALLS):
                n = lengths[j % len(lengths)]
                y = session.run(None, feeds[s, n])[0]
                np.testing.assert_allclose(y, expected[s, n], rtol=1e-5, atol=2e-6)
        except BaseException as error:  # noqa: BLE001 - reported by the test
            errors.append(error)

    workers = [threading.Thread(target=worker, args=(s,)) for s in range(THREADS)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    assert not errors, errors[:2]
