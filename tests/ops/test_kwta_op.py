"""KwtaBlockMatMul through ONNX Runtime against the independent numpy reference."""
import os
import subprocess
import sys
import threading

import numpy as np
import onnxruntime as ort
import pytest

import ortsparse
from ortsparse import _kernels

from .onnx_builders import kwta_model
from .reference import kwta_matmul, separated_input


def run(model, x, **session_kw):
    session = ortsparse.inference_session(model, **session_kw)
    return session.run(None, {"X": x})[0]


def weights(rng, k, n, bias=True):
    w = rng.standard_normal((k, n)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32) if bias else None
    return w, b


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9, 33])
@pytest.mark.parametrize("k,n", [(1, 1), (17, 5), (64, 48), (100, 130)])
@pytest.mark.parametrize("bias", [True, False])
def test_keep_all_equals_matmul(m, k, n, bias, rng):
    w, b = weights(rng, k, n, bias)
    x = rng.standard_normal((1, m, k)).astype(np.float32)
    y = run(kwta_model(w, b, k_frac=1.0, x_shape=("b", "s", None)), x)
    expected = x @ w + (b if bias else 0)
    np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-4 * np.sqrt(k))


@pytest.mark.parametrize("block", [1, 3, 16, 32])
@pytest.mark.parametrize("k_frac", [0.1, 0.25, 0.5, 0.75])
@pytest.mark.parametrize("m", [1, 2, 6, 16])
def test_partial_keep_uses_exactly_the_reference_blocks(block, k_frac, m, rng):
    k, n = 100, 70
    w, b = weights(rng, k, n)
    x = separated_input(rng, m, k, block)
    expected, kept_rows = kwta_matmul(x, w, b, block=block, k_frac=k_frac)
    # The gate's own decision, row by row.
    gate = _kernels.KwtaMatMul(w, block=block, k_frac=k_frac)
    for got_rows, ref_rows in zip(gate.plan(x), kept_rows):
        assert got_rows.tolist() == ref_rows.tolist()
    y = run(kwta_model(w, b, k_frac=k_frac, block=block, x_shape=("b", "s", None)), x.reshape(1, m, k))
    np.testing.assert_allclose(y.reshape(m, n), expected, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("score", ["l2", "mean_abs", "l2_weighted"])
def test_scores(score, rng):
    k, n, block = 90, 33, 8  # short last block (90 = 11*8 + 2)
    w, b = weights(rng, k, n)
    w[::7] *= 3.0  # blocks with different ||W_b|| so l2_weighted differs from l2
    x = separated_input(rng, 5, k, block)
    expected, kept_rows = kwta_matmul(x, w, b, block=block, k_frac=0.4, score=score)
    gate = _kernels.KwtaMatMul(w, block=block, k_frac=0.4, score=score)
    got = gate.plan(x)
    if score != "l2_weighted":  # weighted ranking may have near-ties after scaling
        assert [r.tolist() for r in got] == [r.tolist() for r in kept_rows]
    y = run(kwta_model(w, b, k_frac=0.4, block=block, score=score), x)
    np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-3)


def test_k_abs_rounds_up_to_whole_blocks(rng):
    k, n, block = 64, 16, 8
    w, b = weights(rng, k, n)
    x = separated_input(rng, 3, k, block)
    gate = _kernels.KwtaMatMul(w, block=block, k_abs=20)  # 20 columns -> 3 blocks of 8
    assert all(len(r) == 24 for r in gate.plan(x))
    expected, _ = kwta_matmul(x, w, b, block=block, k_abs=20)
    np.testing.assert_allclose(run(kwta_model(w, b, k_abs=20, block=block), x), expected, rtol=1e-4, atol=1e-3)


def test_threshold_keeps_blocks_above_it_capped_at_top_k(rng):
    k, n = 50, 20
    w, b = weights(rng, k, n)
    x = rng.standard_normal((4, k)).astype(np.float32)
    for threshold, k_frac in [(0.8, 1.0), (0.8, 0.2), (5.0, 1.0)]:
        expected, kept = kwta_matmul(x, w, b, k_frac=k_frac, threshold=threshold)
        y = run(kwta_model(w, b, k_frac=k_frac, threshold=threshold), x)
        np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-3)
    assert all(len(r) == 0 for r in kept)  # threshold 5: nothing kept -> output is the bias
    np.testing.assert_allclose(y, np.broadcast_to(b, y.shape), rtol=1e-6)


@pytest.mark.parametrize("isa", _kernels.supported_isas())
@pytest.mark.parametrize("score", ["l2", "mean_abs"])
def test_threshold_rows_on_every_isa(isa, score, rng):
    """The threshold test runs on SIMD order keys: rows with |x| >= threshold (at it included,
    NaN and inf kept), ascending, for K across vector tails."""
    threshold = 0.7
    for k in [1, 7, 15, 16, 17, 33, 64, 100]:
        w, _ = weights(rng, k, 3)
        x = rng.standard_normal((3, k)).astype(np.float32)
        x[0, :: 5] = threshold  # exactly at the threshold: kept
        x[1, k // 2] = np.nan
        x[2, k - 1] = -np.inf
        x[2, 0] = -threshold
        gate = _kernels.KwtaMatMul(w, k_frac=1.0, threshold=threshold, score=score, isa=isa)
        expected = [np.flatnonzero(~(np.abs(row) < threshold)).tolist() for row in x]
        assert [r.tolist() for r in gate.plan(x)] == expected, (isa, score, k)


def test_renorm_scales_by_blocks_total_over_kept(rng):
    k, n = 40, 12
    w, b = weights(rng, k, n)
    x = separated_input(rng, 3, k, 4)
    expected, _ = kwta_matmul(x, w, b, block=4, k_frac=0.5, renorm=True)
    np.testing.assert_allclose(run(kwta_model(w, b, block=4, k_frac=0.5, renorm=1), x), expected, rtol=1e-4, atol=1e-3)


def test_ties_keep_lower_blocks(rng):
    w, b = weights(rng, 8, 4)
    x = np.ones((1, 8), dtype=np.float32)
    gate = _kernels.KwtaMatMul(w, block=2, k_frac=0.5)
    assert gate.plan(x)[0].tolist() == [0, 1, 2, 3]


def test_duty_dense_mode_gates_every_duty_th_call(rng):
    k, n = 30, 10
    w, b = weights(rng, k, n)
    session = ortsparse.inference_session(kwta_model(w, b, k_frac=0.3, duty=3, node_name="duty_node"))
    x = rng.standard_normal((2, k)).astype(np.float32)
    gated, _ = kwta_matmul(x, w, b, k_frac=0.3)
    dense = x @ w + b
    ortsparse.reset_metrics()
    for call in range(7):
        y = session.run(None, {"X": x})[0]
        np.testing.assert_allclose(y, gated if call % 3 == 0 else dense, rtol=1e-4, atol=1e-3)
    stats = ortsparse.metrics()["KwtaBlockMatMul/duty_node"]
    assert stats["kwta.duty_hits"] == 3 and stats["calls"] == 7
    assert stats["kwta.keep_ratio"] == pytest.approx((3 * 9 + 4 * 30) / (7 * 30))


def test_duty_hold_mode_reuses_the_mask_between_recomputes(rng):
    k, n = 30, 10
    w, b = weights(rng, k, n)
    session = ortsparse.inference_session(kwta_model(w, b, k_frac=0.3, duty=2, duty_mode="hold"))
    x1 = separated_input(rng, 1, k, 1)
    x2 = separated_input(rng, 1, k, 1)
    _, (mask1,) = kwta_matmul(x1, w, b, k_frac=0.3)
    y1 = session.run(None, {"X": x1})[0]  # call 0: recompute from x1
    y2 = session.run(None, {"X": x2})[0]  # call 1: held mask of x1 applied to x2
    np.testing.assert_allclose(y1, x1[:, mask1] @ w[mask1] + b, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(y2, x2[:, mask1] @ w[mask1] + b, rtol=1e-4, atol=1e-3)


def test_hold_mode_recompute_uses_mean_probabilities_over_the_window(rng):
    # Block 0 spikes only on the recompute call; block 1 is steadily high. A sharp temp makes p a
    # per-call vote (the steady block wins 2 calls of 3); a soft temp averages the scores
    # themselves, where the spike (20 once vs 2 thrice) wins.
    w = np.eye(3, dtype=np.float32)
    steady = np.array([[0.0, 2.0, 0.0]], dtype=np.float32)
    spike = np.array([[20.0, 2.0, 0.0]], dtype=np.float32)
    for temp, expected_kept in [(100.0, 0), (0.05, 1)]:
        gate = _kernels.KwtaMatMul(w, block=1, k_abs=1, duty=3, duty_mode="hold", temp=temp)
        gate(steady)           # call 0: recompute (first window)
        gate(steady)           # call 1: held
        gate(steady)           # call 2: held
        kept = gate.plan(spike)  # call 3: recompute from the mean over calls 1..3
        assert kept[0].tolist() == [expected_kept], temp


def test_max_gated_rows_gates_decode_calls_and_runs_prefill_dense(rng):
    k, n = 40, 12
    w, b = weights(rng, k, n)
    session = ortsparse.inference_session(kwta_model(w, b, k_frac=0.5, max_gated_rows=2, node_name="mgr"))
    ortsparse.reset_metrics()
    for m in (1, 2, 5):
        x = separated_input(rng, m, k, 1)
        gated, _ = kwta_matmul(x, w, b, k_frac=0.5)
        expected = gated if m <= 2 else x @ w + b
        np.testing.assert_allclose(session.run(None, {"X": x})[0], expected, rtol=1e-4, atol=1e-3)
    stats = ortsparse.metrics()["KwtaBlockMatMul/mgr"]
    assert stats["kwta.duty_hits"] == 2 and stats["calls"] == 3
    with pytest.raises(Exception, match="max_gated_rows=-1"):
        ortsparse.inference_session(kwta_model(w, b, max_gated_rows=-1))


@pytest.mark.parametrize("k_frac", [1.0, 0.6])
def test_measured_dispatch_of_the_float_form_gives_the_one_thread_result(k_frac, rng):
    """Decode calls of more than one row chunk time the calling thread against ORT's pool and keep the
    faster (common/measured_dispatch.h): the bits stay the one-thread session's, through the trial
    and after it, and the node reports its pool share."""
    k, n = 1024, 512  # 2 MiB of fp32 weights, 4 row chunks
    w, b = weights(rng, k, n)
    model = kwta_model(w, b, k_frac=k_frac, node_name="kfd")
    one = ortsparse.inference_session(model, intra_op_num_threads=1)
    two = ortsparse.inference_session(model, intra_op_num_threads=2, allow_spinning=False)
    ortsparse.reset_metrics()
    for _ in range(40):  # the trial is 2 x 8 calls
        x = rng.standard_normal((1, k)).astype(np.float32)
        np.testing.assert_array_equal(one.run(None, {"X": x})[0], two.run(None, {"X": x})[0])
    stats = ortsparse.metrics()["KwtaBlockMatMul/kfd"]
    assert stats["decode.calls"] == 80 and 8 / 80 <= stats["decode.pool_ratio"] <= 1.0


def test_leading_dims_and_empty_input(rng):
    k, n = 24, 9
    w, b = weights(rng, k, n)
    model = kwta_model(w, b, k_frac=1.0, x_shape=("a", "b", "c", None))
    x = rng.standard_normal((2, 3, 4, k)).astype(np.float32)
    np.testing.assert_allclose(run(model, x), x @ w + b, rtol=1e-4, atol=1e-4)
    empty = np.zeros((2, 0, 4, k), dtype=np.float32)
    assert run(model, empty).shape == (2, 0, 4, n)


def test_nan_input_propagates_like_matmul(rng):
    w, b = weights(rng, 16, 4)
    x = rng.standard_normal((1, 16)).astype(np.float32)
    x[0, 5] = np.nan
    y = run(kwta_model(w, b, k_frac=0.25), x)
    assert np.isnan(y).all()  # the NaN block is kept (NaN ranks highest), so it reaches every output


def test_shared_weight_used_by_two_nodes(rng):
    from onnx import TensorProto, helper, numpy_helper
    w, _ = weights(rng, 20, 20, bias=False)
    nodes = [helper.make_node("KwtaBlockMatMul", ["X", "W"], ["H"], domain="ai.ortsparse", name="a", k_frac=1.0),
             helper.make_node("KwtaBlockMatMul", ["H", "W"], ["Y"], domain="ai.ortsparse", name="b", k_frac=1.0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 20])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(w, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.ortsparse", 1)])
    x = rng.standard_normal((1, 20)).astype(np.float32)
    np.testing.assert_allclose(run(model, x), x @ w @ w, rtol=1e-4, atol=1e-3)


class TestBadInput:
    def create(self, model):
        with pytest.raises(Exception) as info:
            ortsparse.inference_session(model)
        return str(info.value)

    def test_weight_not_constant(self, rng):
        w, b = weights(rng, 8, 4)
        msg = self.create(kwta_model(w, b, w_as_graph_input=True, node_name="proj_q"))
        assert "KwtaBlockMatMul node 'proj_q'" in msg and "constant initializer" in msg

    @pytest.mark.parametrize("attrs,text", [
        ({"block": 0}, "block=0"), ({"block": 9}, "block=9"), ({"k_frac": 1.5}, "k_frac=1.5"),
        ({"k_frac": 0.0}, "k_frac=0"), ({"k_abs": -1}, "k_abs=-1"), ({"score": "max"}, "score='max'"),
        ({"temp": 0.0}, "temp=0"), ({"duty": 0}, "duty=0"), ({"duty_mode": "x"}, "duty_mode='x'"),
        ({"renorm": 2}, "renorm=2"), ({"threshold": -1.0}, "threshold=-1"),
    ])
    def test_bad_attributes(self, attrs, text, rng):
        w, b = weights(rng, 8, 4)
        msg = self.create(kwta_model(w, b, node_name="n1", **attrs))
        assert "KwtaBlockMatMul node 'n1'" in msg and text in msg

    def test_wrong_x_width_names_shapes(self, rng):
        w, b = weights(rng, 8, 4)
        session = ortsparse.inference_session(kwta_model(w, b, x_shape=(1, "k"), node_name="n2"))
        with pytest.raises(Exception) as info:
            session.run(None, {"X": np.zeros((1, 7), dtype=np.float32)})
        assert "n2" in str(info.value) and "[1, 7]" in str(info.value) and "K = 8" in str(info.value)

    def test_wrong_weight_dtype(self, rng):
        w, b = weights(rng, 8, 4)
        msg = self.create(kwta_model(w.astype(np.float64), b, node_name="n3"))
        assert "n3" in msg and "double" in msg.lower()

    def test_weight_rank(self, rng):
        w = rng.standard_normal((2, 8, 4)).astype(np.float32)
        msg = self.create(kwta_model(w, None, node_name="n4", x_shape=(1, 4)))
        assert "n4" in msg and "rank 2" in msg

    def test_bias_shape(self, rng):
        w, _ = weights(rng, 8, 4)
        session = ortsparse.inference_session(kwta_model(w, np.zeros(5, np.float32), node_name="n5"))
        with pytest.raises(Exception) as info:
            session.run(None, {"X": np.zeros((1, 8), dtype=np.float32)})
        assert "n5" in str(info.value) and "N = 4" in str(info.value)


def test_concurrent_runs_share_one_step_counter(rng):
    k, n = 64, 32
    w, b = weights(rng, k, n)
    session = ortsparse.inference_session(kwta_model(w, b, k_frac=0.5, duty=2, node_name="conc"))
    x = rng.standard_normal((3, k)).astype(np.float32)
    gated, _ = kwta_matmul(x, w, b, k_frac=0.5)
    dense = x @ w + b
    ortsparse.reset_metrics()
    results, errors = [], []

    def worker():
        try:
            for _ in range(50):
                results.append(session.run(None, {"X": x})[0])
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    n_gated = sum(np.allclose(r, gated, rtol=1e-4, atol=1e-3) for r in results)
    n_dense = sum(np.allclose(r, dense, rtol=1e-4, atol=1e-3) for r in results)
    assert n_gated == n_dense == 100  # every call is one or the other; duty 2 splits them evenly
    stats = ortsparse.metrics()["KwtaBlockMatMul/conc"]
    assert stats["calls"] == 200 and stats["kwta.duty_hits"] == 100


ISA_SCRIPT = r"""
import numpy as np, ortsparse, sys
sys.path.insert(0, {tests!r})
from ops.onnx_builders import kwta_model
from ops.reference import kwta_matmul, separated_input
rng = np.random.default_rng(7)
w = rng.standard_normal((77, 45)).astype(np.float32); b = rng.standard_normal(45).astype(np.float32)
for m in (1, 2, 7):
    x = separated_input(rng, m, 77, 1)
    for k_frac in (1.0, 0.5):
        y = ortsparse.inference_session(kwta_model(w, b, k_frac=k_frac)).run(None, {{"X": x}})[0]
        np.testing.assert_allclose(y, kwta_matmul(x, w, b, k_frac=k_frac)[0], rtol=1e-4, atol=1e-3)
import ctypes
lib = ctypes.CDLL(ortsparse.get_library_path()); lib.OrtSparseActiveIsa.restype = ctypes.c_char_p
print(lib.OrtSparseActiveIsa().decode())
"""


@pytest.mark.parametrize("isa", _kernels.supported_isas())
def test_op_on_every_isa(isa):
    tests_dir = os.path.dirname(os.path.dirname(__file__))
    env = dict(os.environ, ORTSPARSE_ISA=isa)
    out = subprocess.run([sys.executable, "-c", ISA_SCRIPT.format(tests=tests_dir)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == isa


def run_in_env(code, **env):
    return subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **env), capture_output=True,
                          text=True, timeout=120)


def test_unknown_isa_is_a_clear_error():
    out = run_in_env("import ortsparse; ortsparse.session_options()", ORTSPARSE_ISA="sse9")
    assert out.returncode != 0 and "ORTSPARSE_ISA=sse9 is not one of scalar, avx2, avx512" in out.stderr


def test_too_old_runtime_is_refused_cleanly():
    out = run_in_env("import ortsparse; ortsparse.session_options()", ORTSPARSE_REQUIRE_ORT_API="999")
    assert out.returncode != 0
    assert "older than the API version the library was built for (999)" in out.stderr


def test_only_c_entry_points_are_exported():
    out = subprocess.run(["nm", "-D", "--defined-only", ortsparse.get_library_path()], capture_output=True, text=True)
    symbols = {line.split()[-1] for line in out.stdout.splitlines() if line.strip()}
    assert symbols == {"RegisterCustomOps", "OrtSparseMetricsJson", "OrtSparseResetMetrics", "OrtSparseActiveIsa"}


def test_session_options_knobs():
    options = ortsparse.session_options(intra_op_num_threads=2, allow_spinning=False)
    assert options.intra_op_num_threads == 2
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    with pytest.raises(TypeError):
        ortsparse.session_options(not_an_option=1)
    assert isinstance(options, ort.SessionOptions)


@pytest.mark.parametrize("attrs, message", [
    ({"block": 1.5}, "attribute block must be of type int, not float"),
    ({"score": 3}, "attribute score must be of type string, not int"),
    ({"duty": "2"}, "attribute duty must be of type int, not string"),
])
def test_attribute_of_the_wrong_type_is_refused_not_defaulted(attrs, message):
    w = np.ones((8, 4), np.float32)
    with pytest.raises(Exception, match=f"KwtaBlockMatMul node 'kwta_node': {message}"):
        ort.InferenceSession(kwta_model(w, **attrs).SerializeToString(), ortsparse.session_options())


def test_integer_attribute_where_a_float_is_expected_is_accepted():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 4)).astype(np.float32)
    x = rng.standard_normal((2, 8)).astype(np.float32)
    session = ort.InferenceSession(kwta_model(w, k_frac=1).SerializeToString(), ortsparse.session_options())
    np.testing.assert_allclose(session.run(None, {"X": x})[0], x @ w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("k_frac", [1.0, 0.5])
def test_glu_silu_on_float_weights(m, k_frac, rng):
    """The SwiGLU epilogue is the composer's, so the float form has it too: Y [.., N/2] =
    silu(P[.., :N/2]) * P[.., N/2:] bit for bit, P the product without it (leading dims kept)."""
    w, b = weights(rng, 40, 2 * 33)
    x = rng.standard_normal((2, m, 40)).astype(np.float32)
    product = run(kwta_model(w, b, k_frac=k_frac, x_shape=("b", "s", None)), x)
    got = run(kwta_model(w, b, k_frac=k_frac, glu="silu", x_shape=("b", "s", None)), x)
    assert got.shape == (2, m, 33)
    flat = product.reshape(-1, 66)
    want = np.stack([_kernels.silu_glu(_kernels.active_isa(), r[:33], r[33:]) for r in flat]).reshape(2, m, 33)
    np.testing.assert_array_equal(got, want)
