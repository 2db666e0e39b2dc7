"""An approximate rewrite without --config checks itself on one generated input and says what its
uncalibrated settings cost (top-1 agreement, output error), pointing at `ortsparse tune` (issue 23)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from ortsparse.cli import EXIT_OK, rewrite_onnx_main
from ortsparse.verify import top1_agreement

GENAI = Path(__file__).resolve().parents[2] / "models" / "tiny" / "llama_tiny_genai"


def self_check_line(out: str) -> str | None:
    return next((line for line in out.splitlines() if line.startswith("self-check")), None)


def test_an_uncalibrated_rewrite_says_what_it_costs(model_file, tmp_path, capsys):
    assert rewrite_onnx_main([str(model_file("llama")), "-o", str(tmp_path / "o.onnx")]) == EXIT_OK
    out = capsys.readouterr().out
    line = self_check_line(out)
    assert line is not None, out
    agreement = float(re.search(r"top-1 agreement ([0-9.]+)", line).group(1))
    assert 0.0 <= agreement < 1.0  # k = 0.5 on every MLP layer changes some top-1 tokens of the tiny model
    assert float(re.search(r"relative L2 ([0-9.e+-]+)", line).group(1)) > 1e-3
    assert "ortsparse tune" in out


@pytest.mark.parametrize("flags", [["--kwta-k", "1"], ["--no-self-check"], ["-q"], ["--config", "CONFIG"]])
def test_no_self_check_when_exact_calibrated_quiet_or_declined(model_file, tmp_path, capsys, flags):
    config = tmp_path / "layers.json"
    config.write_text(json.dumps({"layers": [{"match": "*", "kwta": {"k_frac": 0.5}}]}))
    flags = [str(config) if flag == "CONFIG" else flag for flag in flags]
    assert rewrite_onnx_main([str(model_file("llama")), "-o", str(tmp_path / "o.onnx"), *flags]) == EXIT_OK
    assert self_check_line(capsys.readouterr().out) is None


def test_a_genai_folder_rewrite_checks_its_decoder(tmp_path, capsys):
    assert rewrite_onnx_main([str(GENAI), "-o", str(tmp_path / "out")]) == EXIT_OK
    line = self_check_line(capsys.readouterr().out)
    assert line is not None and "'logits'" in line and "top-1 agreement" in line


def test_top1_agreement():
    expected = np.array([[[0.0, 1.0, 0.0], [2.0, 0.0, 0.0]]])
    assert top1_agreement(expected, expected) == 1.0
    assert top1_agreement(expected, expected[:, ::-1, :]) == 0.0
    assert top1_agreement(expected, expected[..., :2]) is None
    assert top1_agreement(np.zeros(3), np.zeros(3)) is None
