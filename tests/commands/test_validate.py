"""ortsparse validate (ortsparse.commands.validate): the fast zoo passes, failures are reported with a
stage and a reason and make the exit code 1. No timing is asserted."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from ortsparse.cli import main
from ortsparse.graph_rewrite import KwtaSettings, RewriteConfig, TechniqueChoice
from ortsparse.commands import validate

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny"
LLAMA = TINY / "llama_tiny.torchscript.onnx"


def test_fast_zoo_passes_and_lists_every_model(tmp_path, capsys):
    entries = validate.zoo_entries(validate.ZOOS["fast"])
    assert len([e for e in entries if e.group == "tiny"]) == len(list(TINY.glob("*.onnx"))) > 0
    assert {e.name for e in entries if e.group == "generated"} >= {"generated/gpt2_like", "generated/bert_like"}
    out_json, out_md = tmp_path / "zoo.json", tmp_path / "zoo.md"
    code = main(["validate", "--fast", "--timing-runs", "1", "--runs", "1", "--json", str(out_json),
                 "--markdown", str(out_md)])
    assert code == 0
    printed = capsys.readouterr().out
    table = out_md.read_text()
    for entry in entries:
        assert f"| {entry.name} | ok |" in table
        assert entry.name in printed
    data = json.loads(out_json.read_text())
    assert data["failed"] == 0 and data["passed"] == len(entries)
    llama = next(m for m in data["models"] if m["name"] == "tiny/llama_tiny.torchscript")
    assert llama["counts"]["mlp"] == {"layers": 6, "rewritten": 6, "skipped": 0}
    assert llama["counts"]["attn"]["rewritten"] == 0
    assert llama["budget"] == 0.5 and 0 < llama["worst_rel_l2"] <= 0.5
    assert llama["speed_ratio"] > 0 and llama["dense_ms"] > 0
    assert data["config"]["kwta"]["k_frac"] == 0.5


def test_exact_rewrite_uses_the_exact_budget():
    entry = validate.ZooEntry("gpt2", "path", path=TINY / "gpt2_tiny.torchscript.onnx")
    result = validate.validate_model(entry, RewriteConfig(techniques={"kwta": TechniqueChoice(KwtaSettings(k_frac=1.0), enabled=True, target="all")}),
                                runs=1, timing_runs=1)
    assert result.ok, result.reason
    assert result.exact and result.budget == 1e-4
    assert result.rewritten_layers == result.linear_layers == 9
    assert result.worst_rel_l2 < 1e-5


def test_broken_model_fails_with_a_reason(tmp_path, capsys):
    folder = tmp_path / "zoo"
    folder.mkdir()
    shutil.copy(LLAMA, folder / "good.onnx")
    data = LLAMA.read_bytes()
    (folder / "truncated.onnx").write_bytes(data[: len(data) // 3])
    out_json = tmp_path / "r.json"
    assert main(["validate", str(folder), "--timing-runs", "0", "--json", str(out_json)]) == 1
    captured = capsys.readouterr()
    assert "1 of 2 model(s) failed" in captured.err
    models = {Path(m["name"]).name: m for m in json.loads(out_json.read_text())["models"]}
    assert models["good.onnx"]["ok"] and models["good.onnx"]["speed_ratio"] is None
    bad = models["truncated.onnx"]
    assert not bad["ok"] and bad["stage"] == "load"
    assert "cannot read" in bad["reason"]
    assert "| **FAIL** |" in captured.out and "load: " in captured.out


def test_missing_file_and_unloadable_model_fail(tmp_path):
    graph = helper.make_graph([helper.make_node("Mystery", ["x"], ["y"], domain="test.domain")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    path = tmp_path / "mystery.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                      helper.make_opsetid("test.domain", 1)]), path)
    results = validate.validate(validate.path_entries([path, tmp_path / "absent.onnx"]), timing_runs=0)
    assert [(r.ok, r.stage) for r in results] == [(False, "ort-load"), (False, "load")]
    assert "not a registered function/op" in results[0].reason
    assert "does not exist" in results[1].reason


def test_rewritten_model_that_onnxruntime_cannot_load(monkeypatch, tmp_path):
    monkeypatch.setenv("ORTSPARSE_LIBRARY", str(tmp_path / "missing.so"))
    result = validate.validate_model(validate.ZooEntry("llama", "path", path=LLAMA), timing_runs=0)
    assert not result.ok and result.stage == "ort-load"
    assert "rewritten" in result.reason and "not found" in result.reason


def test_over_budget_is_a_failure():
    result = validate.validate_model(validate.ZooEntry("llama", "path", path=LLAMA),
                                RewriteConfig(techniques={"kwta": TechniqueChoice(KwtaSettings(k_frac=0.1), enabled=True, target="all")}), budget=1e-3,
                                runs=1, timing_runs=0)
    assert not result.ok and result.stage == "budget"
    assert "> budget 0.001 (approximate rewrite)" in result.reason


def test_builtin_graphs_are_valid_and_classified():
    for decoder, tail in ((True, "head"), (False, "other")):
        model = validate.builtin_transformer(decoder=decoder)
        onnx.checker.check_model(model, full_check=True)
        entry = validate.ZooEntry("builtin", "generated", build=validate._writer("builtin", lambda m=model: m))
        result = validate.validate_model(entry, RewriteConfig(techniques={"kwta": TechniqueChoice(KwtaSettings(k_frac=0.9), enabled=True, target="all")}),
                                    runs=1, timing_runs=0)
        assert result.ok, result.reason
        assert result.counts == {"mlp": {"layers": 2, "rewritten": 2, "skipped": 0},
                                 "attn": {"layers": 4, "rewritten": 4, "skipped": 0},
                                 tail: {"layers": 1, "rewritten": 1, "skipped": 0}}


def test_onnx_wheel_cnn_with_materialized_weights():
    entries = {e.name: e for e in validate.onnx_light_entries()}  # the onnx wheel ships these test models
    assert "onnx-light/densenet121" not in entries  # no Gemm/MatMul
    result = validate.validate_model(entries["onnx-light/shufflenet"], RewriteConfig(techniques={"kwta": TechniqueChoice(KwtaSettings(), enabled=True, target="all")}), runs=1,
                                timing_runs=0)
    assert result.ok, result.reason
    assert result.counts == {"other": {"layers": 1, "rewritten": 1, "skipped": 0}}
    assert 0 < result.worst_rel_l2 <= 0.5


def test_list_prints_the_zoo(capsys):
    assert main(["validate", "--zoo", "tiny", "--list"]) == 0
    assert "tiny/llama_tiny_kv.dynamo" in capsys.readouterr().out


@pytest.mark.slow
def test_real_models_validate():
    entries = validate.real_entries()
    assert len(entries) == len(validate.REAL_MODELS), "real models missing from the cache (run `ortsparse models`)"
    results = validate.validate(entries, RewriteConfig(techniques={"kwta": TechniqueChoice(KwtaSettings(k_frac=1.0), enabled=True, target="all")}), runs=1,
                           timing_runs=1)
    assert all(r.ok for r in results), [(r.name, r.stage, r.reason) for r in results if not r.ok]
