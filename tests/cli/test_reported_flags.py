"""The flag values issue 23 reported (findings 17, 18): refused by the parser, one line naming the
flag, exit 2, before anything is read, run or written."""
from __future__ import annotations

from pathlib import Path

import pytest

from ortsparse.cli import EXIT_USAGE, main

GENAI = Path(__file__).resolve().parents[2] / "models" / "tiny" / "llama_tiny_genai"


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(" ".join(["the capital of France is Paris and the sea is blue"] * 120), encoding="utf-8")
    return path


@pytest.mark.parametrize("argv, flag", [
    (["tune", "MODEL", "--text", "TEXT", "-o", "out", "--context", "-5"], "--context"),  # finding 18
    (["tune", "MODEL", "--text", "TEXT", "-o", "out", "--threads", "0"], "--threads"),
    (["tune", "MODEL", "--text", "TEXT", "-o", "out", "--threads", "-3"], "--threads"),
    (["calibrate", "MODEL", "--text", "TEXT", "-o", "o.json", "--max-dppl", "nan"], "--max-dppl"),
    (["quality", "MODEL", "--text", "TEXT", "--window-len", "1"], "--window-len"),  # finding 17
    (["quality", "MODEL", "--text", "TEXT", "--window-len", "-5"], "--window-len"),
    (["quality", "MODEL", "--text", "TEXT", "--windows", "0"], "--windows"),
    (["calibrate", "MODEL", "--text", "TEXT", "-o", "o.json", "--calib-windows", "0"], "--calib-windows"),
    (["calibrate", "MODEL", "--text", "TEXT", "-o", "o.json", "--window-len", "0"], "--window-len"),
    (["rewrite", "MODEL", "-o", "o", "--verify", "1", "--verify-seed", "-1"], "--verify-seed"),
    (["rewrite", "MODEL", "-o", "o", "--attn=popcount", "--attn-topk", "-1"], "--attn-topk"),
])
def test_reported_flags_are_refused_before_anything_runs(tmp_path, monkeypatch, capsys, text, argv, flag):
    """On the real tiny genai model: before the fix `tune --context -5` tuned and wrote OUT (exit 0)."""
    monkeypatch.chdir(tmp_path)  # outputs would land here
    argv = [{"MODEL": str(GENAI), "TEXT": str(text)}.get(a, a) for a in argv]
    assert main(argv) == EXIT_USAGE
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"argument {flag}" in lines[0], lines
    assert not any(tmp_path.iterdir())
