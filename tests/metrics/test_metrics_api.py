"""ortsparse.metrics() / reset_metrics(): one consistent snapshot per call, keys that cannot collide,
entries that leave with their kernels, ratios that stay ratios while sessions come and go."""
from __future__ import annotations

import ctypes
import gc
import json
import threading
import time

import numpy as np
import pytest

import ortsparse
import ortsparse._library as library
from ops.onnx_builders import event_model, kwta_model

RATIOS = ("kwta.keep_ratio", "pack.active", "pack.density")


def session(model):
    return ortsparse.inference_session(model, intra_op_num_threads=1)


def kwta(name: str, k: int = 16, **attrs):
    return kwta_model(np.eye(k, dtype=np.float32), node_name=name, **attrs)


def run_once(sess, k: int = 16, rows: int = 2):
    return sess.run(None, {"X": np.ones((rows, k), np.float32)})[0]


def _raw_json() -> str:
    lib = library._library()
    capacity = 1 << 20
    buffer = ctypes.create_string_buffer(capacity)
    length = lib.OrtSparseMetricsJson(buffer, capacity)
    assert length < capacity
    return buffer.raw[:length].decode("utf-8")


def nodes_named(snapshot, fragment):
    return sorted(key for key in snapshot if fragment in key)


@pytest.fixture(autouse=True)
def clean_metrics():
    gc.collect()
    ortsparse.reset_metrics()
    yield
    gc.collect()


def test_keys_are_op_type_slash_node_and_carry_both():
    s = session(kwta("plain_node"))
    run_once(s)
    snapshot = ortsparse.metrics()
    entry = snapshot["KwtaBlockMatMul/plain_node"]
    assert entry["op"] == "KwtaBlockMatMul" and entry["node"] == "plain_node"
    assert entry["calls"] == 1
    assert "node" not in snapshot["total/KwtaBlockMatMul"]


def test_same_node_name_in_two_op_types_keeps_both_entries():
    w = np.eye(16, dtype=np.float32)
    a = session(kwta("shared_name"))
    b = session(event_model(w, node_name="shared_name"))
    run_once(a)
    run_once(b)
    run_once(b)
    snapshot = ortsparse.metrics()
    assert snapshot["KwtaBlockMatMul/shared_name"]["calls"] == 1
    assert snapshot["EventDrivenMatMul/shared_name"]["calls"] == 2
    assert snapshot["EventDrivenMatMul/shared_name"]["op"] == "EventDrivenMatMul"


def test_node_named_like_a_total_does_not_replace_the_total():
    impostor = session(kwta("total/KwtaBlockMatMul"))
    honest = session(kwta("honest"))
    run_once(impostor)
    run_once(honest)
    run_once(honest)
    snapshot = ortsparse.metrics()
    assert snapshot["KwtaBlockMatMul/total/KwtaBlockMatMul"]["calls"] == 1
    assert snapshot["total/KwtaBlockMatMul"]["calls"] == 3
    assert "node" not in snapshot["total/KwtaBlockMatMul"]


def test_the_json_has_no_duplicate_keys():
    # json.loads keeps the last of duplicate keys silently; the raw text must not have any.
    w = np.eye(16, dtype=np.float32)
    sessions = [session(kwta("dup")), session(event_model(w, node_name="dup")), session(kwta("total/EventDrivenMatMul"))]
    for s in sessions:
        run_once(s)
    text = _raw_json()
    pairs = json.loads(text, object_pairs_hook=lambda items: items)
    keys = [key for key, _ in pairs]
    assert len(keys) == len(set(keys)), keys


def test_failed_session_creation_leaves_no_entry():
    # duty=2 with pack_mode is refused after the node's kernel has asked for its metrics slot.
    with pytest.raises(Exception, match="duty=2 is not supported"):
        session(kwta("refused_node", pack_mode="binary", duty=2))
    gc.collect()
    snapshot = ortsparse.metrics()
    assert nodes_named(snapshot, "refused_node") == []
    assert "total/KwtaBlockMatMul" not in snapshot, snapshot


def test_destroyed_kernels_leave_the_listing_and_stay_in_the_total():
    s = session(kwta("short_lived"))
    run_once(s)
    run_once(s)
    del s
    gc.collect()
    snapshot = ortsparse.metrics()
    assert "KwtaBlockMatMul/short_lived" not in snapshot
    assert snapshot["total/KwtaBlockMatMul"]["calls"] == 2
    assert snapshot["total/KwtaBlockMatMul"]["blocks_total"] == 2 * 2 * 16  # calls x rows x blocks
    ortsparse.reset_metrics()
    assert "total/KwtaBlockMatMul" not in ortsparse.metrics()


def test_sessions_of_one_node_share_an_entry_until_the_last_is_gone():
    first, second = session(kwta("twice")), session(kwta("twice"))
    run_once(first)
    run_once(second)
    assert ortsparse.metrics()["KwtaBlockMatMul/twice"]["calls"] == 2
    del first
    gc.collect()
    run_once(second)
    assert ortsparse.metrics()["KwtaBlockMatMul/twice"]["calls"] == 3
    del second
    gc.collect()
    snapshot = ortsparse.metrics()
    assert "KwtaBlockMatMul/twice" not in snapshot and snapshot["total/KwtaBlockMatMul"]["calls"] == 3
    # A new session of the same node starts a fresh entry; the total keeps adding.
    third = session(kwta("twice"))
    run_once(third)
    snapshot = ortsparse.metrics()
    assert snapshot["KwtaBlockMatMul/twice"]["calls"] == 1 and snapshot["total/KwtaBlockMatMul"]["calls"] == 4


def test_many_short_lived_nodes_do_not_grow_the_snapshot():
    for i in range(300):
        s = session(kwta(f"node_{i:05d}_" + "x" * 200))
        run_once(s)
        del s
    gc.collect()
    snapshot = ortsparse.metrics()
    assert list(snapshot) == ["total/KwtaBlockMatMul"]
    assert snapshot["total/KwtaBlockMatMul"]["calls"] == 300
    assert len(_raw_json()) < 1000


def test_snapshot_retries_when_the_buffer_is_too_small(monkeypatch):
    s = session(kwta("n" * 5000))
    run_once(s)
    monkeypatch.setattr(library, "_metrics_capacity", 8)
    snapshot = ortsparse.metrics()
    assert snapshot["KwtaBlockMatMul/" + "n" * 5000]["calls"] == 1
    assert library._metrics_capacity > 5000


def test_node_names_with_quotes_and_controls_round_trip():
    odd = 'a"b\\c\nd\te/\x01'
    s = session(kwta(odd))
    run_once(s)
    assert ortsparse.metrics()["KwtaBlockMatMul/" + odd]["node"] == odd


def pack_model(name: str, k: int = 64, k_frac: float = 0.5):
    return kwta_model(np.eye(k, dtype=np.float32), node_name=name, k_frac=k_frac, block=4, pack_mode="binary",
                      pack_density_max=0.5)


def sparse_rows(k: int = 64) -> np.ndarray:
    x = np.zeros((4, k), np.float32)
    x[:, :4] = 1.0  # 1/16 of the blocks active: the bitmap applies, pack.active is exactly 1
    return x


def ratio_violations(snapshot) -> list:
    found = []
    for key, entry in snapshot.items():
        for ratio in RATIOS:
            value = entry.get(ratio)
            if value is not None and not 0.0 <= value <= 1.0:
                found.append((key, ratio, value))
        if entry.get("blocks_kept", 0) > entry.get("blocks_total", 0):
            found.append((key, "blocks_kept > blocks_total", entry))
    return found


class Background:
    """Runs functions in loops on threads until stopped; collects their exceptions."""

    def __init__(self, *loops):
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._loop, args=(fn,)) for fn in loops]

    def _loop(self, fn):
        try:
            while not self.stop.is_set():
                fn()
        except BaseException as error:  # noqa: BLE001 - reported by the test
            self.errors.append(error)

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join()
        assert not self.errors, self.errors[:3]


@pytest.mark.concurrency
def test_snapshots_stay_whole_while_sessions_come_and_go(monkeypatch):
    """Threads create, run and destroy sessions (distinct node names of varying length, so the
    JSON changes size between polls) and reset the counters, while the main thread polls: every
    poll parses, has unique keys, and lists only nodes that exist."""
    monkeypatch.setattr(library, "_metrics_capacity", 64)  # every poll takes the retry path too
    x = sparse_rows()
    steady = session(pack_model("steady"))
    counter = iter(range(10**9))
    finished = []

    def churn():
        i = next(counter)
        s = session(pack_model(f"churn_{i}_" + "y" * (50 * (i % 7))))
        for _ in range(3):
            s.run(None, {"X": x})
        finished.append(i)

    with Background(churn, churn, lambda: steady.run(None, {"X": x}), ortsparse.reset_metrics):
        poll = 0
        while poll < 200 or len(finished) < 40:
            poll += 1
            if poll % 20 == 0:
                pairs = json.loads(_raw_json(), object_pairs_hook=lambda items: items)
                keys = [key for key, _ in pairs]
                assert len(keys) == len(set(keys))
            snapshot = ortsparse.metrics()
            assert "KwtaBlockMatMul/steady" in snapshot
            for key, entry in snapshot.items():
                assert key == f"{entry['op']}/{entry['node']}" if "node" in entry else key == f"total/{entry['op']}"
    gc.collect()
    assert [key for key in ortsparse.metrics() if key.startswith("KwtaBlockMatMul/")] == ["KwtaBlockMatMul/steady"]


@pytest.mark.concurrency
# Not strict: without the batch a violation is likely but not certain within the test's second.
def test_ratios_never_exceed_one_while_runs_and_resets_race():
    """k_frac=1 and a bitmap that always applies: blocks_kept == blocks_total and pack.active == 1
    exactly, so a snapshot or a reset that splits one Compute's counts shows as a ratio above 1
    (and after a reset stays there until the next one)."""
    x = sparse_rows()
    sessions = [session(pack_model("racer", k_frac=1.0)) for _ in range(2)]

    def reset_now_and_then():
        ortsparse.reset_metrics()
        time.sleep(0.0005)

    violations = []
    with Background(*(lambda s=s: s.run(None, {"X": x}) for s in sessions), reset_now_and_then):
        for _ in range(15000):
            violations = ratio_violations(ortsparse.metrics())
            if violations:
                break
    assert not violations, violations[:3]
