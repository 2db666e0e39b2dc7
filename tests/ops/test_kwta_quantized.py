"""KwtaBlockMatMul on MatMulNBits' weight inputs (X, B uint8, scales, zero_points?, bias?) + K, N,
bits, block_size: the op against ORT's own MatMulNBits (keep everything) and against the gated
numpy reference on the dequantized weights (keep part), and its input errors."""
import numpy as np
import pytest
from onnx import TensorProto, helper

import ortsparse

from .test_quant_kernels import (assert_within, dequantize, fp32_bound, int8_bound, make_weights,
                                 matmulnbits_session)


def quantized_kwta_model(b, scales, zp, k, n, bits, block, bias=None, node_name="kwta_q", **attrs):
    inits = [helper.make_tensor("B", TensorProto.UINT8, b.shape, b.tobytes(), raw=True),
             helper.make_tensor("scales", TensorProto.FLOAT, scales.shape, scales.tobytes(), raw=True)]
    names = ["X", "B", "scales", "", ""]
    if zp is not None:
        inits.append(helper.make_tensor("zp", TensorProto.UINT8, zp.shape, zp.tobytes(), raw=True))
        names[3] = "zp"
    if bias is not None:
        inits.append(helper.make_tensor("bias", TensorProto.FLOAT, bias.shape, bias.tobytes(), raw=True))
        names[4] = "bias"
    while names[-1] == "":
        names.pop()
    node = helper.make_node("KwtaBlockMatMul", names, ["Y"], domain="ai.ortsparse", name=node_name, K=k, N=n,
                            bits=bits, block_size=block, **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["m", k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.ortsparse", 1)],
                             ir_version=9)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("block", [16, 32, 128])
@pytest.mark.parametrize("zero_points", [False, True])
@pytest.mark.parametrize("k,n", [(64, 48), (93, 65), (576, 160)])
def test_keep_all_matches_matmulnbits(bits, block, zero_points, k, n, rng):
    b, scales, zp = make_weights(rng, k, n, bits, block, zero_points)
    bias = rng.standard_normal(n).astype(np.float32)
    ours = ortsparse.inference_session(quantized_kwta_model(b, scales, zp, k, n, bits, block, bias, k_frac=1.0))
    w = dequantize(b, scales, zp, k, n, bits, block)
    for m, level in ((1, 0), (2, 0), (7, 4)):  # decode rows: fp32 like accuracy 0; >= 4 dense rows: int8 like 4
        reference = matmulnbits_session(b, scales, zp, k, n, bits, block, level, bias)
        x = (rng.standard_normal((m, k)) * 0.25).astype(np.float32)
        got = ours.run(None, {"X": x})[0]
        (expected,) = reference.run(None, {"A": x})
        bound = fp32_bound(x, w) if level == 0 else 2 * int8_bound(x, w, block) + fp32_bound(x, w)
        assert_within(got, expected, bound + 1e-6 * np.abs(bias))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k_frac", [0.25, 0.75])
def test_gated_rows_match_the_dequantized_reference(bits, k_frac, rng):
    k, n, block = 256, 96, 32
    b, scales, zp = make_weights(rng, k, n, bits, block, True)
    w = dequantize(b, scales, zp, k, n, bits, block)
    session = ortsparse.inference_session(quantized_kwta_model(b, scales, zp, k, n, bits, block, k_frac=k_frac))
    x = rng.standard_normal((3, k)).astype(np.float32)
    got = session.run(None, {"X": x})[0]
    keep = int(np.ceil(k_frac * k))
    for t in range(3):
        rows = np.sort(np.argsort(-np.abs(x[t]), kind="stable")[:keep])
        expected = x[t, rows].astype(np.float64) @ w[rows].astype(np.float64)
        assert_within(got[t:t + 1], expected[None], fp32_bound(x[t:t + 1], w))


def test_quantized_form_metrics_and_threads(rng):
    k, n, block = 128, 64, 32
    b, scales, zp = make_weights(rng, k, n, 8, block, False)
    model = quantized_kwta_model(b, scales, zp, k, n, 8, block, node_name="kq", k_frac=0.5)
    x = rng.standard_normal((1, k)).astype(np.float32)
    one = ortsparse.inference_session(model, intra_op_num_threads=1)
    two = ortsparse.inference_session(model, intra_op_num_threads=2)
    ortsparse.reset_metrics()
    np.testing.assert_array_equal(one.run(None, {"X": x})[0], two.run(None, {"X": x})[0])
    metrics = ortsparse.metrics()["KwtaBlockMatMul/kq"]
    assert metrics["kwta.keep_ratio"] == 0.5 and metrics["calls"] == 2


@pytest.mark.parametrize("k_frac", [1.0, 0.6])
def test_measured_dispatch_gives_the_one_thread_result_and_reports_its_choice(k_frac, rng):
    """A decode call of more than one task times the calling thread against ORT's pool for a while
    and keeps the faster (common/measured_dispatch.h): whichever runs, the bits are the one-thread
    session's, through the trial and after it, and the node reports how often it used the pool."""
    k, n, block = 1536, 1024, 32  # int8: 1.5 MiB, several row chunks
    b, scales, zp = make_weights(rng, k, n, 8, block, True)
    model = quantized_kwta_model(b, scales, zp, k, n, 8, block, node_name="kd", k_frac=k_frac)
    one = ortsparse.inference_session(model, intra_op_num_threads=1)
    two = ortsparse.inference_session(model, intra_op_num_threads=2, allow_spinning=False)
    ortsparse.reset_metrics()
    calls = 40  # the trial is 2 x 8 calls
    for _ in range(calls):
        x = rng.standard_normal((1, k)).astype(np.float32)
        np.testing.assert_array_equal(one.run(None, {"X": x})[0], two.run(None, {"X": x})[0])
    x = rng.standard_normal((3, k)).astype(np.float32)  # decode rows of a small batch
    np.testing.assert_array_equal(one.run(None, {"X": x})[0], two.run(None, {"X": x})[0])
    metrics = ortsparse.metrics()["KwtaBlockMatMul/kd"]
    assert metrics["decode.calls"] == 2 * calls + 2
    # The trial alone sends 8 of the two-thread session's calls to the pool; a one-thread session's
    # pool runs on the caller and counts the same way.
    assert 8 / metrics["decode.calls"] <= metrics["decode.pool_ratio"] <= 1.0


@pytest.mark.parametrize("change,message", [
    (dict(attrs=dict(K=0)), "needs attributes K, N, bits and block_size"),
    (dict(attrs=dict(bits=3)), "bits"),
    (dict(attrs=dict(block_size=24)), "block_size"),
    (dict(scales_shape=(5,)), "scales"),
    (dict(no_scales=True), "scales"),
])
def test_quantized_form_errors_name_the_input(change, message, rng):
    k, n, block, bits = 64, 32, 32, 4
    b, scales, zp = make_weights(rng, k, n, bits, block, True)
    attrs = dict(K=k, N=n, bits=bits, block_size=block)
    attrs.update(change.get("attrs", {}))
    if "scales_shape" in change:
        scales = np.zeros(change["scales_shape"], np.float32)
    inits = [helper.make_tensor("B", TensorProto.UINT8, b.shape, b.tobytes(), raw=True),
             helper.make_tensor("scales", TensorProto.FLOAT, scales.shape, scales.tobytes(), raw=True)]
    names = ["X", "B"] if change.get("no_scales") else ["X", "B", "scales"]
    node = helper.make_node("KwtaBlockMatMul", names, ["Y"], domain="ai.ortsparse", name="bad_q", **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["m", k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.ortsparse", 1)],
                              ir_version=9)
    with pytest.raises(Exception, match=f"KwtaBlockMatMul node 'bad_q': .*{message}"):
        ortsparse.inference_session(model)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k_frac", [1.0, 0.5])
@pytest.mark.parametrize("m", [1, 3, 9])  # decode rows, a small batch, the int8 prefill (> max_gated_rows)
def test_glu_silu_is_silu_of_the_gate_half_times_the_up_half(bits, k_frac, m, rng):
    """glu='silu': Y = silu(P[:, :N/2]) * P[:, N/2:] for the product P the op computes without it —
    bit for bit (the same kernels), and within float rounding of float64."""
    from ortsparse import _kernels as K

    k, n, block = 128, 2 * 72, 32
    b, scales, zp = make_weights(rng, k, n, bits, block, True)
    bias = rng.standard_normal(n).astype(np.float32)
    attrs = dict(k_frac=k_frac, max_gated_rows=4)
    plain = ortsparse.inference_session(quantized_kwta_model(b, scales, zp, k, n, bits, block, bias, **attrs))
    glu = ortsparse.inference_session(quantized_kwta_model(b, scales, zp, k, n, bits, block, bias, glu="silu", **attrs))
    x = rng.standard_normal((m, k)).astype(np.float32)
    product = plain.run(None, {"X": x})[0]
    got = glu.run(None, {"X": x})[0]
    assert got.shape == (m, n // 2)
    half = n // 2
    want_bits = np.stack([K.silu_glu(K.active_isa(), product[t, :half], product[t, half:]) for t in range(m)])
    np.testing.assert_array_equal(got, want_bits)
    p = product.astype(np.float64)
    np.testing.assert_allclose(got, p[:, :half] / (1 + np.exp(-p[:, :half])) * p[:, half:], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("n,glu,message", [(64, "relu", "glu='relu' is not one of 'none', 'silu'"),
                                           (63, "silu", "even N")])
def test_glu_errors_name_the_value(n, glu, message, rng):
    k, block, bits = 64, 32, 8
    b, scales, zp = make_weights(rng, k, n, bits, block, False)
    with pytest.raises(Exception, match=f"KwtaBlockMatMul node 'kwta_q': .*{message}"):
        ortsparse.inference_session(quantized_kwta_model(b, scales, zp, k, n, bits, block, glu=glu))


@pytest.mark.parametrize("extra", [1, -1])
def test_quantized_form_bias_of_the_wrong_length_is_named_bias(extra, rng):
    """In this form B is the uint8 weight: a bias of N +- 1 values must name the bias input
    (issue 23: it said "input B has shape [49] but N = 48")."""
    k, n, block, bits = 64, 48, 32, 4
    b, scales, zp = make_weights(rng, k, n, bits, block, True)
    bias = np.zeros(n + extra, np.float32)
    with pytest.raises(Exception) as error:
        session = ortsparse.inference_session(quantized_kwta_model(b, scales, zp, k, n, bits, block, bias, k_frac=1.0))
        session.run(None, {"X": np.ones((2, k), np.float32)})
    text = str(error.value)
    assert f"KwtaBlockMatMul node 'kwta_q': input bias (#4) has shape [{n + extra}] but N = {n}" in text, text
    assert "input B " not in text


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k_frac", [1.0, 0.5])
def test_accuracy_level_4_decodes_with_int8_activations(bits, k_frac, rng):
    # The attribute mirrors MatMulNBits': at 4 a decode row is the int8 product (the kernel twin's),
    # at 0 (the default) the fp32 product; both stay within their bounds of ORT's MatMulNBits.
    from ortsparse import _kernels as K
    k, n, block = 192, 80, 32
    b, scales, zp = make_weights(rng, k, n, bits, block, True)
    w = dequantize(b, scales, zp, k, n, bits, block)
    x = (rng.standard_normal((1, k)) * 0.25).astype(np.float32)
    level4 = ortsparse.inference_session(quantized_kwta_model(b, scales, zp, k, n, bits, block, k_frac=k_frac,
                                                              accuracy_level=4))
    level0 = ortsparse.inference_session(quantized_kwta_model(b, scales, zp, k, n, bits, block, k_frac=k_frac))
    rows = None if k_frac == 1.0 else [np.sort(np.argsort(-np.abs(x[0]), kind="stable")[:k // 2]).astype(np.int32)]
    twin = K.QuantMatMul(b, scales, zp, k, n, bits, block, accuracy_level=4)
    got4, got0 = level4.run(None, {"X": x})[0], level0.run(None, {"X": x})[0]
    np.testing.assert_array_equal(got4, twin(x, rows))
    assert not np.array_equal(got4, got0)
    if k_frac == 1.0:
        (expected,) = matmulnbits_session(b, scales, zp, k, n, bits, block, 4).run(None, {"A": x})
        assert_within(got4, expected, 2 * int8_bound(x, w, block) + fp32_bound(x, w))


@pytest.mark.parametrize("weights, level, message", [
    ("quantized", 5, "accuracy_level=5 is not one of MatMulNBits' levels 0-4"),
    ("quantized", -1, "accuracy_level=-1 is not one of"),
    ("float", 4, "accuracy_level=4 belongs to the quantized form"),
])
def test_accuracy_level_errors_name_the_value(weights, level, message, rng):
    k, n, block = 64, 32, 32
    if weights == "quantized":
        b, scales, zp = make_weights(rng, k, n, 8, block, False)
        model = quantized_kwta_model(b, scales, zp, k, n, 8, block, node_name="bad_q", accuracy_level=level)
    else:
        w = rng.standard_normal((k, n)).astype(np.float32)
        node = helper.make_node("KwtaBlockMatMul", ["X", "W"], ["Y"], domain="ai.ortsparse", name="bad_q",
                                accuracy_level=level)
        graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["m", k])],
                                  [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
                                  initializer=[helper.make_tensor("W", TensorProto.FLOAT, w.shape, w.tobytes(), raw=True)])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                        helper.make_opsetid("ai.ortsparse", 1)], ir_version=9)
    with pytest.raises(Exception, match=f"KwtaBlockMatMul node 'bad_q': .*{message}"):
        ortsparse.inference_session(model)
