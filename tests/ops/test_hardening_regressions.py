"""Regressions of the outside review's op findings: each test reproduces a reported input and
asserts what the op must do instead (crash, silent wrong answer, history-dependent output, memory)."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from onnx import TensorProto, helper

import ortsparse
from ortsparse import _kernels

from . import attention_reference as ref
from .onnx_builders import event_model, kwta_model

ISAS = _kernels.supported_isas()


def run(model, feeds):
    return ortsparse.inference_session(model).run(None, feeds)[0]


# --- PopcountAttention with head dim 0 (crashed with proj_bits > 0, else returned zeros) --------

@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("proj_bits,center", [(1, 1), (0, 1), (0, 0)])
def test_head_dim_zero_is_refused_on_every_isa(isa, proj_bits, center):
    q = np.zeros((1, 1, 1, 0), np.float32)
    k = np.zeros((1, 1, 5, 0), np.float32)
    v = np.ones((1, 1, 5, 1), np.float32)
    with pytest.raises(ValueError, match="head dim D = 0"):
        _kernels.popcount_attention(q, k, v, topk=4, min_keys=0, proj_bits=proj_bits, center=bool(center), isa=isa)


def test_head_dim_zero_is_a_clear_session_error():
    model = ref.attention_model(select="popcount", topk=4, min_keys=0, proj_bits=1, center=1)
    feeds = {"Q": np.zeros((1, 1, 1, 0), np.float32), "K": np.zeros((1, 1, 5, 0), np.float32),
             "V": np.ones((1, 1, 5, 1), np.float32)}
    with pytest.raises(Exception, match="PopcountAttention node .*head dim D = 0"):
        run(model, feeds)


# --- KWTA hold mode kept the lowest-index rows under extreme scores ----------------------------

def hold_run(x_rows, **attrs):
    """Output rows of KwtaBlockMatMul with W = I in hold mode (duty 2): y = x on the kept rows."""
    k = x_rows.shape[1]
    model = kwta_model(np.eye(k, dtype=np.float32), duty=2, duty_mode="hold", **attrs)
    session = ortsparse.inference_session(model)
    return [session.run(None, {"X": row[None]})[0][0] for row in x_rows]


def kept(y):
    return set(np.flatnonzero((y != 0) | np.isnan(y)).tolist())


@pytest.mark.parametrize("temp", [1e-38, 1e-3, 1.0, 1e6])
def test_hold_mode_keeps_the_largest_rows_at_any_temperature(temp):
    x = np.arange(1, 9, dtype=np.float32)[None].repeat(3, axis=0)
    for y in hold_run(x, k_frac=0.25, temp=temp):
        assert kept(y) == {6, 7}


def test_hold_mode_huge_input_is_kept():
    x = np.array([[1, 2, 1e20, 3, 4, 5, 6, 7]], np.float32).repeat(3, axis=0)
    for y in hold_run(x, k_frac=0.25):
        assert kept(y) == {2, 7}


def test_hold_mode_nan_input_ranks_highest_and_propagates():
    x = np.array([[1, 2, np.nan, 3, 4, 5, 6, 7]], np.float32).repeat(3, axis=0)
    gate = _kernels.KwtaMatMul(np.eye(8, dtype=np.float32), k_frac=0.25, duty=2, duty_mode="hold")
    for row in x:
        assert gate.plan(row[None])[0].tolist() == [2, 7]
    for y in hold_run(x, k_frac=0.25):
        assert np.isnan(y).all()  # W = I: the kept NaN reaches every output, as in a dense MatMul


# --- l2 / mean_abs scores overflowed float for |x| > ~1.8e19: ties went to the lower index -------

@pytest.mark.parametrize("score", ["l2", "mean_abs", "l2_weighted"])
@pytest.mark.parametrize("block", [1, 2])
def test_overflowing_scores_keep_the_larger_block(score, block):
    big = 3e37 if score == "mean_abs" else 1e20
    x = np.array([[big, big, 2 * big, 3 * big, 1, 1, 1, 1]], np.float32)
    model = kwta_model(np.eye(8, dtype=np.float32), block=block, k_abs=block, score=score)
    y = run(model, {"X": x})[0]
    assert kept(y) == ({3} if block == 1 else {2, 3})


def test_overflowing_scores_with_a_threshold():
    x = np.array([[1e20, 2e20, 1, 1]], np.float32)
    model = kwta_model(np.eye(4, dtype=np.float32), threshold=5.0, k_frac=0.5)
    assert kept(run(model, {"X": x})[0]) == {0, 1}


# --- EventDrivenMatMul carried a spike's rounding error for many rows, then disabled itself ------

def test_event_spike_is_refreshed_not_carried(rng):
    k, n, rows = 64, 32, 200
    w = rng.standard_normal((k, n)).astype(np.float32)
    x = np.cumsum(0.01 * rng.standard_normal((rows, k)), axis=0).astype(np.float32) + 1.0
    x[100, 5] = 1e7
    model = event_model(w, node_name="ev_spike", topk=0.5, delta_theta=0.0)
    session = ortsparse.inference_session(model)
    ortsparse.reset_metrics()
    y = np.stack([session.run(None, {"X": row[None]})[0][0] for row in x])
    dense = x.astype(np.float64) @ w.astype(np.float64)
    rel = np.linalg.norm(y - dense, axis=1) / np.linalg.norm(dense, axis=1)
    before, after = rel[1:100].max(), rel[101:].max()
    assert after <= 5 * before + 1e-4, (before, after)
    metrics = ortsparse.metrics()["EventDrivenMatMul/ev_spike"]
    assert metrics["event.enabled"] == 1.0
    assert metrics["resyncs"] >= 1


# --- list-valued and non-finite attributes silently became defaults ----------------------------

@pytest.mark.parametrize("attrs,needle", [
    ({"k_frac": [0.9]}, "k_frac must be a single float, not a list"),
    ({"block": [4]}, "block must be a single int, not a list"),
    ({"k_frac": float("nan")}, "k_frac=nan must be a finite number"),
    ({"threshold": float("inf")}, "threshold=inf must be a finite number"),
])
def test_list_and_nonfinite_attributes_are_refused(attrs, needle):
    with pytest.raises(Exception, match="KwtaBlockMatMul node .*" + needle.replace("[", r"\[")):
        ortsparse.inference_session(kwta_model(np.eye(8, dtype=np.float32), **attrs))


# --- shared packed weights were matched by pointer + a non-cryptographic hash ------------------

def test_shared_packing_never_reuses_other_contents(rng):
    buffer = rng.standard_normal((16, 8)).astype(np.float32)
    first = _kernels.SharedDenseWeights(buffer)
    again = _kernels.SharedDenseWeights(buffer)
    assert again.is_shared_with(first)  # same address and contents: one packed copy
    buffer[3, 2] += 1.0  # same address, other contents (as two sessions in turn may place them)
    changed = _kernels.SharedDenseWeights(buffer)
    assert not changed.is_shared_with(first)
    np.testing.assert_array_equal(changed.rows(), buffer)
    assert first.rows()[3, 2] != buffer[3, 2]


# --- memory: per-thread scratch outlived the session; TT asked for GBs of scratch --------------

def test_tt_modes_with_huge_intermediates_are_refused():
    cores = np.ones(2 * 32768, np.float32)
    node = helper.make_node("TTMatMul", ["X", "cores"], ["Y"], domain="ai.ortsparse", name="tt_huge",
                            in_modes=[1, 32768], out_modes=[32768, 1], ranks=[1, 1, 1])
    graph = helper.make_graph([node], "tt", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 32768])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
                              [helper.make_tensor("cores", TensorProto.FLOAT, [cores.size], cores)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.ortsparse", 1)],
                              ir_version=9)
    try:
        session = ortsparse.inference_session(model)
    except Exception as error:  # refused at creation: fine if the message says why
        assert "TTMatMul node 'tt_huge'" in str(error) and "intermediate" in str(error)
        return
    y = session.run(None, {"X": np.ones((1, 32768), np.float32)})[0]  # else it must run within bounds
    assert y.shape == (1, 32768)


SCRATCH_SCRIPT = textwrap.dedent("""
    import numpy as np, ortsparse, sys
    sys.path.insert(0, {tests!r})
    from ops.onnx_builders import kwta_model
    def rss_mb():
        return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
    w = np.random.default_rng(0).standard_normal((256, 64)).astype(np.float32)
    session = ortsparse.inference_session(kwta_model(w, k_frac=0.5), intra_op_num_threads=1)
    small = np.ones((1, 256), np.float32)
    session.run(None, {{"X": small}})
    before = rss_mb()
    session.run(None, {{"X": np.ones((20000, 256), np.float32)}})
    session.run(None, {{"X": small}})
    print(rss_mb() - before)
""")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc/self/statm (Linux)")
@pytest.mark.skipif("libasan" in os.environ.get("LD_PRELOAD", ""),
                    reason="ASan's allocator quarantines freed memory, so RSS does not show a release")
def test_large_call_scratch_is_released():
    # glibc's dynamic mmap threshold would otherwise keep freed large blocks in the heap.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", SCRATCH_SCRIPT.format(tests=tests)], env=env, capture_output=True,
                         text=True, check=True).stdout
    assert float(out.strip().splitlines()[-1]) < 8.0  # 20k rows of 128 kept inputs: ~10 MB of row lists
