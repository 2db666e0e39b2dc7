"""The one timing protocol (ortsparse.benchmarking.time_from_memory): one rotation of every runner,
paired by index; a flush before each timed run only when the rotation's weights would stay in the
last-level cache, or when asked (head placement). Times are not asserted (a shared machine): the
rotation, the pairing and when the flush runs are."""
import pytest

from ortsparse import benchmarking


def rotation(log):
    return {name: (lambda name=name: log.append(name)) for name in ("a", "b", "c")}


def test_one_rotation_paired_by_index(monkeypatch):
    monkeypatch.setattr(benchmarking, "cache_flusher", lambda: pytest.fail("flushed a rotation larger than the cache"))
    log = []
    times = benchmarking.time_from_memory(rotation(log), rotation_bytes=10 ** 12, repeats=4, warmup=1)
    assert log == ["a", "b", "c"] * 5  # one warm-up round, then four, in one rotation
    assert {name: len(values) for name, values in times.items()} == {"a": 4, "b": 4, "c": 4}


@pytest.mark.parametrize("rotation_bytes, flush, flushed", [
    (100, None, True),  # under the (capped) last-level cache: would time cached weights
    (10 ** 12, None, False),  # the other runners' weights push a runner's out, as in a decode step
    (10 ** 12, True, True),  # head placement: two forms of one head keep each other in the cache
    (100, False, False),
])
def test_the_flush_runs_before_every_timed_run_only_when_needed(monkeypatch, rotation_bytes, flush, flushed):
    monkeypatch.setattr(benchmarking, "cache_flush_bytes", lambda: 2 * 32 << 20)
    flushes, log = [], []
    monkeypatch.setattr(benchmarking, "cache_flusher", lambda: lambda: flushes.append(len(log)))
    benchmarking.time_from_memory(rotation(log), rotation_bytes=rotation_bytes, flush=flush, repeats=3, warmup=1)
    # Untimed warm-up runs are never flushed; each timed run is preceded by one when flushed.
    assert flushes == (list(range(3, 12)) if flushed else [])
