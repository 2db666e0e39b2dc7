"""`ortsparse tune`: from a model and a text to a tuned model + report, on the tiny models (random
weights: the numbers mean nothing, the flow and the refusals are what is tested)."""
import json
import random
from pathlib import Path

import numpy as np
import pytest

from ortsparse.cli import EXIT_USAGE, main
from ortsparse.harness import tune as tune_module

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny"
GENAI = TINY / "llama_tiny_genai"


@pytest.fixture
def text(tmp_path):
    rng = random.Random(0)
    words = "the of and a to in is was for on that by with as at from his her it an were are which".split()
    path = tmp_path / "text.txt"
    path.write_text(" ".join(rng.choice(words) for _ in range(2500)), encoding="utf-8")
    return path


def test_tune_a_genai_folder(tmp_path, text, capsys):
    out = tmp_path / "tuned"
    assert main(["tune", str(GENAI), "--text", str(text), "-o", str(out), "--max-dppl", "1.0"]) == 0
    assert (out / "genai_config.json").is_file() and (out / "libortsparse_ops.so").is_file()
    report = json.loads((tmp_path / "tuned.tune.json").read_text())
    assert report["written"] and report["held_out"]["dppl"] <= 1.0
    assert report["speed"]["input"]["tokens_per_s"] > 0 and report["speed"]["tuned"]["tokens_per_s"] > 0
    assert (tmp_path / "tuned.tune.md").is_file() and (tmp_path / "tuned.tune.png").stat().st_size > 0
    assert "held-out: dppl" in capsys.readouterr().out


def test_tune_an_onnx_file(tmp_path, text):
    out = tmp_path / "tuned.onnx"
    assert main(["tune", str(TINY / "llama_tiny_kv.torchscript.onnx"), "--tokenizer", str(GENAI), "--text", str(text),
                 "-o", str(out), "--max-dppl", "1.0"]) == 0
    assert out.is_file() and (tmp_path / "tuned.onnx.tune.json").is_file()
    import onnx

    gated = [n for n in onnx.load(str(out)).graph.node if n.op_type == "KwtaBlockMatMul"]
    assert gated and all({a.name: a.i for a in n.attribute}["max_gated_rows"] == tune_module.DEPLOY_MAX_GATED_ROWS
                         for n in gated)  # prompts run dense in the written model


def test_over_budget_writes_nothing_and_says_what_it_would_take(tmp_path, text, monkeypatch, capsys):
    real = tune_module.compare_lm

    def worse(*args, **kwargs):
        result = real(*args, **kwargs)
        result["dppl"] = 0.5
        return result

    monkeypatch.setattr(tune_module, "compare_lm", worse)
    out = tmp_path / "tuned"
    assert main(["tune", str(GENAI), "--text", str(text), "-o", str(out)]) == 1
    assert not out.exists() and not list(tmp_path.glob("tuned.tune.*"))
    said = capsys.readouterr().out
    assert "over the budget" in said and "--max-dppl" in said


def test_short_text_and_missing_tokenizer_are_one_line_errors(tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("the capital of France is Paris", encoding="utf-8")
    assert main(["tune", str(GENAI), "--text", str(short), "-o", str(tmp_path / "o")]) == EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tokens; tuning needs at least" in err[0]
    assert main(["tune", str(TINY / "llama_tiny_kv.torchscript.onnx"), "--text", str(short), "-o",
                 str(tmp_path / "o.onnx")]) == EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no tokenizer" in err[0]


def test_output_onto_the_input_is_refused(tmp_path, text, capsys):
    assert main(["tune", str(GENAI), "--text", str(text), "-o", str(GENAI)]) == EXIT_USAGE
    assert "source folder" in capsys.readouterr().err


def test_split_text_interleaves_disjoint_windows():
    from ortsparse.harness.tune import split_text

    tokens = np.arange(20 * 512)
    split = split_text(tokens, windows=8, window_len=512)
    assert split.windows == 8 and split.window_len == 512
    held, calib = split.held_out.reshape(-1, 512), split.calibration.reshape(-1, 512)
    assert (held[:, 0] // 512 % 2 == 0).all() and (calib[:, 0] // 512 % 2 == 1).all()  # even / odd windows
    assert not set(split.held_out) & set(split.calibration)
    long = split_text(tokens, windows=2, window_len=512, context=4096)  # pieces of the long context
    assert long.held_out[:4096].tolist() == list(range(4096))  # contiguous text for the long check
    assert not set(long.held_out) & set(long.calibration)
