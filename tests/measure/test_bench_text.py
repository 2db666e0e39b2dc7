"""ortsparse bench on the user's text (issue 38): --text tokenized with the model's own tokenizer, by
default Python's documentation (no model cache needed), never a corpus of another vocabulary."""
import json
from pathlib import Path

import numpy as np

from ortsparse.cli import main
from ortsparse.measure.decode import DEFAULT_TEXT

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny"
GENAI = TINY / "llama_tiny_genai"  # has its tokenizer.json
KV = TINY / "llama_tiny_kv.torchscript.onnx"  # no tokenizer beside it
LOOP = ["--runners", "og", "--contexts", "8", "--threads", "1", "--steps", "2", "--warmup", "1", "--rounds", "1"]


def _report(stem: Path) -> dict:
    return json.loads(stem.with_suffix(".json").read_text())


def test_bench_decodes_the_users_text(tmp_path):
    text = tmp_path / "mine.txt"
    text.write_text("the user's own words, repeated. " * 40)
    stem = tmp_path / "bench"
    assert main(["bench", f"a={GENAI}", f"b={GENAI}", "--text", str(text), *LOOP, "-o", str(stem)]) == 0
    payload = _report(stem)
    assert payload["text"] == f"text {text}"
    assert {row["model"] for row in payload["rows"]} == {"a", "b"}


def test_bench_defaults_to_pythons_documentation_in_the_models_vocabulary(tmp_path, monkeypatch):
    monkeypatch.setenv("ORTSPARSE_CACHE", str(tmp_path / "empty-cache"))  # no model cache, no corpus there
    stem = tmp_path / "bench"
    assert main(["bench", f"a={GENAI}", *LOOP, "-o", str(stem)]) == 0
    assert _report(stem)["text"] == DEFAULT_TEXT


def test_bench_refuses_text_and_corpus_together_and_a_missing_text(tmp_path, capsys):
    corpus = tmp_path / "ids.npy"
    np.save(corpus, np.arange(100))
    text = tmp_path / "mine.txt"
    text.write_text("words " * 50)
    assert main(["bench", f"a={GENAI}", "--text", str(text), "--corpus", str(corpus), *LOOP]) == 2
    assert "--text and --corpus" in capsys.readouterr().err
    assert main(["bench", f"a={GENAI}", "--text", str(tmp_path / "missing.txt"), *LOOP]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "missing.txt" in err[0]


def test_bench_text_needs_a_tokenizer_for_a_graph_without_one(tmp_path, capsys):
    text = tmp_path / "mine.txt"
    text.write_text("words " * 50)
    assert main(["bench", f"a={KV}", "--text", str(text), "--runners", "ort", "--contexts", "8", "--steps", "2"]) == 2
    assert "tokenizer" in capsys.readouterr().err
