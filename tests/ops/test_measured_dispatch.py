"""The per-node choice between the calling thread and the intra-op pool (common/measured_dispatch.h),
driven with given timings."""
from __future__ import annotations

import numpy as np
import pytest

from ortsparse import _kernels as K


def run_trial(dispatch, serial_time, pool_time):
    """Answers every timed call with its way's time until the trial ends; returns the ways asked for."""
    ways = []
    while True:
        pool, timed = dispatch.next()
        if not timed:
            return ways
        ways.append(pool)
        dispatch.record(pool, timed, pool_time if pool else serial_time)


@pytest.mark.parametrize("serial_time,pool_time,uses_pool", [(2.0, 1.0, True), (1.0, 2.0, False)])
def test_the_trial_alternates_and_keeps_the_faster_way(serial_time, pool_time, uses_pool):
    dispatch = K.MeasuredDispatch(trial_calls=4, recheck_every=100)
    assert not dispatch.uses_pool and dispatch.trials == 0  # before any trial: the calling thread
    ways = run_trial(dispatch, serial_time, pool_time)
    assert ways == [False, True] * 4
    assert dispatch.uses_pool is uses_pool and dispatch.trials == 1
    assert dispatch.next() == (uses_pool, False)


def test_one_slow_call_does_not_decide():
    dispatch = K.MeasuredDispatch(trial_calls=5, recheck_every=100)
    serial = iter([1.0, 1.0, 1.0, 1.0, 1.0])
    pool = iter([0.5, 0.5, 50.0, 0.5, 0.5])  # the OS took the core once
    while True:
        way, timed = dispatch.next()
        if not timed:
            break
        dispatch.record(way, timed, next(pool) if way else next(serial))
    assert dispatch.uses_pool


def test_the_choice_is_measured_again_and_can_change():
    dispatch = K.MeasuredDispatch(trial_calls=2, recheck_every=10)
    run_trial(dispatch, serial_time=1.0, pool_time=2.0)
    assert not dispatch.uses_pool
    untimed = 1  # run_trial's last call
    while dispatch.next() == (False, False):
        untimed += 1
    assert untimed == 9  # the 10th call after the trial starts the next one
    # The machine changed (e.g. the other core became free): the new trial finds the pool faster.
    dispatch.record(False, True, 1.0)
    run_trial(dispatch, serial_time=1.0, pool_time=0.5)
    assert dispatch.uses_pool and dispatch.trials == 2


def test_untimed_calls_are_not_samples():
    dispatch = K.MeasuredDispatch(trial_calls=1, recheck_every=100)
    dispatch.record(True, False, 0.001)  # not timed: ignored
    assert dispatch.trials == 0
    assert dispatch.next() == (False, True)


def test_a_quant_layer_trials_above_its_size_floor_and_never_below(rng):
    from .test_quant_kernels import make_weights
    k, n = 1024, 512
    b, scales, zp = make_weights(rng, k, n, 8, 32, True)
    x = rng.standard_normal((1, k)).astype(np.float32)
    measured = K.QuantMatMul(b, scales, zp, k, n, 8, 32, decode_min_chunk_rows=64, accuracy_level=4)
    small = K.QuantMatMul(b, scales, zp, k, n, 8, 32, decode_min_chunk_rows=64, accuracy_level=4,
                          decode_parallel_min_bytes=1 << 30)
    reference = small(x)
    for _ in range(40):
        np.testing.assert_array_equal(measured(x, threads=2), reference)
        np.testing.assert_array_equal(small(x, threads=2), reference)
    assert measured.decode_dispatch_trials >= 1
    assert small.decode_dispatch_trials == 0 and not small.decode_uses_pool


def test_a_bad_dispatch_name_is_refused(rng):
    from .test_quant_kernels import make_weights
    b, scales, zp = make_weights(rng, 64, 16, 8, 32, False)
    with pytest.raises(Exception, match="decode_dispatch must be 'measured' or 'pool', got 'fast'"):
        K.QuantMatMul(b, scales, zp, 64, 16, 8, 32, decode_dispatch="fast")
