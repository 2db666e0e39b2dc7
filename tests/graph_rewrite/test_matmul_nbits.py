"""com.microsoft.MatMulNBits layers: the rules (matmul_nbits, matmul_nbits_add), their near-misses,
the quantized weight passed through untouched, what each technique does with a quantized layer,
and the rewritten model against onnxruntime's MatMulNBits.

Tolerances (per element, as tests/ops/test_kwta_quantized.py states them): rows decoded one by one
(M < 4) are fp32 products of the dequantized weights, compared with MatMulNBits accuracy_level 0
within 2e-5 · (|x| @ |W|); >= 4 dense rows take the int8 prefill path, compared with accuracy_level
4 within twice the int8 rounding bound e = sum_b amax(x_b) / 254 · sum_{r in b} |W[r, n]| (+ the
fp32 bound)."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import nbits_graphs as ng
from configs import kwta, without_kwta
from ort_run import kwta_nodes
from ortsparse.graph_rewrite import list_layers, rewrite_model
from ortsparse.graph_rewrite.rules import dequantize_nbits
from ortsparse.graph_rewrite.techniques import (EventSettings, PackSettings, ProcSettings, TechniqueChoice,
                                                TTSettings)

import ortsparse

EXACT_ALL = kwta("all", k_frac=1.0)


def attrs(node: onnx.NodeProto) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def initializers(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}


def reference_session(model: onnx.ModelProto, level: int | None = None) -> ort.InferenceSession:
    if level is not None:
        model = ng.with_accuracy_level(model, level)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def fp32_bound(x, w):
    return 2e-5 * (np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64)) + 1e-6


def int8_bound(x, w, block):
    out = np.zeros((x.shape[0], w.shape[1]))
    for b0 in range(0, x.shape[1], block):
        amax = np.abs(x[:, b0:b0 + block]).max(axis=1, keepdims=True).astype(np.float64)
        out += amax / 254.0 * np.abs(w[b0:b0 + block]).astype(np.float64).sum(axis=0)[None, :]
    return out


def assert_within(got, expected, bound):
    err = np.abs(got.astype(np.float64) - expected.astype(np.float64))
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert np.all(err <= bound), f"at {worst}: |{got[worst]} - {expected[worst]}| = {err[worst]} > {bound[worst]}"


# ---------------------------------------------------------------------------------------------
# The weight form
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("zero_points", [False, True])
def test_dequantized_matrix_is_what_matmulnbits_multiplies(bits, zero_points):
    """matrix() against onnxruntime itself: MatMulNBits (accuracy_level 0) applied to X = I_K."""
    k, n, block = 80, 24, 16  # K = 5 blocks: odd count, a half-filled zero-point byte at 4 bits
    model = ng.nbits_model(k, n, bits, block, zero_points)
    report = list_layers(model)
    (layer,) = report.layers
    assert layer.rule == "matmul_nbits" and (layer.k, layer.n) == (k, n)
    b, scales = initializers(model)["B"], initializers(model)["scales"]
    zp = initializers(model).get("zero_points")
    w = dequantize_nbits(b, scales, zp, k, n, bits, block)
    (by_ort,) = reference_session(model, 0).run(None, {"X": np.eye(k, dtype=np.float32)[None]})
    np.testing.assert_allclose(w, by_ort[0], rtol=0, atol=1e-6 * np.abs(w).max())


def test_partial_last_block_is_dropped():
    k, n, block = 70, 8, 32  # 3 blocks, the last one 6 rows
    model = ng.nbits_model(k, n, 8, block)
    w = dequantize_nbits(*(initializers(model)[name] for name in ("B", "scales")), None, k, n, 8, block)
    (by_ort,) = reference_session(model, 0).run(None, {"X": np.eye(k, dtype=np.float32)[None]})
    assert w.shape == (k, n)
    np.testing.assert_allclose(w, by_ort[0], rtol=0, atol=1e-6 * np.abs(w).max())


# ---------------------------------------------------------------------------------------------
# The rule: what it emits
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("zero_points", [False, True])
def test_matmulnbits_becomes_kwta_on_the_stored_weights(bits, zero_points):
    model = ng.nbits_model(96, 40, bits, 32, zero_points)
    out, report = rewrite_model(model, kwta("all", k_frac=0.75, score="l2_weighted"))
    onnx.checker.check_model(out, full_check=True)
    (node,) = kwta_nodes(out)
    assert [n.op_type for n in out.graph.node] == ["KwtaBlockMatMul"]
    expected_inputs = ["X", "B", "scales"] + (["zero_points"] if zero_points else [])
    assert list(node.input) == expected_inputs and node.name == "/layer/MatMul_Q"
    a = attrs(node)
    assert (a["K"], a["N"], a["bits"], a["block_size"]) == (96, 40, bits, 32)
    assert a["k_frac"] == 0.75 and a["score"] == b"l2_weighted" and "accuracy_level" not in a
    # Passed through: the very bytes, no copy, nothing added or removed.
    before, after = initializers(model), initializers(out)
    assert sorted(before) == sorted(after) and report.added_initializers == report.removed_initializers == []
    for name in before:
        np.testing.assert_array_equal(before[name], after[name])
    (record,) = report.layers
    assert record.rule == "matmul_nbits" and record.op_type == "com.microsoft.MatMulNBits"
    assert not record.is_exact  # quantized: >= 4 dense rows run on int8 activations


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("zero_points", [False, True])
@pytest.mark.parametrize("bias", [None, "input", "add"])
def test_keep_all_matches_matmulnbits(bits, zero_points, bias, rng):
    k, n, block = 96, 40, 32
    model = ng.nbits_model(k, n, bits, block, zero_points, bias=bias)
    out, report = rewrite_model(model, EXACT_ALL)
    assert [n.op_type for n in out.graph.node] == ["KwtaBlockMatMul"]  # the Add folded too
    assert report.layers[0].rule == ("matmul_nbits_add" if bias == "add" else "matmul_nbits")
    ours = ortsparse.inference_session(out)
    inits = initializers(model)
    w = dequantize_nbits(inits["B"], inits["scales"], inits.get("zero_points"), k, n, bits, block)
    for m, level in ((1, 0), (3, 0), (7, 4)):
        x = (rng.standard_normal((1, m, k)) * 0.5).astype(np.float32)
        (expected,) = reference_session(model, level).run(None, {"X": x})
        (got,) = ours.run(None, {"X": x})
        bound = fp32_bound(x[0], w) if level == 0 else 2 * int8_bound(x[0], w, block) + fp32_bound(x[0], w)
        assert_within(got[0], expected[0], bound + 1e-6)


def test_own_bias_and_an_add_keep_the_add():
    model = ng.nbits_model(bias="both")
    out, report = rewrite_model(model, EXACT_ALL)
    (record,) = report.layers
    assert record.rule == "matmul_nbits"
    assert any("has its own bias input; the Add after it stays" in why for _, why in record.near_misses)
    assert [n.op_type for n in out.graph.node] == ["KwtaBlockMatMul", "Add"]
    (node,) = kwta_nodes(out)
    assert list(node.input) == ["X", "B", "scales", "", "bias"]  # zero points omitted, bias is input 4
    x = np.random.default_rng(0).standard_normal((1, 2, 96)).astype(np.float32)
    np.testing.assert_allclose(ortsparse.inference_session(out).run(None, {"X": x})[0],
                               reference_session(model, 0).run(None, {"X": x})[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tamper,reason", [
    (dict(g_idx=True), "g_idx input (act-order"),
    (dict(b_as_input=True), "weight B 'B' is a graph input"),
    (dict(scales_as_input=True), "scales 'scales' is a graph input"),
    (dict(float_zero_points=True), "has dtype FLOAT (float zero points)"),
    (dict(bits_attr=2), "bits=2; the ortsparse ops take 4 or 8 bits"),
    (dict(block_attr=256), "block_size=256"),
    (dict(b_shape=(40, 96)), "has shape [40, 96]; K=96, N=40, bits=8, block_size=32 need [40, 3, 32]"),
])
def test_near_misses_leave_the_layer_as_it_is(tamper, reason):
    model = ng.nbits_model(**tamper)
    out, report = rewrite_model(model, EXACT_ALL)
    (record,) = report.layers
    assert not record.rewritten and record.rule is None
    assert reason in record.reason, record.reason
    assert [n.op_type for n in out.graph.node] == ["MatMulNBits"]


def test_shared_quantized_weights_stay_shared():
    """int4 genai graphs: the lm_head's B is also the embedding's GatherBlockQuantized table."""
    model = ng.genai_like(n_layers=1, bits=4, shared_embedding=True)
    out, report = rewrite_model(model, EXACT_ALL)
    assert len(report.rewritten) == 6
    # The only new and dropped initializers are those of the fused gate/up (fuse.py); the rest pass through.
    assert report.added_initializers and all(name.endswith("_fused") for name in report.added_initializers)
    assert report.removed_initializers and all("mlp.gate_proj" in name or "mlp.up_proj" in name
                                               for name in report.removed_initializers)
    readers = [n for n in out.graph.node if "lm_head.MatMul.weight_Q4" in n.input]
    assert sorted(n.op_type for n in readers) == ["KwtaBlockMatMul", "Reshape"]
    assert [i.name for i in out.graph.initializer].count("lm_head.MatMul.weight_Q4") == 1
    feeds = ng.genai_feeds(model, seq=2)
    expected = reference_session(model, 0).run(None, feeds)[0]
    np.testing.assert_allclose(ortsparse.inference_session(out).run(None, feeds)[0], expected, rtol=1e-4,
                               atol=1e-4 * np.abs(expected).max())


# ---------------------------------------------------------------------------------------------
# Techniques on a quantized layer
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,settings,op", [
    ("proc", ProcSettings(block=16), "ProcSparseMatMul"),
    ("tt", TTSettings(rank=2, gap=0.0, min_flop_ratio=0.0), "TTMatMul"),
    ("event", EventSettings(), "EventDrivenMatMul"),
])
def test_float_only_techniques_leave_quantized_layers_as_they_are(name, settings, op):
    model = ng.nbits_model()
    config = without_kwta(techniques={name: TechniqueChoice(settings, enabled=True, target="all")})
    out, report = rewrite_model(model, config)
    (record,) = report.layers
    assert not record.rewritten
    assert record.reason == (f"{name}: {op} takes float32 weights, this layer's are int8 (MatMulNBits); "
                             "left as it is rather than dequantized")
    assert [n.op_type for n in out.graph.node] == ["MatMulNBits"]
    # With KWTA chosen too the layer still stays: the float-only technique was asked for.
    _, report = rewrite_model(model, kwta("all", techniques={name: TechniqueChoice(settings, enabled=True,
                                                                                  target="all")}))
    assert not report.layers[0].rewritten and report.layers[0].reason.startswith(f"{name}: ")


def test_bitmap_gate_alone_and_with_kwta(rng):
    model = ng.nbits_model(bits=4, zero_points=True)
    pack = TechniqueChoice(PackSettings(eps=0.0, density_max=1.0), enabled=True, target="all")
    out, report = rewrite_model(model, without_kwta(techniques={"pack": pack}))
    (node,) = kwta_nodes(out)
    a = attrs(node)
    assert a["pack_mode"] == b"binary" and a["k_frac"] == 1.0 and (a["K"], a["N"], a["bits"]) == (96, 40, 4)
    assert list(node.input) == ["X", "B", "scales", "zero_points"]
    x = rng.standard_normal((1, 1, 96)).astype(np.float32)
    x[..., ::3] = 0.0  # exact zeros the bitmap skips
    expected = reference_session(model, 0).run(None, {"X": x})[0]
    np.testing.assert_allclose(ortsparse.inference_session(out).run(None, {"X": x})[0], expected, rtol=1e-5,
                               atol=1e-5 * np.abs(expected).max())
    out, report = rewrite_model(model, kwta("all", k_frac=0.5, techniques={"pack": pack}))
    a = attrs(kwta_nodes(out)[0])
    assert a["k_frac"] == 0.5 and a["pack_mode"] == b"binary" and a["bits"] == 4


# ---------------------------------------------------------------------------------------------
# onnxruntime-genai shaped graphs
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", [dict(bits=8), dict(bits=4, zero_points=True), dict(bits=4, block=16),
                                  dict(bits=4, shared_embedding=True), dict(bits=None)])
def test_genai_graph_classes(kind):
    report = list_layers(ng.genai_like(n_layers=3, **kind))
    assert [(r.layer_class, r.role) for r in report.layers] == ng.genai_expected(3)
    assert [r.rule for r in report.layers] == ["matmul_nbits" if kind["bits"] else "matmul"] * 16
    assert report.attention_cores == 3
    assert report.layers[0].class_reason == "output feeds attention core input qkv"


@pytest.mark.parametrize("kind", [dict(bits=8), dict(bits=4, zero_points=True)])
def test_genai_graph_rewritten_at_keep_all_matches_onnxruntime(kind):
    model = ng.genai_like(**kind)
    out, report = rewrite_model(model, EXACT_ALL)
    assert len(report.rewritten) == 11
    # gate_proj and up_proj of each MLP read the same input with the same settings: one op each.
    assert [len(f.layers) for f in report.fusions if f.fused] == [2, 2]
    assert len(kwta_nodes(out)) == 9
    assert [n.op_type for n in out.graph.node].count("MatMulNBits") == 0
    ours = ortsparse.inference_session(out)
    for seq in (1, 3):  # decode rows: fp32, as accuracy_level 0
        feeds = ng.genai_feeds(model, batch=1, seq=seq)
        expected = reference_session(model, 0).run(None, feeds)[0]
        got = ours.run(None, feeds)[0]
        assert np.linalg.norm(got - expected) <= 1e-5 * np.linalg.norm(expected)
    # >= 4 dense rows: int8 activations as accuracy_level 4. Per layer the two agree within the
    # int8 rounding bound (above); through a network a rounding that flips on a last-bit
    # difference propagates, so the whole graph is held to the spread between levels 0 and 4.
    feeds = ng.genai_feeds(model, batch=2, seq=5)
    level4 = reference_session(model, 4).run(None, feeds)[0]
    level0 = reference_session(model, 0).run(None, feeds)[0]
    got = ours.run(None, feeds)[0]

    def relative(a, b):
        return np.linalg.norm(a - b) / np.linalg.norm(b)

    assert relative(got, level4) <= max(relative(level0, level4), 1e-5)
