"""rewrite-onnx / ortsparse rewrite: exit codes, printed summary, flags."""
from __future__ import annotations

import hashlib
import json

import onnx
import pytest

from ortsparse.cli import EXIT_OK, EXIT_USAGE, EXIT_VERIFY_FAILED, main, rewrite_onnx_main


def kwta_count(path) -> int:
    return sum(1 for n in onnx.load(path).graph.node if n.op_type == "KwtaBlockMatMul")


def test_rewrite_prints_summary_and_writes_output(model_file, tmp_path, capsys):
    source = model_file("llama")
    before = hashlib.sha256(source.read_bytes()).hexdigest()
    out = tmp_path / "out.onnx"
    assert rewrite_onnx_main([str(source), "-o", str(out)]) == EXIT_OK
    text = capsys.readouterr().out
    assert f"wrote {out}" in text
    assert "15 linear layers, 6 rewritten (6 -> KwtaBlockMatMul)" in text
    assert "class attn not in --kwta-target=mlp" in text
    assert kwta_count(out) == 6
    assert hashlib.sha256(source.read_bytes()).hexdigest() == before


def test_ortsparse_rewrite_subcommand_is_the_same(model_file, tmp_path, capsys):
    source = model_file("gpt2")
    args = [str(source), "--kwta-target", "both", "--kwta-k", "0.8"]
    assert main(["rewrite", *args, "-o", str(tmp_path / "a.onnx")]) == EXIT_OK
    assert rewrite_onnx_main([*args, "-o", str(tmp_path / "b.onnx")]) == EXIT_OK
    assert onnx.load(tmp_path / "a.onnx") == onnx.load(tmp_path / "b.onnx")
    assert kwta_count(tmp_path / "a.onnx") == 8


def test_kwta_flags_reach_the_attributes(model_file, tmp_path):
    out = tmp_path / "out.onnx"
    assert rewrite_onnx_main([str(model_file("bert")), "-o", str(out), "--kwta-target", "down", "--kwta-k", "0.7",
                              "--kwta-k-abs", "8", "--kwta-temp", "0.5", "--kwta-duty", "2", "--kwta-duty-mode",
                              "hold", "--kwta-score", "l2_weighted", "--kwta-threshold", "0.01", "--kwta-renorm",
                              "1", "--kwta-block", "4", "--kwta-max-gated-rows", "16", "-q"]) == EXIT_OK
    nodes = [n for n in onnx.load(out).graph.node if n.op_type == "KwtaBlockMatMul"]
    assert len(nodes) == 2
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in nodes[0].attribute}
    assert attributes == pytest.approx({"k_frac": 0.7, "k_abs": 8, "temp": 0.5, "duty": 2, "duty_mode": b"hold",
                                        "score": b"l2_weighted", "threshold": 0.01, "renorm": 1, "block": 4,
                                        "max_gated_rows": 16})


def test_config_file_overrides_per_layer(model_file, tmp_path, capsys):
    config = tmp_path / "layers.json"
    config.write_text(json.dumps({"layers": [{"match": "*down_proj*", "kwta": "off"},
                                             {"match": "class:head", "kwta": {"k_frac": 0.9}}]}))
    out = tmp_path / "out.onnx"
    assert rewrite_onnx_main([str(model_file("llama")), "-o", str(out), "--config", str(config)]) == EXIT_OK
    assert kwta_count(out) == 5  # 4 gate/up + the head
    assert "off by" in capsys.readouterr().out


def test_no_matching_layer_is_not_an_error(model_file, tmp_path, capsys):
    out = tmp_path / "out.onnx"
    assert rewrite_onnx_main([str(model_file("gpt2")), "-o", str(out), "--kwta", "off"]) == EXIT_OK
    assert "no layer matched the selection" in capsys.readouterr().out
    assert kwta_count(out) == 0


def test_list_layers_and_rules(model_file, tmp_path, capsys):
    assert rewrite_onnx_main([str(model_file("bert")), "--list-layers"]) == EXIT_OK
    text = capsys.readouterr().out
    assert "/encoder.layer.0.output.dense/MatMul" in text and "down" in text and "to rewrite" in text
    assert list(tmp_path.iterdir()) == [tmp_path / "bert.onnx"]
    assert rewrite_onnx_main(["--list-rules"]) == EXIT_OK
    text = capsys.readouterr().out
    assert "MatMul(X, Transpose(E)) -> <op>(X, E^T)" in text and "gemm" in text


def test_ortsparse_without_command_is_a_usage_error(capsys):
    assert main([]) == EXIT_USAGE
    assert "COMMAND" in capsys.readouterr().err


def test_version(capsys):
    assert main(["--version"]) == EXIT_OK
    assert rewrite_onnx_main(["--version"]) == EXIT_OK
    assert capsys.readouterr().out.startswith("ortsparse ")


def test_quiet_prints_nothing(model_file, tmp_path, capsys):
    assert rewrite_onnx_main([str(model_file("gpt2")), "-o", str(tmp_path / "o.onnx"), "-q"]) == EXIT_OK
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_report_json(model_file, tmp_path):
    report = tmp_path / "report.json"
    assert rewrite_onnx_main([str(model_file("gpt2")), "-o", str(tmp_path / "o.onnx"), "--report", str(report),
                              "-q"]) == EXIT_OK
    data = json.loads(report.read_text())
    assert len(data["layers"]) == 9 and data["counts"]["mlp"]["rewritten"] == 4


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("make_args, message", [
    (lambda src, tmp: [], "IN.onnx is required"),
    (lambda src, tmp: [str(src)], "-o/--output"),
    (lambda src, tmp: [str(src), "-o", str(src)], "is the input file"),
    (lambda src, tmp: [str(tmp / "missing.onnx"), "-o", str(tmp / "o.onnx")], "does not exist"),
    (lambda src, tmp: [str(src), "-o", str(tmp / "nodir" / "o.onnx")], "output directory"),
    (lambda src, tmp: [str(_write(tmp / "t.onnx", src.read_bytes()[:len(src.read_bytes()) // 2])), "-o",
                       str(tmp / "o.onnx")], "cannot read"),
    (lambda src, tmp: [str(_write(tmp / "g.onnx", b"\x00\xff" * 999)), "-o", str(tmp / "o.onnx")], "cannot read"),
    (lambda src, tmp: [str(_write(tmp / "e.onnx", b"")), "-o", str(tmp / "o.onnx")], "is empty"),
    (lambda src, tmp: [str(src), "-o", str(tmp / "o.onnx"), "--kwta-k", "1.5"], "argument --kwta-k: 1.5 is not a finite number in (0, 1]"),
    (lambda src, tmp: [str(src), "-o", str(tmp / "o.onnx"), "--kwta-target", "ffn"], "invalid choice"),
    (lambda src, tmp: [str(src), "-o", str(tmp / "o.onnx"), "--config", str(tmp / "none.json")], "cannot read"),
    (lambda src, tmp: [str(src), "-o", str(tmp / "o.onnx"), "--verify", "1", "--verify-shape", "seq"],
     "bad --verify-shape"),
])
def test_usage_and_input_errors_exit_2(model_file, tmp_path, capsys, make_args, message):
    source = model_file("gpt2")
    before = source.read_bytes()
    assert rewrite_onnx_main(make_args(source, tmp_path)) == EXIT_USAGE
    assert message in capsys.readouterr().err
    assert source.read_bytes() == before
    assert not (tmp_path / "o.onnx").exists()  # nothing half-written


def test_verify_passes_tight_budget_at_k1(model_file, tmp_path, capsys):
    out = tmp_path / "o.onnx"
    code = rewrite_onnx_main([str(model_file("bert")), "-o", str(out), "--kwta-k", "1", "--kwta-target", "all",
                              "--verify", "2", "--verify-shape", "sequence=6"])
    text = capsys.readouterr().out
    assert code == EXIT_OK, text
    assert "budget relative L2 <= 0.0001 (tight" in text
    assert "input_ids [1, 6]" in text and "verify: PASSED" in text


def test_verify_fails_over_budget_at_k03(model_file, tmp_path, capsys):
    out = tmp_path / "o.onnx"
    code = rewrite_onnx_main([str(model_file("llama")), "-o", str(out), "--kwta-k", "0.3", "--verify", "1",
                              "--verify-budget", "1e-6"])
    captured = capsys.readouterr()
    assert code == EXIT_VERIFY_FAILED
    assert "budget relative L2 <= 1e-06" in captured.out and "OVER BUDGET" in captured.out
    assert "verify failed" in captured.err and out.is_file()


def test_verify_default_budget_is_stated(model_file, tmp_path, capsys):
    code = rewrite_onnx_main([str(model_file("llama")), "-o", str(tmp_path / "o.onnx"), "--kwta-k", "0.9",
                              "--verify", "1"])
    assert "budget relative L2 <= 0.5" in capsys.readouterr().out
    assert code == EXIT_OK
