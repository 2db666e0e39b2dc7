"""--weights int8|int4 (technique "quant"): float32 layers quantized with onnxruntime's own block
quantizer, gated by KWTA in the same rewrite where KWTA selects them, MatMulNBits elsewhere.

Checked against onnxruntime's ``MatMulNBitsQuantizer`` output (same tensors, bit for bit; same
outputs), against the float model whose weights are replaced by their dequantized values (every
rule's form: Gemm transB, MatMul+Add on either side, tied lm_head), and for the flags, the report,
overrides and the combinations that are refused."""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import nbits_graphs as ng
import tiny_graphs as tg
from configs import kwta, without_kwta
from ort_run import kwta_nodes, token_feeds
from ortsparse.cli import add_technique_arguments, config_from_args, rewrite_onnx_main
from ortsparse.graph_rewrite import (ConfigError, QuantSettings, RewriteConfig, list_layers, parse_overrides,
                                     rewrite_model)
from ortsparse.graph_rewrite.rules import dequantize_nbits
from ortsparse.graph_rewrite.techniques import EventSettings, ProcSettings, TechniqueChoice

import ortsparse

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny"


def parse(argv):
    parser = argparse.ArgumentParser()
    add_technique_arguments(parser)
    return config_from_args(parser.parse_args(argv))


def quant(target: str = "all", **settings) -> TechniqueChoice:
    return TechniqueChoice(QuantSettings(**settings), enabled=True, target=target)


def initializers(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}


def attrs(node: onnx.NodeProto) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b.astype(np.float64)))


def ort_quantized(model: onnx.ModelProto, bits: int, block: int = 32, symmetric: bool = True,
                  accuracy_level: int = 4) -> onnx.ModelProto:
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    quantizer = MatMulNBitsQuantizer(copy, bits=bits, block_size=block, is_symmetric=symmetric,
                                     accuracy_level=accuracy_level)
    quantizer.process()
    return quantizer.model.model


def dequantized_float_model(model: onnx.ModelProto, rewritten: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with each float weight the rewrite quantized replaced by its dequantized value
    (read back from the rewritten model's MatMulNBits / KwtaBlockMatMul inputs)."""
    inits = initializers(rewritten)
    by_source = {}
    for node in rewritten.graph.node:
        if node.op_type in ("MatMulNBits", "KwtaBlockMatMul") and len(node.input) > 2 and node.input[1].endswith(
                ("_Q8", "_Q4")):
            a = attrs(node)
            zp = inits.get(node.input[3]) if len(node.input) > 3 and node.input[3] else None
            w = dequantize_nbits(inits[node.input[1]], inits[node.input[2]], zp, a["K"], a["N"], a["bits"],
                                 a["block_size"])
            by_source[node.input[1].rsplit("_Q", 1)[0]] = w
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    replaced = 0
    for source, w in by_source.items():
        if source.endswith("_T"):  # a tied head: its Transpose reads a dequantized copy, the Gather the original
            name = source[:-2]
            copy.graph.initializer.append(onnx.numpy_helper.from_array(np.ascontiguousarray(w.T), f"{name}_dq"))
            for node in copy.graph.node:
                if node.op_type == "Transpose" and node.input[0] == name:
                    node.input[0] = f"{name}_dq"
                    replaced += 1
            continue
        for tensor in copy.graph.initializer:
            if tensor.name == source:
                tensor.CopyFrom(onnx.numpy_helper.from_array(w.reshape(tuple(tensor.dims)), source))
                replaced += 1
    assert replaced == len(by_source)
    return copy


# ---------------------------------------------------------------------------------------------
# Flags and settings
# ---------------------------------------------------------------------------------------------

def test_flags_quantize_and_keep_kwta_auto_on():
    config = parse(["--weights", "int4", "--weights-block-size", "64"])
    choice = config.choice("quant")
    assert choice.enabled and choice.target == "all"
    assert choice.settings == QuantSettings(dtype="int4", block_size=64)
    assert config.choice("kwta").enabled  # --weights quantizes *and* KWTA (auto) gates
    assert not parse([]).choice("quant").enabled
    assert parse(["--weights", "none"]).choice("quant").enabled is False
    assert not parse(["--weights", "int8", "--proc-sparse", "on"]).choice("kwta").enabled  # others still do
    with pytest.raises(SystemExit):
        parse(["--weights-block-size", "24"])


@pytest.mark.parametrize("bad,message", [
    (dict(dtype="int2"), "dtype='int2'"), (dict(block_size=24), "block_size=24"), (dict(symmetric=2), "symmetric=2"),
    (dict(accuracy_level=5), "accuracy_level=5"),
])
def test_bad_settings(bad, message):
    with pytest.raises(ConfigError, match=message):
        QuantSettings(**bad)


# ---------------------------------------------------------------------------------------------
# Against onnxruntime's own quantizer
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [8, 4])
def test_same_tensors_and_outputs_as_onnxruntimes_quantizer(bits):
    model = onnx.load(TINY / "llama_tiny.torchscript.onnx")
    dtype = f"int{bits}"
    out, report = rewrite_model(model, without_kwta(techniques={"quant": quant(dtype=dtype)}))
    onnx.checker.check_model(out, full_check=True)
    reference = ort_quantized(model, bits)
    ours, theirs = initializers(out), initializers(reference)
    quantized = [name for name in theirs if name.endswith((f"_Q{bits}", "_scales"))]
    assert len(quantized) == 2 * len(report.layers) == 30  # every layer, the head too
    for name in quantized:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    assert not any(name in ours for name in report.removed_initializers)
    nodes = [n for n in out.graph.node if n.op_type == "MatMulNBits"]
    assert len(nodes) == 15 and all(n.domain == "com.microsoft" for n in nodes)
    assert all(attrs(n)["accuracy_level"] == 4 and attrs(n)["block_size"] == 32 for n in nodes)
    assert all(r.new_op == "MatMulNBits" and not r.is_exact for r in report.layers)
    feeds = token_feeds(model, batch=2, seq=5)
    np.testing.assert_allclose(session(out).run(None, feeds)[0], session(reference).run(None, feeds)[0],
                               rtol=1e-5, atol=1e-5)


def test_gated_layers_match_onnxruntime_quantized_model():
    """KWTA (keep all) on the quantized MLP layers, MatMulNBits elsewhere: decode rows (fp32) against
    onnxruntime's quantized model at accuracy_level 0, prefill rows (int8) against level 4."""
    model = onnx.load(TINY / "llama_tiny.torchscript.onnx")
    config = kwta("mlp", k_frac=1.0, techniques={"quant": quant(accuracy_level=0)})
    out, report = rewrite_model(model, config, fuse=False)  # one node per layer (test_fuse_shared_input.py fuses)
    gated = kwta_nodes(out)
    assert len(gated) == 6 and all(attrs(n)["bits"] == 8 and n.input[1].endswith("_Q8") for n in gated)
    assert [r.new_op for r in report.layers].count("MatMulNBits") == 9
    ours = ortsparse.inference_session(out)
    level0 = session(ort_quantized(model, 8, accuracy_level=0))
    for seq in (1, 3):
        feeds = token_feeds(model, batch=1, seq=seq)
        assert relative(ours.run(None, feeds)[0], level0.run(None, feeds)[0]) <= 1e-5
    ours4 = ortsparse.inference_session(rewrite_model(model, kwta("mlp", k_frac=1.0,
                                                                  techniques={"quant": quant()}), fuse=False)[0])
    level4 = session(ort_quantized(model, 8))
    feeds = token_feeds(model, batch=2, seq=5)
    # Per layer the int8 paths agree within the rounding bound (test_matmul_nbits.py); through a
    # network, roundings flipped by last-bit differences propagate: held to the level 0 / 4 spread.
    spread = relative(level0.run(None, feeds)[0], level4.run(None, feeds)[0])
    assert relative(ours4.run(None, feeds)[0], level4.run(None, feeds)[0]) <= max(spread, 1e-5)


@pytest.mark.parametrize("family,kwargs", [("gpt2", {}), ("bert", {}), ("llama", {})])
@pytest.mark.parametrize("dtype,block,symmetric", [("int8", 32, 1), ("int4", 16, 0)])
def test_every_rule_form_quantizes_to_what_it_computes(family, kwargs, dtype, block, symmetric):
    """Gemm (transB, bias C), MatMul+Add (bias either side), the tied lm_head: the rewritten model
    (accuracy_level 0, keep-all KWTA on the MLP) equals the float model with dequantized weights."""
    model = {"gpt2": tg.gpt2_like, "bert": tg.bert_like, "llama": tg.llama_like}[family](**kwargs)
    settings = dict(dtype=dtype, block_size=block, symmetric=symmetric, accuracy_level=0)
    # fuse=False: dequantized_float_model reads each layer's own weights (fusion: test_fuse_shared_input.py).
    out, report = rewrite_model(model, kwta("mlp", k_frac=1.0, techniques={"quant": quant(**settings)}), fuse=False)
    onnx.checker.check_model(out, full_check=True)
    assert len(report.rewritten) == len(report.layers)
    bits = 8 if dtype == "int8" else 4
    for node in out.graph.node:
        if node.op_type in ("MatMulNBits", "KwtaBlockMatMul"):
            assert (len(node.input) > 3 and bool(node.input[3])) == (not symmetric), node.name
            assert attrs(node)["bits"] == bits and attrs(node)["block_size"] == block
    float_model = dequantized_float_model(model, out)
    feeds = token_feeds(model, batch=1, seq=3)
    expected = session(float_model).run(None, feeds)[0]
    assert relative(ortsparse.inference_session(out).run(None, feeds)[0], expected) <= 1e-5
    assert relative(expected, session(model).run(None, feeds)[0]) > 1e-4  # it did quantize


def test_tied_head_and_shared_weights_are_quantized_once():
    model = tg.gpt2_like()
    out, report = rewrite_model(model, without_kwta(techniques={"quant": quant()}))
    names = set(initializers(out))
    assert "transformer.wte.weight" in names  # the embedding Gather still reads it
    assert {"transformer.wte.weight_T_Q8", "transformer.wte.weight_T_scales"} <= names
    assert "transformer.wte.weight_T" not in names  # no float copy of the transpose
    shared = tg.shared_weight_model()
    out, report = rewrite_model(shared, without_kwta(techniques={"quant": quant()}))
    readers = [n for n in out.graph.node if n.op_type == "MatMulNBits"]
    assert [n.input[1] for n in readers] == ["W_Q8", "W_Q8", "V_T_Q8", "V_T_Q8"]  # Gemm transB=1 reads V^T
    assert sorted(report.added_initializers) == ["V_T_Q8", "V_T_scales", "W_Q8", "W_scales"]
    assert sorted(report.removed_initializers) == ["V", "W"]


# ---------------------------------------------------------------------------------------------
# Report, overrides, refusals, already quantized layers
# ---------------------------------------------------------------------------------------------

def test_report_says_what_is_gated_and_what_is_only_quantized():
    report = list_layers(tg.llama_like(), parse(["--weights", "int8"]))
    by_class = {(r.layer_class, r.new_op) for r in report.layers}
    assert by_class == {("attn", "MatMulNBits"), ("mlp", "KwtaBlockMatMul"), ("head", "MatMulNBits")}
    attn = next(r for r in report.layers if r.layer_class == "attn")
    assert attn.detail() == "MatMulNBits dtype=int8 block_size=32; not gated: class attn not in --kwta-target=mlp"
    mlp = next(r for r in report.layers if r.layer_class == "mlp")
    assert mlp.detail() == "KwtaBlockMatMul dtype=int8 block_size=32 + kwta(block=1)"
    assert not report.exact
    assert "20 -> MatMulNBits" not in report.summary() and "-> MatMulNBits" in report.summary()


def test_override_keeps_a_layer_float_or_changes_its_settings():
    entries = parse_overrides([{"match": "class:head", "quant": "off"},
                               {"match": "*down_proj*", "quant": {"dtype": "int4", "block_size": 16}}])
    out, report = rewrite_model(tg.llama_like(), kwta("mlp", techniques={"quant": quant()}, overrides=entries))
    head = report.layers[-1]
    assert head.layer_class == "head" and head.new_op is None
    assert [n.op_type for n in out.graph.node if n.name == head.name] == ["MatMul"]
    downs = [n for n in kwta_nodes(out) if "down" in n.name]
    assert downs and all(attrs(n)["bits"] == 4 and attrs(n)["block_size"] == 16 for n in downs)


@pytest.mark.parametrize("name,settings", [("event", EventSettings()), ("proc", ProcSettings(block=8))])
def test_float_only_techniques_on_a_quantized_layer_are_refused(name, settings):
    config = RewriteConfig(techniques={"quant": quant(), name: TechniqueChoice(settings, enabled=True, target="mlp")})
    with pytest.raises(ConfigError, match="layer '.*mlp.*'"):
        rewrite_model(tg.llama_like(), config)


def test_cli_refusal_is_exit_2(tmp_path, capsys):
    path = tmp_path / "m.onnx"
    onnx.save(tg.llama_like(), path)
    assert rewrite_onnx_main([str(path), "--list-layers", "--weights", "int8", "--event-driven", "on"]) == 2
    assert "cannot be combined with event" in capsys.readouterr().err


def test_already_quantized_layers_are_left_to_the_gates():
    model = ng.genai_like(n_layers=1, bits=8)
    out, report = rewrite_model(model, parse(["--weights", "int4"]), fuse=False)
    assert [n.op_type for n in out.graph.node].count("MatMulNBits") == 3  # attn and head: not gated, as they were
    assert len(kwta_nodes(out)) == 3 and all(attrs(n)["bits"] == 8 for n in kwta_nodes(out))
    assert not report.added_initializers and not report.removed_initializers
    assert all("--weights=int4: the weight is already int8, kept as is" in r.detail() for r in report.layers)


def test_cli_writes_a_checked_quantized_model(tmp_path, capsys):
    source, target = tmp_path / "m.onnx", tmp_path / "q.onnx"
    model = onnx.load(TINY / "llama_tiny.torchscript.onnx")
    onnx.save(model, source)
    assert rewrite_onnx_main([str(source), "-o", str(target), "--weights", "int8", "--kwta-k", "1"]) == 0
    printed = capsys.readouterr().out
    assert "15 rewritten (9 -> MatMulNBits, 6 -> KwtaBlockMatMul)" in printed
    written = onnx.load(target)
    assert {(o.domain, o.version) for o in written.opset_import} >= {("com.microsoft", 1), ("ai.ortsparse", 1)}
    assert target.stat().st_size < 0.7 * source.stat().st_size  # int8: ~1/4 of every layer's weight
    assert rewrite_onnx_main([str(source), "--list-layers", "--weights", "int4"]) == 0
    assert "KwtaBlockMatMul dtype=int4 block_size=32 + kwta(block=1)" in capsys.readouterr().out


def test_bitmap_gate_on_quantized_down_projections():
    model = tg.llama_like()
    config = parse(["--weights", "int8", "--state-pack", "binary", "--state-pack-eps", "0"])
    assert not config.choice("kwta").enabled  # the bitmap gate turns KWTA's auto off; --weights does not
    out, report = rewrite_model(model, config)
    gated = kwta_nodes(out)
    assert len(gated) == 2 and all("down" in n.name for n in gated)
    assert all(attrs(n)["pack_mode"] == b"binary" and attrs(n)["bits"] == 8 for n in gated)
    assert [n.op_type for n in out.graph.node].count("MatMulNBits") == len(report.layers) - 2
    data = report.to_dict()
    assert data["config"]["techniques"]["quant"]["settings"]["dtype"] == "int8"
    assert next(r for r in data["layers"] if "down" in r["name"])["partners"]["pack"]["pack_mode"] == "binary"
