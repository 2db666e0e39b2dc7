"""The `tt` technique in the rewriter: TTMatMul nodes with their cores, the gap / speed checks that
keep a layer dense (and say why), autotune with calibration inputs, flags, exclusivity."""
from __future__ import annotations

import argparse
import json

import numpy as np
import onnx
import onnx.numpy_helper as nh
import pytest
import tiny_graphs as tg
from ort_run import assert_same_outputs, op_types, token_feeds

from ortsparse.cli import add_technique_arguments, config_from_args
from ortsparse.graph_rewrite import ConfigError, KwtaSettings, RewriteConfig, rewrite_model
from ortsparse.graph_rewrite import compose as compose_module
from ortsparse.graph_rewrite.techniques import TechniqueChoice, TTSettings
from ortsparse.commands.calibrate import layer_calibration


def tt_config(target="mlp", **settings):
    return RewriteConfig(techniques={"tt": TechniqueChoice(TTSettings(**settings), enabled=True, target=target)})


def test_full_rank_tt_is_exact_end_to_end():
    model = tg.llama_like()
    # full rank (16 = D_MODEL): exact; no gap / speed checks so the tiny layers are rewritten
    out, report = rewrite_model(model, tt_config(rank=16, gap=0.0, min_flop_ratio=0.0))
    assert op_types(out).count("TTMatMul") == len(report.rewritten) == 6  # 3 MLP linears x 2 layers
    assert "KwtaBlockMatMul" not in op_types(out)
    onnx.checker.check_model(out, full_check=True)
    assert_same_outputs(model, out, token_feeds(model), rtol=2e-4)
    node = next(n for n in out.graph.node if n.op_type == "TTMatMul")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert len(attrs["in_modes"]) == 2 and attrs["ranks"][0] == attrs["ranks"][-1] == 1
    meta = json.loads({p.key: p.value for p in node.metadata_props}["ortsparse.tt"])
    assert meta["decision"] == "tt" and meta["ranks"] == attrs["ranks"]
    record = report.rewritten[0]
    assert any("gap = relative weight error" in note for note in record.notes)  # no calibration given
    # the original weights are gone, replaced by the packed cores
    names = {t.name for t in out.graph.initializer}
    assert all(r.weight not in names for r in report.rewritten)


def test_gap_and_speed_checks_keep_layers_dense_with_a_reason():
    model = tg.llama_like()
    out, report = rewrite_model(model, tt_config(rank=1, gap=0.02, min_flop_ratio=0.0))
    assert "TTMatMul" not in op_types(out) and not report.rewritten
    mlp = [r for r in report.layers if r.layer_class == "mlp"]
    assert mlp and all("tt: kept dense: gap" in r.reason for r in mlp)
    _, report = rewrite_model(model, tt_config(rank=16, gap=0.0))
    assert all("no speed benefit" in r.reason for r in report.layers if r.layer_class == "mlp")


def test_autotune_with_calibration_picks_the_rank():
    model = tg.matmul_model()
    w_init = next(t for t in model.graph.initializer if t.name == "W")
    k, n = nh.to_array(w_init).shape
    rng = np.random.default_rng(0)
    low = (rng.standard_normal((k, 2)) @ rng.standard_normal((2, n))).astype(np.float32)
    w_init.CopyFrom(nh.from_array(low, "W"))
    x = rng.standard_normal((64, k)).astype(np.float32)
    out, report = rewrite_model(model, tt_config(target="all", rank=0, gap=1e-4, min_flop_ratio=0.0),
                                calibration={"/layer/MatMul": x})
    (record,) = report.rewritten
    assert record.attributes["ranks"] == [1, 2, 1] and record.attributes["gap"] < 1e-4
    feeds = token_feeds(model)
    assert_same_outputs(model, out, feeds, rtol=1e-4)


def test_keep_dense_adds_the_fallback_weight():
    model = tg.matmul_model()
    out, report = rewrite_model(model, tt_config(target="all", rank=2, gap=0.0, min_flop_ratio=0.0, keep_dense=1))
    node = next(n for n in out.graph.node if n.op_type == "TTMatMul")
    assert len(node.input) == 4 and node.input[3] == "W" and node.input[2] == ""


def test_flags_and_settings():
    parser = argparse.ArgumentParser()
    add_technique_arguments(parser)
    config = config_from_args(parser.parse_args(["--tt=on", "--tt-rank=0", "--tt-gap=0.05", "--tt-maxvol-k=4",
                                                 "--tt-target=both"]))
    choice = config.choice("tt")
    assert choice.enabled and choice.target == "both" and not config.choice("kwta").enabled
    assert choice.settings.rank == 0 and choice.settings.gap == 0.05 and choice.settings.maxvol_k == 4
    assert not config_from_args(parser.parse_args([])).choice("tt").enabled
    with pytest.raises(ConfigError, match="autotune.*gap"):
        TTSettings(rank=0, gap=0.0)
    with pytest.raises(ConfigError, match="layout=balanced"):
        TTSettings(d=3)
    assert TTSettings(method="auto").method_for(576, 1536, True) == "svd-whitened"
    assert TTSettings(method="auto").method_for(4096, 11008, False) == "cross"


def test_tt_is_exclusive_and_takes_no_gate():
    with pytest.raises(ConfigError, match="TTMatMul \\(tt\\) cannot be combined with kwta"):
        compose_module.compose("mlp.0", {"kwta": KwtaSettings(), "tt": TTSettings()})



def test_layer_calibration_collects_each_layers_input():
    import onnxruntime as ort

    model = tg.llama_like()
    feeds = token_feeds(model)
    calib = layer_calibration(model, "mlp", [feeds], max_rows=7, feeds=lambda session, batch: batch)
    mlp = [r for r in rewrite_model(model, tt_config(rank=16, gap=0.0, min_flop_ratio=0.0))[1].rewritten]
    assert sorted(calib) == sorted(r.name for r in mlp)
    for record in mlp:
        assert calib[record.name].shape == (7, record.k) and calib[record.name].dtype == np.float32
    # the sampled rows are rows of the value ORT computes for that layer's input
    node = next(n for n in model.graph.node if n.name == mlp[0].name)
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.append(onnx.helper.make_empty_tensor_value_info(node.input[0]))
    full = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        [node.input[0]], feeds)[0].reshape(-1, mlp[0].k)
    for row in calib[mlp[0].name]:
        assert np.min(np.abs(full - row).max(axis=1)) == 0.0


def test_tt_and_proc_sparse_are_exclusive_weight_backends():
    from ortsparse.graph_rewrite.techniques import TECHNIQUES

    settings = TECHNIQUES["proc"].settings_type()
    with pytest.raises(ConfigError, match="layer 'mlp.0'.*one weight backend"):
        compose_module.compose("mlp.0", {"proc": settings, "tt": TTSettings()})
