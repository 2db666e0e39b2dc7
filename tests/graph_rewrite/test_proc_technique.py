"""The proc-sparse technique: CLI flags -> ProcSparseMatMul nodes with the builder's tensors, the
composed KWTA gate, exactness at full fanout, overrides."""
from __future__ import annotations

import argparse
import math

import numpy as np
import onnx
import pytest

import tiny_graphs as tg
from configs import without_kwta
from ort_run import assert_same_outputs, relative_l2, run_ortsparse, token_feeds
from ortsparse.cli import add_technique_arguments, config_from_args
from ortsparse.graph_rewrite import ConfigError, RewriteConfig, parse_overrides, rewrite_model
from ortsparse.graph_rewrite.techniques import ProcSettings, TechniqueChoice


def config(*argv):
    parser = argparse.ArgumentParser()
    add_technique_arguments(parser)
    return config_from_args(parser.parse_args(list(argv)))


def proc_nodes(model):
    return [n for n in model.graph.node if n.op_type == "ProcSparseMatMul" and n.domain == "ai.ortsparse"]


def attrs(node):
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def test_flags_build_settings_and_turn_auto_kwta_off():
    c = config("--proc-sparse=on", "--proc-fanout=3", "--proc-block=8", "--proc-base-scale=0.05",
               "--proc-watermark=100", "--proc-shed-eps=1e-4", "--proc-target=down")
    choice = c.choice("proc")
    assert choice.enabled and choice.target == "down" and not c.choice("kwta").enabled
    assert choice.settings == ProcSettings(fanout=3, block=8, base_scale=0.05, watermark=100, shed_eps=1e-4)


def test_full_fanout_without_base_or_shedding_is_exact():
    model = tg.llama_like()
    c = config("--proc-sparse=on", "--proc-fanout-frac=1", "--proc-block=8", "--proc-shed-eps=0",
               "--proc-watermark=0", "--proc-delta-dtype=float32")
    out, report = rewrite_model(model, c)
    nodes = proc_nodes(out)
    assert len(nodes) == len(report.rewritten) == 6  # the MLP layers of the tiny llama
    assert all(r.is_exact for r in report.rewritten)
    onnx.checker.check_model(out, full_check=True)
    assert_same_outputs(model, out, token_feeds(model), rtol=1e-4)
    initializers = {t.name for t in out.graph.initializer}
    assert not any(r.weight in initializers for r in report.rewritten)  # W replaced by the packed form


def unpacked_weight(indices: np.ndarray, deltas: np.ndarray, k: int) -> np.ndarray:
    """W_hat [K, N] of a pure block-sparse layer (base_scale 0), from the documented layout alone:
    unit n's kept block indices[n, f] holds deltas[n, f, :rows], every other entry is 0."""
    n_units, fanout, block = deltas.shape
    w = np.zeros((k, n_units), np.float32)
    for n in range(n_units):
        for f in range(fanout):
            start = int(indices[n, f]) * block
            rows = min(block, k - start)
            w[start:start + rows, n] = deltas[n, f, :rows].astype(np.float32)
    return w


def with_dense_matmuls(out: onnx.ModelProto) -> onnx.ModelProto:
    """``out`` with each ProcSparseMatMul replaced by MatMul(X, W_hat) (+ Add B): the numpy
    reference of what the op computes, run by onnxruntime alone."""
    init = {t.name: onnx.numpy_helper.to_array(t) for t in out.graph.initializer}
    model = onnx.ModelProto()
    model.CopyFrom(out)
    nodes = []
    for node in model.graph.node:
        if node.op_type != "ProcSparseMatMul":
            nodes.append(node)
            continue
        a = attrs(node)
        name = f"{node.name}_w_hat"
        w = unpacked_weight(init[node.input[1]], init[node.input[2]], a["K"])
        model.graph.initializer.append(onnx.numpy_helper.from_array(w, name))
        if len(node.input) > 3 and node.input[3]:
            nodes.append(onnx.helper.make_node("MatMul", [node.input[0], name], [f"{name}_y"]))
            nodes.append(onnx.helper.make_node("Add", [f"{name}_y", node.input[3]], [node.output[0]]))
        else:
            nodes.append(onnx.helper.make_node("MatMul", [node.input[0], name], [node.output[0]]))
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model


def test_partial_fanout_packs_less_and_approximates():
    """fanout_frac 0.5: each unit keeps its top half of blocks by ||W_b|| (score delta, base 0), the
    op computes exactly X @ W_hat of the stored layout, and W_hat drops at most half of each unit's
    energy (the top half of its blocks holds at least half) plus fp16 rounding and shedding."""
    model = tg.llama_like()
    out, report = rewrite_model(model, config("--proc-sparse=on", "--proc-fanout-frac=0.5", "--proc-block=8"))
    nodes = proc_nodes(out)
    init = {t.name: onnx.numpy_helper.to_array(t) for t in out.graph.initializer}
    source = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    assert len(nodes) == len(report.rewritten) == 6
    for node, record in zip(nodes, report.rewritten):
        a = attrs(node)
        indices, deltas = init[node.input[1]], init[node.input[2]]
        assert indices.dtype == np.uint16 and deltas.dtype == np.float16
        assert indices.shape == (a["N"], a["fanout"]) and deltas.shape == (a["N"], a["fanout"], a["block"])
        assert a["fanout"] == math.ceil(0.5 * math.ceil(a["K"] / 8))
        assert (indices.nbytes + deltas.nbytes) / (a["K"] * a["N"] * 4) <= 0.5 + 2 / (8 * 2)
        assert not record.is_exact and any("mem_ratio" in note for note in record.notes)
        w = source[record.weight].astype(np.float64)
        blocks = math.ceil(a["K"] / 8)
        norms = np.stack([np.linalg.norm(w[b * 8:(b + 1) * 8], axis=0) for b in range(blocks)])  # [blocks, N]
        top = np.argsort(-norms, axis=0, kind="stable")[:a["fanout"]]
        assert all(set(indices[n].tolist()) == set(top[:, n].tolist()) for n in range(a["N"]))
        w_hat = unpacked_weight(indices, deltas, a["K"]).astype(np.float64)
        kept = w_hat != 0
        # Kept entries are W in fp16 (shed to 0 below shed_eps = 1e-3), dropped ones 0.
        assert np.all(np.abs(w_hat - w)[kept] <= 2.0 ** -11 * np.abs(w)[kept] + 1e-7)
        dropped = np.linalg.norm(w - w_hat, axis=0) ** 2 / np.linalg.norm(w, axis=0) ** 2
        slack = 1e-3 ** 2 * a["K"] / np.linalg.norm(w, axis=0) ** 2 + 2.0 ** -10
        assert np.all(dropped <= 1 - a["fanout"] / blocks + slack)
    assert_same_outputs(with_dense_matmuls(out), out, token_feeds(model), rtol=1e-4)
    assert relative_l2(model, out, token_feeds(model)) > 1e-3  # approximate: half the blocks are gone


def test_kwta_on_the_same_layer_becomes_the_gate():
    model = tg.llama_like()
    out, report = rewrite_model(model, config("--proc-sparse=on", "--kwta=on", "--kwta-k=0.5", "--proc-block=8",
                                              "--proc-fanout-frac=1"))
    nodes = proc_nodes(out)
    assert nodes and not [n for n in out.graph.node if n.op_type == "KwtaBlockMatMul"]
    for node in nodes:
        a = attrs(node)
        assert a["kwta_k_frac"] == pytest.approx(0.5) and a["kwta_block"] == 1 and a["kwta_score"] == b"l2"
    # The composed gate is KWTA's gate: at full fanout with fp32 deltas and no shedding the proc
    # weights are W, so the model matches the KWTA-only rewrite of the same layers.
    exact_proc = ("--proc-fanout-frac=1", "--proc-delta-dtype=float32", "--proc-shed-eps=0", "--proc-watermark=0")
    composed, _ = rewrite_model(model, config("--proc-sparse=on", "--kwta=on", "--kwta-k=0.5", "--proc-block=8",
                                              *exact_proc))
    kwta_only, _ = rewrite_model(model, config("--kwta=on", "--kwta-k=0.5", "--kwta-target=mlp"))
    assert proc_nodes(composed) and [n for n in kwta_only.graph.node if n.op_type == "KwtaBlockMatMul"]
    feeds = token_feeds(model)
    expected, actual = run_ortsparse(kwta_only, feeds)[0], run_ortsparse(composed, feeds)[0]
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-4 * float(np.abs(expected).max()))
    assert relative_l2(model, composed, feeds) > 1e-3  # the gate drops half the inputs: not the dense model


def test_override_switches_proc_per_layer():
    entries = parse_overrides([{"match": "role:down", "proc": {"fanout": 1, "block": 8}}])
    out, report = rewrite_model(tg.llama_like(), without_kwta(overrides=entries))
    assert report.rewritten and all(r.new_op == "ProcSparseMatMul" and r.role == "down" for r in report.rewritten)
    assert all(attrs(n)["fanout"] == 1 for n in proc_nodes(out))
    with pytest.raises(ConfigError, match="unknown proc-sparse setting"):
        parse_overrides([{"match": "*", "proc": {"fanuot": 1}}])


def test_bad_settings_are_config_errors():
    for kwargs, text in [({"fanout": 0}, "fanout=0"), ({"block": 0}, "block=0"), ({"score": "x"}, "score='x'"),
                         ({"delta_dtype": "int8"}, "delta_dtype='int8'"), ({"fanout_frac": 2.0}, "fanout_frac=2.0")]:
        with pytest.raises(ConfigError, match=text):
            ProcSettings(**kwargs)


def test_wanda_score_uses_calibration_when_given():
    model = tg.llama_like()
    c = RewriteConfig(techniques={
        "proc": TechniqueChoice(ProcSettings(fanout_frac=0.5, block=8, score="wanda"), enabled=True, target="down")})
    _, report = rewrite_model(model, c)
    assert all(any("without calibration" in n for n in r.notes) for r in report.rewritten)
    names = [r.name for r in report.rewritten]
    calib = {name: np.random.default_rng(0).standard_normal((4, r.k)).astype(np.float32)
             for name, r in zip(names, report.rewritten)}
    _, report = rewrite_model(model, c, calibration=calib)
    assert not any(any("without calibration" in n for n in r.notes) for r in report.rewritten)


def test_proc_with_the_bitmap_gate_on_one_layer_is_an_error_naming_both():
    c = config("--proc-sparse=on", "--proc-target=down", "--state-pack=binary", "--state-pack-target=down")
    with pytest.raises(ConfigError, match=r"ProcSparseMatMul \(proc\) cannot be combined with pack"):
        rewrite_model(tg.llama_like(), c)
