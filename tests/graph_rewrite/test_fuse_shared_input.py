"""graph_rewrite/fuse.py: quantized gated layers on one input fused into one KwtaBlockMatMul + Split.
The fused graph must give bit-identical outputs (decode rows and the int8 prefill), keep the
original output names, drop the per-layer weights, and leave near-misses apart with a reason."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import nbits_graphs as ng
from configs import kwta
from ort_run import kwta_nodes
from ortsparse.graph_rewrite import LayerOverride, rewrite_model
from ortsparse.graph_rewrite.fuse import FUSED_NAME_SEPARATOR

import ortsparse

K = 96


def shared_input_model(ns=(70, 130), bits=8, block=32, zero_points=False, bias_on=None, seed=0) -> onnx.ModelProto:
    """X [M, K] read by one MatMulNBits per N in ``ns`` (named l0, l1, ...); each output a graph output."""
    b = ng.Builder(seed)
    outputs = []
    for i, n in enumerate(ns):
        y = b.nbits("X", K, n, f"l{i}", bits, block, zero_points, accuracy_level=4)
        if bias_on == i:
            y = b.op("Add", [y, b.const(f"l{i}.bias", b.rng.standard_normal(n).astype(np.float32))], name=f"/l{i}/Add")
        outputs.append(helper.make_tensor_value_info(y, TensorProto.FLOAT, ["m", n]))
    return b.model([helper.make_tensor_value_info("X", TensorProto.FLOAT, ["m", K])], outputs)


def run(model: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), ortsparse.session_options(intra_op_num_threads=1),
                                   providers=["CPUExecutionProvider"])
    return session.run(None, {"X": x})


def gated(threshold=0.4):
    return kwta("all", k_frac=1.0, threshold=threshold)


@pytest.mark.parametrize("threshold", [0.4, 0.0])  # gated rows / every row (>= 4 tokens: the int8 prefill)
@pytest.mark.parametrize("bits,block,zero_points", [(8, 32, False), (4, 32, True), (8, 16, True), (4, 128, False)])
def test_fused_outputs_are_bit_identical(bits, block, zero_points, threshold):
    model = shared_input_model(ns=(70, 130, 64), bits=bits, block=block, zero_points=zero_points)
    fused, report = rewrite_model(model, gated(threshold))
    apart, _ = rewrite_model(model, gated(threshold), fuse=False)
    assert [f.fused is not None for f in report.fusions] == [True]
    nodes = kwta_nodes(fused)
    assert len(nodes) == 1 and nodes[0].name == FUSED_NAME_SEPARATOR.join(f"/l{i}/MatMul_Q{bits}" for i in range(3))
    assert {a.name: helper.get_attribute_value(a) for a in nodes[0].attribute}["N"] == 70 + 130 + 64
    assert [o.name for o in fused.graph.output] == [o.name for o in model.graph.output]
    # The per-layer weights are gone (one concatenated copy instead).
    names = {i.name for i in fused.graph.initializer}
    originals = {i.name for i in model.graph.initializer}
    assert not names & originals and len(names) == (3 if zero_points else 2)
    rng = np.random.default_rng(1)
    for m in (1, 2, 8):  # decode rows one by one, a small batch, the int8 prefill
        x = rng.standard_normal((m, K)).astype(np.float32)
        for got, want in zip(run(fused, x), run(apart, x)):
            np.testing.assert_array_equal(got, want)


def test_fused_model_matches_matmulnbits_dense():
    model = ng.with_accuracy_level(shared_input_model(), 0)  # fp32 products on both sides
    fused, _ = rewrite_model(model, kwta("all", k_frac=1.0))
    x = np.random.default_rng(2).standard_normal((1, K)).astype(np.float32)
    reference = ort.InferenceSession(model.SerializeToString(),
                                     providers=["CPUExecutionProvider"]).run(None, {"X": x})
    for got, want in zip(run(fused, x), reference):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_near_misses_stay_apart_with_a_reason():
    model = shared_input_model()
    # Thresholds calibrated apart: the gates would keep different rows.
    overrides = (LayerOverride(match="/l1/*", techniques={"kwta": {"threshold": 0.9}}),)
    _, report = rewrite_model(model, kwta("all", k_frac=1.0, threshold=0.4, overrides=overrides))
    assert [f.fused for f in report.fusions] == [None] and "threshold" in report.fusions[0].why
    # A bias on one layer.
    _, report = rewrite_model(shared_input_model(bias_on=0), gated())
    assert [f.fused for f in report.fusions] == [None] and "bias" in report.fusions[0].why
    # Layers kept apart by fuse=False, and a preview (list_layers) never fuses.
    _, report = rewrite_model(model, gated(), fuse=False)
    assert report.fusions == []


def test_fused_node_metrics_speak_for_each_layer():
    """The op reports per node; the harness attributes a fused node's keep ratio to its layers."""
    from ortsparse.measure.op_metrics import metrics_summary

    fused = FUSED_NAME_SEPARATOR.join(["/l0/MatMul_Q8", "/l1/MatMul_Q8"])
    raw = {f"KwtaBlockMatMul/{fused}": {"node": fused, "calls": 3, "blocks_total": 100, "blocks_kept": 75},
           "KwtaBlockMatMul/other": {"node": "other", "calls": 1, "blocks_total": 10, "blocks_kept": 5}}
    nodes = metrics_summary(raw)["nodes"]
    assert nodes["/l0/MatMul_Q8"] == nodes["/l1/MatMul_Q8"] == nodes[fused] == 0.75 and nodes["other"] == 0.5


def test_cli_fuses_by_default_and_no_fuse_keeps_the_layers(tmp_path, capsys):
    from ortsparse.cli import rewrite_onnx_main

    source = tmp_path / "m.onnx"
    onnx.save(shared_input_model(), source)
    for flags, nodes in (([], 1), (["--no-fuse"], 2)):
        target = tmp_path / f"out{nodes}.onnx"
        assert rewrite_onnx_main([str(source), "-o", str(target), "--kwta-target", "all", "--kwta-threshold", "0.4",
                                  "--kwta-k", "1", "--no-check", *flags]) == 0
        assert len(kwta_nodes(onnx.load(target))) == nodes
    assert "fused 2 quantized gated layers into 1 ops" in capsys.readouterr().out


def swiglu_model(form="sigmoid", swap_mul=False, gate_also_output=False, n=72, bits=8, zero_points=False):
    """An MLP's SwiGLU on MatMulNBits: Mul(silu(gate(X)), up(X)) (or up first), silu as
    Sigmoid + Mul or as com.microsoft.QuickGelu(alpha=1)."""
    b = ng.Builder(3)
    gate = b.nbits("X", K, n, "gate_proj", bits, 32, zero_points, accuracy_level=4)
    up = b.nbits("X", K, n, "up_proj", bits, 32, zero_points, accuracy_level=4)
    if form == "quickgelu":
        act = b.op("QuickGelu", [gate], name="/act/QuickGelu", domain="com.microsoft", alpha=1.0)
    else:
        act = b.op("Mul", [gate, b.op("Sigmoid", [gate], name="/act/Sigmoid")], name="/act/Mul")
    y = b.op("Mul", [up, act] if swap_mul else [act, up], name="/mlp/Mul")
    outputs = [helper.make_tensor_value_info(y, TensorProto.FLOAT, ["m", n])]
    if gate_also_output:
        outputs.append(helper.make_tensor_value_info(gate, TensorProto.FLOAT, ["m", n]))
    return b.model([helper.make_tensor_value_info("X", TensorProto.FLOAT, ["m", K])], outputs)


@pytest.mark.parametrize("form,swap_mul", [("sigmoid", False), ("sigmoid", True), ("quickgelu", False)])
@pytest.mark.parametrize("bits,zero_points", [(8, False), (4, True)])
def test_swiglu_pair_becomes_one_node_with_its_activation(form, swap_mul, bits, zero_points):
    model = swiglu_model(form, swap_mul, bits=bits, zero_points=zero_points)
    fused, report = rewrite_model(model, gated())
    apart, _ = rewrite_model(model, gated(), fuse=False)
    assert [(f.fused is not None, f.glu) for f in report.fusions] == [(True, "silu")]
    assert [n.op_type for n in fused.graph.node] == ["KwtaBlockMatMul"]
    node = fused.graph.node[0]
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attributes["glu"] == b"silu" and attributes["N"] == 144
    assert node.name == f"/gate_proj/MatMul_Q{bits}{FUSED_NAME_SEPARATOR}/up_proj/MatMul_Q{bits}"  # gate first
    assert [o.name for o in fused.graph.output] == [o.name for o in model.graph.output]
    assert "with their SwiGLU activation" in report.summary()
    rng = np.random.default_rng(4)
    for m in (1, 2, 8):  # decode rows, a batch, the int8 prefill
        x = rng.standard_normal((m, K)).astype(np.float32)
        (got,), (want,) = run(fused, x), run(apart, x)
        # The products are the same bits; only the activation's rounding differs (ours vs ORT's).
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


def test_swiglu_near_miss_keeps_the_split_form_and_says_why():
    model = swiglu_model(gate_also_output=True)
    fused, report = rewrite_model(model, gated())
    apart, _ = rewrite_model(model, gated(), fuse=False)
    (fusion,) = report.fusions
    assert fusion.fused and not fusion.glu and "only use" in fusion.why_no_glu
    assert "not as a SwiGLU" in report.summary()
    assert sorted(n.op_type for n in fused.graph.node) == ["Constant", "KwtaBlockMatMul", "Mul", "Mul", "Sigmoid", "Split"]
    x = np.random.default_rng(5).standard_normal((1, K)).astype(np.float32)
    for got, want in zip(run(fused, x), run(apart, x)):
        np.testing.assert_array_equal(got, want)
