"""TTMatMul: the TT GEMM kernels against their scalar twin, the `tt` backend and the ORT op against
an independent numpy contraction of the same cores (tt.tt_full), errors, NaN guard, metrics."""
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import ortsparse
from ortsparse import _kernels as K
from ortsparse import tt

ISAS = K.supported_isas()
SIMD_ISAS = [isa for isa in ISAS if isa != "scalar"]


def random_cores(rng, in_modes, out_modes, ranks, scale=None):
    cores = []
    for t, (k, n) in enumerate(zip(in_modes, out_modes)):
        s = scale if scale is not None else 1.0 / np.sqrt(ranks[t] * k)
        cores.append((s * rng.standard_normal((ranks[t], k, n, ranks[t + 1]))).astype(np.float32))
    return cores


def tt_model(cores, bias=None, *, in_modes=None, out_modes=None, ranks=None, w_dense=None, x_shape=("m", None),
             node_name="tt_node", packed=None, **attrs):
    if in_modes is None:
        in_modes, out_modes = tt.tt_modes(cores)
        ranks = tt.tt_ranks(cores)
    k = int(np.prod(in_modes))
    inputs = ["X", "cores", "B" if bias is not None else "", "W_dense" if w_dense is not None else ""]
    while inputs and inputs[-1] == "":
        inputs.pop()
    node = helper.make_node("TTMatMul", inputs, ["Y"], domain="ai.ortsparse", name=node_name,
                            in_modes=list(in_modes), out_modes=list(out_modes), ranks=list(ranks), **attrs)
    initializers = [numpy_helper.from_array(tt.concat_cores(cores) if packed is None else packed, "cores")]
    if bias is not None:
        initializers.append(numpy_helper.from_array(bias, "B"))
    if w_dense is not None:
        initializers.append(numpy_helper.from_array(w_dense, "W_dense"))
    x_dims = [k if d is None else d for d in x_shape]
    graph = helper.make_graph([node], "tt", [helper.make_tensor_value_info("X", TensorProto.FLOAT, x_dims)],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.ortsparse", 1)],
                             ir_version=9)


def run(model, x, **kw):
    return ortsparse.inference_session(model, **kw).run(None, {"X": x})[0]


def reference(x, cores, bias=None):
    y = x.reshape(-1, x.shape[-1]).astype(np.float64) @ tt.tt_full(cores)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], y.shape[-1])


SHAPES = [  # (in_modes, out_modes, ranks)
    ([5], [7], [1, 1]),                       # d = 1: the core is W
    ([24, 1], [1, 40], [1, 6, 1]),            # lowrank layout
    ([4, 6], [8, 5], [1, 3, 1]),
    ([3, 4, 5], [2, 6, 3], [1, 4, 5, 1]),
    ([2, 3, 2, 3], [3, 2, 4, 1], [1, 2, 3, 2, 1]),
    ([1, 7, 1], [3, 1, 5], [1, 2, 2, 1]),      # modes of 1
    ([8, 8, 9], [12, 16, 8], [1, 8, 8, 1]),   # SmolLM2-like 576 x 1536
]


# ---------------------------------------------------------------- kernels


@pytest.mark.parametrize("isa", SIMD_ISAS)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 13])
@pytest.mark.parametrize("n", [1, 7, 8, 15, 16, 17, 31, 32, 33, 65])
def test_gemm_matches_scalar_tails(isa, m, n, rng):
    for k in (0, 1, 5, 255, 256, 257, 600):  # depth blocks of 256 and their tails
        a = rng.standard_normal((m, k)).astype(np.float32)
        b = rng.standard_normal((k, n)).astype(np.float32)
        got = K.tt_gemm(isa, a, b)
        ref = K.tt_gemm("scalar", a, b)
        exact = a.astype(np.float64) @ b.astype(np.float64)
        tol = 1e-5 * max(1.0, np.sqrt(k))
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=tol)
        np.testing.assert_allclose(ref, exact, rtol=1e-5, atol=tol)


def test_gemm_never_reads_the_output(rng):
    # tt_gemm NaN-fills C before the call: accumulate-from-C would leak NaN.
    for isa in ISAS:
        c = K.tt_gemm(isa, np.ones((3, 0), np.float32), np.ones((0, 9), np.float32))
        assert np.all(c == 0.0)


# ---------------------------------------------------------------- backend (no ORT)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[0])) + "_" + "x".join(map(str, s[1])))
@pytest.mark.parametrize("order", [0, 1])
def test_backend_matches_numpy_contraction(isa, shape, order, rng):
    in_modes, out_modes, ranks = shape
    cores = random_cores(rng, in_modes, out_modes, ranks)
    op = K.TTMatMul(tt.concat_cores(cores), in_modes, out_modes, ranks, order=order, isa=isa)
    assert op.right_to_left == bool(order)
    assert op.macs_per_token == tt.order_macs(in_modes, out_modes, ranks, bool(order))
    bias = rng.standard_normal(op.n).astype(np.float32)
    for m in (1, 2, 3, 4, 5, 17, 64):  # per-core path (M < 4) and token chunks (M >= 4)
        x = rng.standard_normal((m, op.k)).astype(np.float32)
        np.testing.assert_allclose(op(x, bias), reference(x, cores, bias), rtol=1e-4, atol=1e-4)


def test_backend_picks_the_cheaper_order(rng):
    in_modes, out_modes, ranks = [24, 1], [1, 40], [1, 6, 1]
    op = K.TTMatMul(tt.concat_cores(random_cores(rng, in_modes, out_modes, ranks)), in_modes, out_modes, ranks)
    assert op.right_to_left is False  # X [K] -> r first: K r + r N, never K N r
    assert op.macs_per_token == tt.tt_macs(in_modes, out_modes, ranks) == 24 * 6 + 6 * 40
    # mirrored layout: last core first is cheaper
    op2 = K.TTMatMul(tt.concat_cores(random_cores(rng, [1, 24], [40, 1], [1, 6, 1])), [1, 24], [40, 1], [1, 6, 1])
    assert op2.right_to_left is True


@pytest.mark.parametrize("isa", ISAS)
def test_gated_tokens_zero_the_skipped_inputs(isa, rng):
    in_modes, out_modes, ranks = [4, 6], [8, 5], [1, 3, 1]
    cores = random_cores(rng, in_modes, out_modes, ranks)
    op = K.TTMatMul(tt.concat_cores(cores), in_modes, out_modes, ranks, isa=isa)
    x = rng.standard_normal((5, 24)).astype(np.float32)
    rows = [None, np.array([0, 3, 23], np.int32), np.array([], np.int32), None, np.arange(0, 24, 2, dtype=np.int32)]
    masked = x.copy()
    for t, r in enumerate(rows):
        if r is not None:
            keep = np.zeros(24, bool)
            keep[r] = True
            masked[t, ~keep] = 0
    np.testing.assert_allclose(op(x, None, rows), reference(masked, cores), rtol=1e-4, atol=1e-5)


def test_full_rank_tt_svd_equals_dense_matmul(rng):
    w = rng.standard_normal((48, 60)).astype(np.float32)
    x = rng.standard_normal((9, 48)).astype(np.float32)
    for in_modes, out_modes in [([48, 1], [1, 60]), ([4, 12], [6, 10]), ([4, 3, 4], [3, 4, 5])]:
        cores = tt.tt_svd(w, in_modes, out_modes)  # no truncation: exact
        y = run(tt_model(cores), x)
        np.testing.assert_allclose(y, x @ w, rtol=1e-4, atol=2e-4)


# ---------------------------------------------------------------- the ORT op


@pytest.mark.parametrize("shape", SHAPES[1:5], ids=lambda s: "x".join(map(str, s[0])))
@pytest.mark.parametrize("m", [1, 2, 5, 33])
@pytest.mark.parametrize("bias", [True, False])
def test_op_matches_numpy(shape, m, bias, rng):
    in_modes, out_modes, ranks = shape
    cores = random_cores(rng, in_modes, out_modes, ranks)
    n = int(np.prod(out_modes))
    b = rng.standard_normal(n).astype(np.float32) if bias else None
    x = rng.standard_normal((2, m, int(np.prod(in_modes)))).astype(np.float32)
    y = run(tt_model(cores, b, x_shape=("b", "s", None)), x)
    assert y.shape == (2, m, n)
    np.testing.assert_allclose(y, reference(x, cores, b), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("isa", ISAS)
def test_op_every_isa_forced(isa, rng):
    # ORTSPARSE_ISA is read once per process: a child process per ISA.
    code = r"""
import numpy as np, sys
sys.path.insert(0, %r)
from test_tt_op import tt_model, random_cores, reference, run
rng = np.random.default_rng(5)
cores = random_cores(rng, [8, 8, 9], [12, 16, 8], [1, 8, 8, 1])
for m in (1, 3, 40):
    x = rng.standard_normal((m, 576)).astype(np.float32)
    np.testing.assert_allclose(run(tt_model(cores), x), reference(x, cores), rtol=1e-4, atol=1e-4)
import ortsparse._kernels as K
print(K.active_isa())
""" % os.path.dirname(__file__)
    env = dict(os.environ, ORTSPARSE_ISA=isa)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == isa


def test_op_threads_match_single_thread(rng):
    cores = random_cores(rng, [8, 8, 9], [12, 16, 8], [1, 8, 8, 1])
    model = tt_model(cores)
    for m in (1, 2, 7, 100):
        x = rng.standard_normal((m, 576)).astype(np.float32)
        y1 = run(model, x, intra_op_num_threads=1)
        y2 = run(model, x, intra_op_num_threads=2)
        np.testing.assert_allclose(y1, y2, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(y1, reference(x, cores), rtol=1e-4, atol=1e-4)


def test_op_empty_rows(rng):
    cores = random_cores(rng, [4, 6], [8, 5], [1, 3, 1])
    y = run(tt_model(cores, x_shape=(0, None)), np.zeros((0, 24), np.float32))
    assert y.shape == (0, 40)


BAD = [
    (dict(in_modes=[4, 6], out_modes=[8], ranks=[1, 3, 1]), "same length"),
    (dict(in_modes=[4, 6], out_modes=[8, 5], ranks=[1, 3]), "d + 1"),
    (dict(in_modes=[4, 6], out_modes=[8, 5], ranks=[2, 3, 1]), "start and end with 1"),
    (dict(in_modes=[4, 0], out_modes=[8, 5], ranks=[1, 3, 1]), "in_modes"),
    (dict(in_modes=[4, 6], out_modes=[8, -5], ranks=[1, 3, 1]), "out_modes"),
    (dict(in_modes=[4, 6], out_modes=[8, 5], ranks=[1, 4, 1]), "need"),  # packed length mismatch
]


@pytest.mark.parametrize("attrs,message", BAD, ids=[b[1] for b in BAD])
def test_bad_attributes_fail_at_session_creation(attrs, message, rng):
    cores = random_cores(rng, [4, 6], [8, 5], [1, 3, 1])
    model = tt_model(cores, **attrs)
    with pytest.raises(Exception, match=re.escape(message)) as info:
        ortsparse.inference_session(model)
    assert "TTMatMul node 'tt_node'" in str(info.value)


def test_missing_attribute_and_bad_inputs(rng):
    cores = random_cores(rng, [4, 6], [8, 5], [1, 3, 1])
    model = tt_model(cores)
    del model.graph.node[0].attribute[:]  # no in_modes
    with pytest.raises(Exception, match="in_modes"):
        ortsparse.inference_session(model)
    with pytest.raises(Exception, match="cores must have rank 1"):
        ortsparse.inference_session(tt_model(cores, packed=tt.concat_cores(cores).reshape(1, -1)))
    with pytest.raises(Exception, match="W_dense has shape"):
        ortsparse.inference_session(tt_model(cores, w_dense=np.zeros((24, 41), np.float32)))
    with pytest.raises(Exception, match="nan_guard"):
        ortsparse.inference_session(tt_model(cores, nan_guard=3))
    session = ortsparse.inference_session(tt_model(cores, x_shape=("m", "k")))
    with pytest.raises(Exception, match="last dim of X must be K"):
        session.run(None, {"X": np.zeros((2, 25), np.float32)})


def test_cores_must_be_constant(rng):
    cores = random_cores(rng, [4, 6], [8, 5], [1, 3, 1])
    model = tt_model(cores)
    model.graph.input.append(helper.make_tensor_value_info("cores", TensorProto.FLOAT, [len(tt.concat_cores(cores))]))
    del model.graph.initializer[0]
    with pytest.raises(Exception, match="constant initializer"):
        ortsparse.inference_session(model)


def overflowing_cores(rng):
    cores = random_cores(rng, [4, 6], [8, 5], [1, 3, 1])
    cores[0] = cores[0] * np.float32(1e30)
    cores[1] = cores[1] * np.float32(1e30)  # product 1e60: inf in float32
    return cores


def test_nan_guard_fails_loudly_without_fallback(rng):
    session = ortsparse.inference_session(tt_model(overflowing_cores(rng)))
    with pytest.raises(Exception, match="NaN/Inf while input X is finite"):
        session.run(None, {"X": rng.standard_normal((3, 24)).astype(np.float32)})


def test_nan_guard_uses_dense_fallback(rng):
    w = rng.standard_normal((24, 40)).astype(np.float32)
    b = rng.standard_normal(40).astype(np.float32)
    session = ortsparse.inference_session(tt_model(overflowing_cores(rng), b, w_dense=w, node_name="guarded"))
    ortsparse.reset_metrics()
    x = rng.standard_normal((3, 24)).astype(np.float32)
    np.testing.assert_allclose(session.run(None, {"X": x})[0], x @ w + b, rtol=1e-4, atol=1e-4)
    stats = ortsparse.metrics()["TTMatMul/guarded"]
    assert stats["nan_fallbacks"] == 1 and stats["tt.enabled"] == 0.0


def test_nan_in_input_propagates(rng):
    cores = random_cores(rng, [4, 6], [8, 5], [1, 3, 1])
    x = rng.standard_normal((2, 24)).astype(np.float32)
    x[1, 3] = np.nan
    y = run(tt_model(cores), x)  # the guard only fires when X was finite
    assert np.all(np.isfinite(y[0])) and np.any(np.isnan(y[1]))
    # nan_guard = 0: overflow passes through silently
    y = run(tt_model(overflowing_cores(rng), nan_guard=0), np.ones((1, 24), np.float32))
    assert not np.all(np.isfinite(y))


def test_metrics(rng):
    in_modes, out_modes, ranks = [8, 8, 9], [12, 16, 8], [1, 8, 8, 1]
    cores = random_cores(rng, in_modes, out_modes, ranks)
    session = ortsparse.inference_session(tt_model(cores, node_name="tt_metrics", gap=0.0125))
    ortsparse.reset_metrics()
    for m in (1, 3):
        session.run(None, {"X": rng.standard_normal((m, 576)).astype(np.float32)})
    stats = ortsparse.metrics()["TTMatMul/tt_metrics"]
    assert stats["op"] == "TTMatMul"
    assert stats["calls"] == 2 and stats["rows"] == 4
    assert stats["tt.enabled"] == 1.0
    assert stats["tt.rank"] == 8
    assert stats["tt.gap"] == pytest.approx(0.0125, abs=1e-6)
    assert stats["tt.speedup"] == pytest.approx(576 * 1536 / tt.tt_macs(in_modes, out_modes, ranks))
    assert stats["tt.mem_saved"] == pytest.approx(1 - sum(c.size for c in cores) / (576 * 1536))
    assert "total/TTMatMul" in ortsparse.metrics()
