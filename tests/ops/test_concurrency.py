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
    session = ortsparse.inference_session(model, intra_op_num_threads=intra_op_threads)
    ortsparse.reset_metrics()
    results = hammer(session, {"X": x})
    gated = kwta_matmul(x, w, b, k_frac=0.4)[0]
    dense = x @ w + b
    is_gated = [np.allclose(r, gated, rtol=1e-4, atol=1e-4) for r in results]
    is_dense = [np.allclose(r, dense, rtol=1e-4, atol=1e-4) for r in results]
    assert all(g or d for g, d in zip(is_gated, is_dense))
    stats = ortsparse.metrics()[name]
    assert stats["calls"] == THREADS * CALLS
    if duty_mode == "dense":
        # The step counter is shared: exactly every third call of the session is gated.
        assert sum(is_gated) == stats["kwta.duty_hits"] == THREADS * CALLS // 3 + (THREADS * CALLS % 3 > 0)
    else:
        # Same input every call: the held mask is always the one of x, so every call is gated.
        assert all(is_gated) and stats["kwta.duty_hits"] == -(-THREADS * CALLS // 3)
