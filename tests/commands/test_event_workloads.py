"""event_workloads on generated models and streams (fast, no cache, nothing timed)."""
import numpy as np
import pytest

from ortsparse.commands import event_workloads as ew
from ortsparse.runtime import open_session


@pytest.fixture(scope="module")
def mlp():
    return ew.mlp_model(d=32, hidden=64, layers=2, seed=3)


def test_rewrite_adds_one_reset_input_to_every_event_op(mlp):
    model, report = ew.event_model(mlp, topk=1.0, delta_theta=0.0)
    ops = [n for n in model.graph.node if n.op_type == "EventDrivenMatMul"]
    assert len(ops) == len(report.rewritten) == 4
    assert all(list(n.input)[3] == ew.RESET_INPUT for n in ops)
    assert [i.name for i in model.graph.input].count(ew.RESET_INPUT) == 1
    with pytest.raises(ValueError, match="no EventDrivenMatMul"):
        ew.add_reset_input(mlp)


def test_exact_settings_have_no_gap_and_approximate_ones_have_some(mlp):
    streams = [ew.smooth_stream(d=32, rows=3, calls=6, seed=s) for s in range(2)]
    dense = open_session(mlp)
    exact, _ = ew.event_model(mlp, topk=1.0, delta_theta=0.0, gap_every=0)
    result = ew.compare_streams(dense, open_session(exact), streams, embedding=False)
    assert result["calls"] == 12 and result["gap_max"] < 1e-5
    approx, _ = ew.event_model(mlp, topk=0.2, delta_theta=0.0, gap_every=0)
    result = ew.compare_streams(dense, open_session(approx), streams, embedding=False)
    assert 0 < result["gap_mean_after_first"] < 1.0
    assert result["gap_mean"] < result["gap_mean_after_first"]  # first calls are dense refreshes


def test_reset_on_each_stream_makes_replays_repeatable(mlp):
    model, _ = ew.event_model(mlp, topk=0.3, delta_theta=0.0, gap_every=0)
    session = open_session(model)
    stream = ew.smooth_stream(d=32, rows=2, calls=5, seed=1)
    first = ew.replay(session, stream, reset=True)
    second = ew.replay(session, stream, reset=True)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)


def test_text_streams():
    texts = ["one two three four", "alpha beta"]
    assert ew.search_as_you_type(texts) == [["one two", "one two three", "one two three four"]]
    edits = ew.sentence_edits(texts, edits=3, seed=0)
    assert [len(s) for s in edits] == [4, 4] and edits[0][0] == texts[0]
    assert all(a != b for s in edits for a, b in zip(s, s[1:]))
