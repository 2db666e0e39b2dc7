"""onnxruntime-genai decoder files through the CLI: hand-built genai-shaped files (fast), and the
real SmolLM2 genai fp32 / int8 / int4 models of the cache (slow; ``ortsparse models`` builds them).

These graphs use onnxruntime's contrib ops, one of them in the default domain
(SimplifiedLayerNormalization), which onnx.checker does not know: files are judged as onnxruntime
judges them, and the written file is held to the input's check."""
from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import nbits_graphs as ng
from ortsparse.cli import rewrite_onnx_main
from ortsparse.graph_rewrite import list_file_layers

import ortsparse

# name part -> (class, role) of the SmolLM2 genai layers
GENAI_CLASSES = {"qkv_proj": ("attn", "qkv"), "o_proj": ("attn", "out"), "gate_proj": ("mlp", "up"),
                 "up_proj": ("mlp", "up"), "down_proj": ("mlp", "down"), "lm_head": ("head", "head")}


def table_rows(text: str) -> list[list[str]]:
    """The layer table's rows (index, name, op, class, role, K, N, decision, detail...), not the
    attention table's that follows it."""
    layers = text.split("anchor", 1)[0]
    return [line.split() for line in layers.splitlines() if re.match(r"^\s*\d+\s+/", line)]


def check_classes(rows: list[list[str]], layers: int) -> None:
    seen = Counter()
    for row in rows:
        name, layer_class, role = row[1], row[3], row[4]
        part = next(p for p in GENAI_CLASSES if f"/{p}/" in name)
        assert (layer_class, role) == GENAI_CLASSES[part], row
        seen[part] += 1
    assert seen == Counter({**{p: layers for p in GENAI_CLASSES if p != "lm_head"}, "lm_head": 1})


def test_list_layers_of_a_genai_shaped_file(tmp_path, capsys):
    path = tmp_path / "model.onnx"
    onnx.save(ng.genai_like(n_layers=3, bits=4, zero_points=True), path)
    with pytest.raises(onnx.checker.ValidationError, match="SimplifiedLayerNormalization"):
        onnx.checker.check_model(str(path))  # what made such files unreadable
    assert rewrite_onnx_main([str(path), "--list-layers"]) == 0
    printed = capsys.readouterr().out
    rows = table_rows(printed)
    assert len(rows) == 16
    assert [(r[3], r[4]) for r in rows] == ng.genai_expected(3)
    assert all(r[2] == "com.microsoft.MatMulNBits" for r in rows)


def test_rewrite_of_a_genai_shaped_file_runs(tmp_path, capsys):
    source, target = tmp_path / "model.onnx", tmp_path / "out.onnx"
    model = ng.genai_like(n_layers=2, bits=8)
    onnx.save(model, source)
    assert rewrite_onnx_main([str(source), "-o", str(target), "--kwta-target", "all", "--kwta-k", "1"]) == 0
    assert "the output passed the plain check, as the input did" in capsys.readouterr().out
    feeds = ng.genai_feeds(model, seq=2)
    reference = ort.InferenceSession(ng.with_accuracy_level(model, 0).SerializeToString(),
                                     providers=["CPUExecutionProvider"])
    expected = reference.run(None, feeds)[0]
    got = ortsparse.inference_session(str(target)).run(None, feeds)[0]
    assert np.linalg.norm(got - expected) <= 1e-5 * np.linalg.norm(expected)


def test_a_default_domain_op_unknown_to_onnxruntime_too_is_still_refused(tmp_path, capsys):
    model = ng.genai_like(n_layers=1, bits=8)
    for node in model.graph.node:
        if node.op_type == "SimplifiedLayerNormalization":
            node.op_type = "NoSuchNormalization"
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    assert rewrite_onnx_main([str(path), "--list-layers"]) == 2
    assert "No Op registered for NoSuchNormalization" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# The real models (slow)
# ---------------------------------------------------------------------------------------------

def genai_model(kind: str) -> Path:
    from ortsparse.zoo.cache import models_dir

    path = models_dir() / "smollm2" / f"genai-{kind}" / "model.onnx"
    if not path.is_file():
        pytest.skip(f"{path} is not built (ortsparse models)")
    return path


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fp32", "int8", "int4"])
def test_smollm2_genai_layers_classify(kind, capsys):
    path = genai_model(kind)
    assert rewrite_onnx_main([str(path), "--list-layers"]) == 0
    rows = table_rows(capsys.readouterr().out)
    assert len(rows) == 151
    check_classes(rows, 30)
    op = "MatMul" if kind == "fp32" else "com.microsoft.MatMulNBits"
    assert all(r[2] == op for r in rows)
    report = list_file_layers(path)
    assert all(r.rule == ("matmul" if kind == "fp32" else "matmul_nbits") for r in report.layers)
    assert report.attention_cores == 30


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_smollm2_genai_gated_at_keep_all_matches_onnxruntime(kind, tmp_path):
    """Every layer KWTA-gated at keep-all on the stored int8/int4 weights: decode rows against the
    genai model at accuracy_level 0 (its own is 4, which rounds activations to int8)."""
    path = genai_model(kind)
    target = tmp_path / "model.onnx"
    assert rewrite_onnx_main([str(path), "-o", str(target), "--kwta-target", "all", "--kwta-k", "1", "-q"]) == 0
    written = onnx.load(target, load_external_data=False)
    # 151 layers; gate_proj + up_proj of each of the 30 MLPs fused into one op (exact).
    assert sum(n.op_type == "KwtaBlockMatMul" for n in written.graph.node) == 151 - 30
    level0 = ng.with_accuracy_level(onnx.load(path), 0)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    reference = ort.InferenceSession(level0.SerializeToString(), options, providers=["CPUExecutionProvider"])
    ours = ortsparse.inference_session(str(target), intra_op_num_threads=2)
    rng = np.random.default_rng(0)
    feeds = {"input_ids": rng.integers(0, 49152, (1, 2)).astype(np.int64), "attention_mask": np.ones((1, 2), np.int64)}
    feeds.update({i.name: np.zeros((1, 3, 0, 64), np.float32) for i in reference.get_inputs()
                  if i.name.startswith("past_key_values")})
    expected = reference.run(["logits"], feeds)[0]
    got = ours.run(["logits"], feeds)[0]
    assert np.linalg.norm(got - expected) <= 1e-5 * np.linalg.norm(expected)


@pytest.mark.slow
@pytest.mark.parametrize("bits", [8, 4])
def test_weights_flag_on_genai_fp32_makes_genais_own_quantized_tensors(bits, tmp_path):
    """--weights on the fp32 genai model: every layer's B and scales equal, bit for bit, those of the
    int8 / int4 model onnxruntime-genai's builder wrote; KWTA gates the MLP layers, the rest are
    MatMulNBits."""
    source, reference = genai_model("fp32"), genai_model(f"int{bits}")
    target = tmp_path / "model.onnx"
    assert rewrite_onnx_main([str(source), "-o", str(target), "--weights", f"int{bits}", "-q", "--no-fuse"]) == 0
    ours = {i.name: i for i in onnx.load(target).graph.initializer}
    theirs = {i.name: i for i in onnx.load(reference).graph.initializer}
    quantized = [name for name in theirs if name.endswith((f"_Q{bits}", "_scales"))]
    assert len(quantized) == 2 * 151
    for name in quantized:
        np.testing.assert_array_equal(onnx.numpy_helper.to_array(ours[name]), onnx.numpy_helper.to_array(theirs[name]),
                                      err_msg=name)
    ops = Counter(n.op_type for n in onnx.load(target, load_external_data=False).graph.node)
    assert ops["KwtaBlockMatMul"] == 90 and ops["MatMulNBits"] == 61 and ops["MatMul"] == 0
