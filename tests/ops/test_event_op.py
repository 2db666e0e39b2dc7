"""EventDrivenMatMul through ONNX Runtime against the numpy reference of its documented semantics."""
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import ortsparse
from ortsparse import _kernels

from .onnx_builders import event_model
from .reference import EventReference, smooth_stream

EXACT = dict(topk=1.0, delta_theta=0.0, stale_beta=1.0, stale_lambda=0.0)


def weights(rng, k, n, bias=True):
    w = rng.standard_normal((k, n)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32) if bias else None
    return w, b


def dense(x, w, b):
    y = x.astype(np.float64) @ w.astype(np.float64)
    return y + b if b is not None else y


def close(got, expected, k):
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=2e-5 * np.sqrt(k) * max(1.0, np.abs(expected).max()))


def random_call_sequence(rng, calls, k, axis):
    """Shapes and inputs of a call sequence mixing small edits, full changes and shape changes."""
    x = None
    for call in range(calls):
        if axis == "call":
            b, s = rng.choice([(1, 3), (1, 4), (2, 3), (1, 1)]) if call % 5 == 4 else (1, 4)
        else:
            b, s = (2, int(rng.integers(1, 4)))
        shape = (b, s, k)
        if x is None or x.shape != shape or rng.random() < 0.15:
            x = rng.standard_normal(shape).astype(np.float32)
        else:
            x = x.copy()
            mask = rng.random(shape) < rng.choice([0.05, 0.3, 0.8])
            x[mask] += rng.standard_normal(int(mask.sum())).astype(np.float32) * rng.choice([1e-3, 0.1, 1.0])
        yield x


@pytest.mark.parametrize("axis", ["sequence", "call"])
@pytest.mark.parametrize("block", [1, 5])
@pytest.mark.parametrize("age_max", [0, 2])
def test_exact_mode_equals_dense_over_any_call_sequence(axis, block, age_max, rng):
    k, n = 37, 29
    w, b = weights(rng, k, n)
    session = ortsparse.inference_session(event_model(w, b, x_shape=("b", "s", None), axis=axis, block=block,
                                                      age_max=age_max, gap_every=0, **EXACT))
    for x in random_call_sequence(rng, 60, k, axis):
        close(session.run(None, {"X": x})[0], dense(x, w, b), k)


def test_exact_mode_long_stream_of_small_changes_stays_exact(rng):
    # Many delta updates accumulate onto y: float drift must stay within float tolerance.
    k, n = 200, 64
    w, b = weights(rng, k, n)
    session = ortsparse.inference_session(event_model(w, b, axis="call", gap_every=0, **EXACT, node_name="ev_long"))
    ortsparse.reset_metrics()
    x = rng.standard_normal((3, k)).astype(np.float32)
    for _ in range(400):
        x = x.copy()
        idx = rng.integers(0, k, size=(3, 10))
        for t in range(3):
            x[t, idx[t]] += rng.standard_normal(10).astype(np.float32)
        close(session.run(None, {"X": x})[0], dense(x, w, b), k)
    stats = ortsparse.metrics()["EventDrivenMatMul/ev_long"]
    assert stats["event.topk_kept"] < 0.06  # ~10 of 200 rows refreshed per call: the delta path ran
    assert stats["event.stale_pct"] > 94


@pytest.mark.parametrize("axis", ["sequence", "call"])
@pytest.mark.parametrize("block", [1, 4])
@pytest.mark.parametrize("settings", [
    dict(topk=0.3, delta_theta=0.0),
    dict(topk=0.5, delta_theta=0.02),
    dict(topk=0.4, delta_theta=0.0, stale_beta=0.9, stale_lambda=0.1),
    dict(topk=0.25, delta_theta=0.0, stale_beta=1.0, stale_lambda=0.2, age_max=3),
    dict(topk=0.3, delta_theta=0.0, kwta_k=0.5),
    dict(topk=0.6, delta_theta=0.01, kwta_k=0.4, stale_beta=0.8, age_max=4),
])
def test_approximate_modes_match_the_reference(axis, block, settings, rng):
    k, n, rows = 42, 23, 3  # 42 = 10 * 4 + 2: a short last block
    w, b = weights(rng, k, n)
    model = event_model(w, b, x_shape=("b", "s", None), axis=axis, block=block, gap_every=0, **settings)
    session = ortsparse.inference_session(model)
    ref = EventReference(w, b, block=block, axis=axis, gap_every=0, **settings)
    for x in smooth_stream(rng, 25, rows, k, block, full_change_every=11):
        x3 = x.reshape(1, rows, k) if axis == "call" else x.reshape(rows, 1, k)
        got = session.run(None, {"X": x3})[0]
        close(got, ref(x3), k)


def test_wide_waves_run_rows_with_large_refresh_sets_dense(rng):
    # 6 rows per call, topk 0.7: rows whose refresh set exceeds 50% of the blocks run dense (exact).
    k, n = 50, 9
    w, b = weights(rng, k, n)
    attrs = dict(topk=0.7, delta_theta=0.0, gap_every=0, axis="call")
    session = ortsparse.inference_session(event_model(w, b, node_name="ev_wide", **attrs))
    ref = EventReference(w, b, **attrs)
    ortsparse.reset_metrics()
    for x in smooth_stream(rng, 5, 6, k, 1):
        y = session.run(None, {"X": x})[0]
        close(y, ref(x), k)
        close(y, dense(x, w, b), k)
    assert ortsparse.metrics()["EventDrivenMatMul/ev_wide"]["event.topk_kept"] == 1.0


def test_sequence_axis_rows_of_one_call_chain_like_separate_calls(rng):
    k, n = 30, 11
    w, b = weights(rng, k, n)
    attrs = dict(topk=0.3, delta_theta=0.0, gap_every=0, axis="sequence")
    xs = np.stack(list(smooth_stream(rng, 6, 2, k, 1)), axis=1)  # [2 streams, 6 tokens, K]
    one_call = ortsparse.inference_session(event_model(w, b, x_shape=("b", "s", None), **attrs)).run(None, {"X": xs})[0]
    split = ortsparse.inference_session(event_model(w, b, x_shape=("b", "s", None), **attrs))
    parts = [split.run(None, {"X": xs[:, t:t + 1]})[0] for t in range(6)]
    close(one_call, np.concatenate(parts, axis=1), k)
    close(one_call, EventReference(w, b, **attrs)(xs), k)


@pytest.mark.parametrize("axis", ["sequence", "call"])
def test_max_gated_rows_runs_prefill_dense_and_continues_from_it(axis, rng):
    k, n = 36, 14
    w, b = weights(rng, k, n)
    attrs = dict(topk=0.3, delta_theta=0.0, gap_every=0, axis=axis, max_gated_rows=2)
    session = ortsparse.inference_session(event_model(w, b, x_shape=("b", "s", None), node_name="ev_mgr", **attrs))
    ref = EventReference(w, b, **attrs)
    ortsparse.reset_metrics()
    stream = list(smooth_stream(rng, 6, 4, k, 1))
    prefill = stream[0].reshape(1, 4, k)
    close(session.run(None, {"X": prefill})[0], dense(prefill, w, b), k)
    ref(prefill)
    for x in stream[1:]:
        xs = x[:1].reshape(1, 1, k) if axis == "sequence" else x[:2].reshape(1, 2, k)
        close(session.run(None, {"X": xs})[0], ref(xs), k)
    m = ortsparse.metrics()["EventDrivenMatMul/ev_mgr"]
    assert m["event_rows"] == (5 if axis == "sequence" else 10) and m["event.topk_kept"] < 0.5


def test_call_axis_growing_input_starts_new_rows_fresh(rng):
    k, n = 24, 10
    w, b = weights(rng, k, n)
    attrs = dict(topk=0.2, delta_theta=0.0, gap_every=0, axis="call")
    session = ortsparse.inference_session(event_model(w, b, x_shape=("b", "s", None), **attrs))
    ref = EventReference(w, b, **attrs)
    base = rng.standard_normal((1, 6, k)).astype(np.float32)
    for s in range(2, 7):  # a query growing by one row per call, earlier rows nudged
        x = base[:, :s] + 0.01 * rng.standard_normal((1, s, k)).astype(np.float32)
        y = session.run(None, {"X": x})[0]
        close(y, ref(x), k)
        close(y[:, -1], dense(x[:, -1], w, b), k)  # the new row has no previous row: dense


def test_reset_input_clears_state_and_rearms(rng):
    k, n = 32, 12
    w, b = weights(rng, k, n)
    attrs = dict(topk=0.1, delta_theta=0.0, gap_every=1, gap_tol=1e-3, axis="call")
    session = ortsparse.inference_session(event_model(w, b, reset_input=True, node_name="ev_rst", **attrs))
    ref = EventReference(w, b, **attrs)
    ortsparse.reset_metrics()
    no, yes = np.array(False), np.array(True)
    stream = list(smooth_stream(rng, 8, 2, k, 1, step=0.5))
    for i, x in enumerate(stream[:4]):
        close(session.run(None, {"X": x, "reset": no})[0], ref(x), k)
    m = ortsparse.metrics()["EventDrivenMatMul/ev_rst"]
    assert m["event.enabled"] == 0.0 and m["disables"] == 1  # big changes, topk 0.1: gap far above 1e-3
    assert m["event.quality_gap"] > 1e-3
    x = stream[4]
    close(session.run(None, {"X": x, "reset": yes})[0], dense(x, w, b), k)  # fresh after reset: dense
    ref(x, reset=True)
    assert ortsparse.metrics()["EventDrivenMatMul/ev_rst"]["event.enabled"] == 1.0
    for x in stream[5:]:
        close(session.run(None, {"X": x, "reset": no})[0], ref(x), k)


def test_gap_check_row_outputs_dense_and_small_gap_keeps_enabled(rng):
    k, n = 40, 16
    w, b = weights(rng, k, n)
    attrs = dict(topk=0.5, delta_theta=0.0, gap_every=3, gap_tol=0.5, axis="call")
    session = ortsparse.inference_session(event_model(w, b, node_name="ev_gap", **attrs))
    ref = EventReference(w, b, **attrs)
    ortsparse.reset_metrics()
    for x in smooth_stream(rng, 13, 1, k, 1, step=0.01):
        close(session.run(None, {"X": x})[0], ref(x), k)
    m = ortsparse.metrics()["EventDrivenMatMul/ev_gap"]
    assert m["gap_checks"] == ref.gap_checks == 4 and m["event.enabled"] == 1.0
    assert m["event.quality_gap"] == pytest.approx(ref.last_gap, rel=1e-3, abs=1e-6)


def test_budget_deadline_keeps_the_quorum(rng):
    k, n = 64, 20
    w, b = weights(rng, k, n)
    for budget, expired in [(1e6, False), (1e-9, True)]:
        attrs = dict(topk=0.5, delta_theta=0.0, quorum=0.25, gap_every=0, axis="call", block=2)
        session = ortsparse.inference_session(event_model(w, b, budget_ms=budget, node_name="ev_bud", **attrs))
        ref = EventReference(w, b, expired=expired, deadline=True, **attrs)
        ortsparse.reset_metrics()
        for x in smooth_stream(rng, 6, 2, k, 2):
            close(session.run(None, {"X": x})[0], ref(x), k)
        m = ortsparse.metrics()["EventDrivenMatMul/ev_bud"]
        assert m["event.quorum_hits"] == ref.deadline_stops == (10 if expired else 0)
        assert m["event.topk_kept"] == pytest.approx(ref.refreshed / ref.total)
        assert m["event.budget_ms_used"] > 0


def test_metrics_count_refreshed_blocks(rng):
    k, n = 50, 8
    w, b = weights(rng, k, n)
    attrs = dict(topk=0.2, delta_theta=0.0, age_max=3, gap_every=0, axis="sequence")
    session = ortsparse.inference_session(event_model(w, b, x_shape=("b", "s", None), node_name="ev_met", **attrs))
    ref = EventReference(w, b, **attrs)
    ortsparse.reset_metrics()
    for x in smooth_stream(rng, 9, 1, k, 1):
        session.run(None, {"X": x[None]})
        ref(x[None])
    m = ortsparse.metrics()["EventDrivenMatMul/ev_met"]
    assert m["event_rows"] == 8 and m["rows"] == 9 and m["calls"] == 9
    assert m["blocks_refreshed"] == ref.refreshed and m["blocks_total"] == ref.total
    assert m["blocks_forced"] > 0
    assert m["event.stale_pct"] == pytest.approx(100 * (1 - ref.refreshed / ref.total))
    assert m["event.quorum_hits"] == 0 and m["event.enabled"] == 1.0
    assert ortsparse.metrics()["total/EventDrivenMatMul"]["calls"] >= 9


@pytest.mark.concurrency
@pytest.mark.parametrize("intra_op_threads", [1, 2], ids=["caller", "pool"])
def test_concurrent_runs_share_streams_without_crashing(intra_op_threads, rng):
    # Calls on one session are serialised per kernel: in exact mode every result equals dense
    # whatever the interleaving; in approximate mode each call sees some other call's state.
    k, n = 96, 48
    w, b = weights(rng, k, n)
    for attrs, exact in [(EXACT, True), (dict(topk=0.2, delta_theta=0.0), False)]:
        session = ortsparse.inference_session(event_model(w, b, axis="call", gap_every=5, node_name="ev_conc", **attrs),
                                              intra_op_num_threads=intra_op_threads)
        ortsparse.reset_metrics()
        inputs = [rng.standard_normal((3, k)).astype(np.float32) for _ in range(4)]
        errors, bad = [], []

        def worker(i):
            try:
                x = inputs[i]
                for j in range(40):
                    xi = x + np.float32(1e-3 * j)
                    y = session.run(None, {"X": xi})[0]
                    if exact and not np.allclose(y, dense(xi, w, b), rtol=1e-4, atol=1e-3):
                        bad.append((i, j))
                    if not np.isfinite(y).all():
                        bad.append((i, j))
            except Exception as e:  # pragma: no cover - reported below
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors and not bad
        m = ortsparse.metrics()["EventDrivenMatMul/ev_conc"]
        assert m["calls"] == 160 and m["rows"] == 480


def test_leading_dims_empty_and_rank1(rng):
    k, n = 16, 5
    w, b = weights(rng, k, n)
    model = event_model(w, b, x_shape=("a", "b", "c", None), gap_every=0, **EXACT)
    session = ortsparse.inference_session(model)
    x = rng.standard_normal((2, 3, 4, k)).astype(np.float32)
    close(session.run(None, {"X": x})[0], dense(x, w, b), k)
    assert session.run(None, {"X": np.zeros((2, 0, 4, k), np.float32)})[0].shape == (2, 0, 4, n)
    v = rng.standard_normal(k).astype(np.float32)
    s1 = ortsparse.inference_session(event_model(w, b, x_shape=(None,), gap_every=0, **EXACT))
    close(s1.run(None, {"X": v})[0], dense(v, w, b), k)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_nan_or_inf_row_does_not_poison_later_rows(bad, rng):
    # Delta coding adds onto the previous output: a non-finite output must force a dense row next.
    k, n = 20, 7
    w, b = weights(rng, k, n)
    session = ortsparse.inference_session(event_model(w, b, axis="call", gap_every=0, **EXACT))
    x = rng.standard_normal((2, k)).astype(np.float32)
    for call in range(6):
        x = x.copy()
        x[:, call % k] += 0.5
        xin = x.copy()
        if call == 2:
            xin[0, 3] = bad
        y = session.run(None, {"X": xin})[0]
        if call == 2:
            assert not np.isfinite(y[0]).all() and np.isfinite(y[1]).all()
        else:
            close(y, dense(xin, w, b), k)


class TestBadInput:
    def create(self, model):
        with pytest.raises(Exception) as info:
            ortsparse.inference_session(model)
        return str(info.value)

    @pytest.mark.parametrize("attrs,text", [
        ({"axis": "time"}, "axis='time'"), ({"topk": 0.0}, "topk=0"), ({"topk": 1.5}, "topk=1.5"),
        ({"delta_theta": -1.0}, "delta_theta=-1"), ({"stale_beta": 1.5}, "stale_beta=1.5"),
        ({"stale_lambda": -0.1}, "stale_lambda=-0.1"), ({"age_max": -1}, "age_max=-1"),
        ({"budget_ms": -2.0}, "budget_ms=-2"), ({"quorum": 1.2}, "quorum=1.2"), ({"gap_every": -1}, "gap_every=-1"),
        ({"gap_tol": -0.5}, "gap_tol=-0.5"), ({"kwta_k": 2.0}, "kwta_k=2"), ({"block": 0}, "block=0"),
        ({"block": 9}, "block=9"), ({"max_gated_rows": -1}, "max_gated_rows=-1"),
    ])
    def test_bad_attributes(self, attrs, text, rng):
        w, b = weights(rng, 8, 4)
        msg = self.create(event_model(w, b, node_name="e1", **attrs))
        assert "EventDrivenMatMul node 'e1'" in msg and text in msg

    def test_weight_not_constant(self, rng):
        w, b = weights(rng, 8, 4)
        msg = self.create(event_model(w, b, w_as_graph_input=True, node_name="e2"))
        assert "EventDrivenMatMul node 'e2'" in msg and "constant initializer" in msg

    def test_wrong_x_width(self, rng):
        w, b = weights(rng, 8, 4)
        session = ortsparse.inference_session(event_model(w, b, x_shape=(1, "k"), node_name="e3"))
        with pytest.raises(Exception) as info:
            session.run(None, {"X": np.zeros((1, 7), dtype=np.float32)})
        assert "e3" in str(info.value) and "K = 8" in str(info.value)

    def test_reset_not_scalar(self, rng):
        from onnx import TensorProto, helper
        w, b = weights(rng, 8, 4)
        model = event_model(w, b, reset_input=True, node_name="e4")
        model.graph.input[1].CopyFrom(helper.make_tensor_value_info("reset", TensorProto.BOOL, [2]))
        session = ortsparse.inference_session(model)
        with pytest.raises(Exception) as info:
            session.run(None, {"X": np.zeros((1, 8), np.float32), "reset": np.array([True, False])})
        assert "e4" in str(info.value) and "reset" in str(info.value)


ISA_SCRIPT = r"""
import numpy as np, ortsparse, sys
sys.path.insert(0, {tests!r})
from ops.onnx_builders import event_model
from ops.reference import EventReference, smooth_stream
rng = np.random.default_rng(7)
w = rng.standard_normal((77, 45)).astype(np.float32); b = rng.standard_normal(45).astype(np.float32)
attrs = dict(topk=0.3, delta_theta=0.0, gap_every=0, axis="call", block=3)
s = ortsparse.inference_session(event_model(w, b, **attrs)); ref = EventReference(w, b, **attrs)
for x in smooth_stream(rng, 10, 5, 77, 3):
    np.testing.assert_allclose(s.run(None, {{"X": x}})[0], ref(x), rtol=1e-4, atol=1e-3)
print("ok")
"""


@pytest.mark.parametrize("isa", _kernels.supported_isas())
def test_op_on_every_isa(isa):
    tests_dir = os.path.dirname(os.path.dirname(__file__))
    out = subprocess.run([sys.executable, "-c", ISA_SCRIPT.format(tests=tests_dir)],
                         env=dict(os.environ, ORTSPARSE_ISA=isa), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
