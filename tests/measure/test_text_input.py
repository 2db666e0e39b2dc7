"""Text in (`--text FILE`): the tokenizer beside the model or --tokenizer, and one-line errors (exit 2)
for a missing tokenizer, a tokenizer of another model (vocabulary), an empty or non-UTF-8 text."""
from pathlib import Path

import numpy as np
import pytest

from ortsparse.cli import EXIT_USAGE, main
from ortsparse.graph_rewrite.errors import ModelFileError
from ortsparse.measure.text import find_tokenizer, text_tokens, tokenize_file

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny"
GENAI = TINY / "llama_tiny_genai"


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("The capital of France is Paris. " * 8, encoding="utf-8")
    return path


def one_line_error(capsys, argv, *fragments):
    assert main([str(a) for a in argv]) == EXIT_USAGE
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_tokenizer_beside_the_model_and_explicit(text):
    assert find_tokenizer(GENAI) == GENAI / "tokenizer.json"
    assert find_tokenizer(GENAI / "model.onnx") == GENAI / "tokenizer.json"
    assert find_tokenizer(None, GENAI) == GENAI / "tokenizer.json"
    ids = tokenize_file(text, GENAI / "tokenizer.json")
    assert ids.dtype == np.int64 and ids.size > 8
    np.testing.assert_array_equal(text_tokens(text, GENAI), ids)


def test_quality_scores_a_text(capsys, text, tmp_path):
    """The windows scored are the text's tokens (with the tokenizer's BOS first, if it adds one)."""
    import json

    from ortsparse.measure.perplexity import perplexity
    from ortsparse.measure.text import resolve_bos

    out = tmp_path / "q.json"
    assert main(["quality", str(GENAI), "--text", str(text), "--windows", "2", "--window-len", "8",
                 "--kwta-k", "1.0", "--json", str(out), "-q"]) == 0
    result = json.loads(out.read_text())["result"]
    expected = perplexity(GENAI / "model.onnx", text_tokens(text, GENAI), 2, 8, bos=resolve_bos("auto", GENAI))
    assert (result["windows"], result["window_len"], result["tokens"]) == (2, 8, expected["tokens"])
    assert result["ppl_dense"] == pytest.approx(expected["ppl"], rel=1e-9)


def test_missing_tokenizer_is_one_line(capsys, text):
    one_line_error(capsys, ["quality", TINY / "llama_tiny.torchscript.onnx", "--text", text, "--windows", "1",
                            "--window-len", "8"], "no tokenizer", "--tokenizer")


def test_tokenizer_of_another_model_is_one_line(capsys, text, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "The", "capital", "of", "France", "is", "Paris."]  # ids 1000+: beyond the tiny vocabulary
    other = Tokenizer(models.WordLevel({w: 1000 + i for i, w in enumerate(words)}, unk_token="[UNK]"))
    other.pre_tokenizer = pre_tokenizers.Whitespace()
    other.save(str(tmp_path / "tokenizer.json"))
    one_line_error(capsys, ["quality", TINY / "llama_tiny.torchscript.onnx", "--text", text, "--tokenizer",
                            tmp_path / "tokenizer.json", "--windows", "1", "--window-len", "8"],
                   "outside the model's vocabulary of 256")


@pytest.mark.parametrize("content,message", [(b"", "is empty"), (b"\xff\xfe\x00bad", "not UTF-8")])
def test_bad_text_is_one_line(capsys, tmp_path, content, message):
    path = tmp_path / "bad.txt"
    path.write_bytes(content)
    one_line_error(capsys, ["quality", GENAI, "--text", path, "--windows", "1", "--window-len", "8"], message)


def test_text_and_corpus_together_are_refused(capsys, text, tmp_path):
    np.save(tmp_path / "t.npy", np.arange(100))
    one_line_error(capsys, ["quality", GENAI, "--text", text, "--corpus", tmp_path / "t.npy"], "not both")


def test_calibrate_takes_a_text(capsys, text, tmp_path):
    out = tmp_path / "layers.json"
    code = main(["calibrate", str(GENAI), "--text", str(text), "-o", str(out), "--calib-windows", "1",
                 "--eval-windows", "1", "--window-len", "8", "--max-dppl", "1.0"])
    assert code in (0, 1), capsys.readouterr().err
    assert out.is_file()


def test_unknown_text_path_is_a_model_file_error(tmp_path):
    with pytest.raises(ModelFileError, match="does not exist"):
        tokenize_file(tmp_path / "missing.txt", GENAI / "tokenizer.json")


def test_split_held_out_halves_and_interleaved():
    from ortsparse.measure.corpus import split_held_out

    tokens = np.arange(10)
    held, calib = split_held_out(tokens, 2, "halves")
    assert held.tolist() == [0, 1, 2, 3, 4] and calib.tolist() == [5, 6, 7, 8, 9]
    held, calib = split_held_out(tokens, 2, "interleaved")
    assert held.tolist() == [0, 1, 4, 5, 8, 9] and calib.tolist() == [2, 3, 6, 7]
