"""Windows that do not fit the text or the model, and a model that is not a model: one line, exit 2,
before anything is rewritten or written (issue 23, finding 17 and the new-user items)."""
from __future__ import annotations

from pathlib import Path

import pytest

from ortsparse.cli import EXIT_USAGE, main, rewrite_onnx_main

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny"
GENAI = TINY / "llama_tiny_genai"  # context_length 128, character-level tokenizer
GPT2 = TINY / "gpt2_tiny.torchscript.onnx"  # 128 learned positions, no config saying so


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("The capital of France is Paris. " * 8, encoding="utf-8")  # 256 tokens
    return path


def one_line_error(capsys, code, *fragments):
    captured = capsys.readouterr()
    assert code == EXIT_USAGE, captured
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert "Traceback" not in captured.err
    return lines[0]


def test_more_windows_than_the_text_holds(capsys, text, tmp_path):
    one_line_error(capsys, main(["quality", str(GENAI), "--text", str(text), "--windows", "40", "--window-len", "8",
                                 "--json", str(tmp_path / "q.json")]),
                   "--windows 40 x --window-len 8 need 320 tokens", "has 256", "room for 32")
    assert not (tmp_path / "q.json").exists()


def test_a_window_longer_than_the_genai_context(capsys, text):
    one_line_error(capsys, main(["quality", str(GENAI), "--text", str(text), "--windows", "1", "--window-len", "200"]),
                   "--window-len 200 is longer than the model's context of 128")


def test_a_window_longer_than_learned_positions_is_one_line(capsys, text):
    one_line_error(capsys, main(["quality", str(GPT2), "--text", str(text), "--tokenizer", str(GENAI),
                                 "--windows", "1", "--window-len", "200"]),
                   "onnxruntime could not score windows of 200 tokens", "--window-len")


@pytest.mark.parametrize("flags, fragment", [
    (["--eval-windows", "100"], "--eval-windows 100 x --window-len 8 need 800 tokens; the held-out part"),
    (["--calib-windows", "100"], "--calib-windows 100 x --window-len 8 need 800 tokens; the calibration part"),
])
def test_calibrate_checks_both_parts_before_the_search(capsys, text, tmp_path, flags, fragment):
    out = tmp_path / "layers.json"
    one_line_error(capsys, main(["calibrate", str(GENAI), "--text", str(text), "-o", str(out), "--window-len", "8",
                                 *flags]), fragment)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["text.txt"]


def test_calibrate_window_longer_than_the_context(capsys, text, tmp_path):
    long_text = tmp_path / "long.txt"
    long_text.write_text(text.read_text() * 4, encoding="utf-8")
    one_line_error(capsys, main(["calibrate", str(GENAI), "--text", str(long_text), "-o", str(tmp_path / "l.json"),
                                 "--window-len", "200", "--calib-windows", "1", "--eval-windows", "1"]),
                   "longer than the model's context of 128")


@pytest.mark.parametrize("command", [["quality"], ["calibrate", "-o", "layers.json"], ["tune", "-o", "out"]])
def test_a_text_file_as_the_model(capsys, tmp_path, monkeypatch, text, command):
    monkeypatch.chdir(tmp_path)
    notes = tmp_path / "notes.txt"
    notes.write_text("remember the milk\n")
    name, *rest = command
    line = one_line_error(capsys, main([name, "notes.txt", "--text", str(text), *rest]),
                          "notes.txt is not an ONNX model or genai folder")
    assert "tokenizer" not in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "text.txt"]


def test_missing_paths_are_named_as_given(capsys, tmp_path):
    missing = tmp_path / "nonexistent" / "folder"
    line = one_line_error(capsys, rewrite_onnx_main([f"{missing}/", "-o", str(tmp_path / "out")]),
                          f"{missing} does not exist")
    assert "not a file" not in line
