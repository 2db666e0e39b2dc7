"""Token corpora (``bench --corpus``, ``quality --corpus``, ``calibrate --tokens``, ``sweep --tokens``)
go through one checked loader (measure.corpus.load_corpus_tokens): a file that is not a 1-D, non-empty
.npy of integer ids within the model's vocabulary is a one-line error and exit 2 before any model
runs — never a numpy or onnxruntime traceback, and never a negative id run silently (Gather wraps -1
to the last embedding row). Windows too short to score anything are refused the same way."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ortsparse.cli import main
from ortsparse.graph_rewrite.errors import ModelFileError
from ortsparse.measure.corpus import check_windows, load_corpus_tokens, vocabulary_of

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny"
LLAMA = TINY / "llama_tiny.torchscript.onnx"
LLAMA_KV = TINY / "llama_tiny_kv.torchscript.onnx"
GENAI = TINY / "llama_tiny_genai"
VOCAB = 256  # every tiny export


def _bad_corpora(folder: Path) -> dict[str, tuple[Path, str]]:
    """name -> (file, what its one-line error says)."""
    ids = np.arange(3000, dtype=np.int64) % VOCAB
    files = {}

    def save(name, array, message):
        path = folder / f"{name}.npy"
        np.save(path, array)
        files[name] = (path, message)

    (folder / "text.npy").write_text("the of and a to in is\n", encoding="utf-8")
    files["text"] = (folder / "text.npy", "is not a .npy file")
    np.savez(folder / "archive.npz", ids=ids)
    files["archive"] = (folder / "archive.npz", "is not a .npy file")
    save("floats", ids.astype(np.float32), "holds float32 values")
    save("matrix", ids.reshape(2, -1), "has shape [2, 1500]")
    save("empty", ids[:0], "is empty")
    save("negative", np.concatenate([ids[:100], [-1], ids[100:]]), "negative id -1 (at index 100)")
    save("past_vocabulary", np.concatenate([ids[:7], [VOCAB]]), f"the id {VOCAB} (at index 7), outside the model's "
                                                                 f"vocabulary of {VOCAB}")
    good = folder / "good.npy"
    np.save(good, ids)
    truncated = folder / "truncated.npy"
    truncated.write_bytes(good.read_bytes()[:300])
    files["truncated"] = (truncated, "cannot be read as token ids")
    return files


def test_the_loader_refuses_each_bad_corpus_in_one_line(tmp_path):
    for name, (path, message) in _bad_corpora(tmp_path).items():
        with pytest.raises(ModelFileError, match="token corpus") as refused:
            load_corpus_tokens(path, VOCAB)
        assert message in str(refused.value) and str(path) in str(refused.value), name
        assert "\n" not in str(refused.value)
    with pytest.raises(ModelFileError, match="not found"):
        load_corpus_tokens(tmp_path / "missing.npy")
    np.save(tmp_path / "int32.npy", np.arange(10, dtype=np.int32))
    loaded = load_corpus_tokens(tmp_path / "int32.npy", VOCAB)
    assert loaded.dtype == np.int64 and loaded.tolist() == list(range(10))


def test_the_vocabulary_is_the_models():
    assert vocabulary_of(LLAMA) == VOCAB and vocabulary_of(LLAMA_KV, GENAI / "model.onnx") == VOCAB


@pytest.mark.parametrize("command", ["quality", "calibrate", "bench", "sweep"])
def test_every_command_reading_a_corpus_refuses_it_in_one_line(command, tmp_path, capsys):
    for name, (path, message) in _bad_corpora(tmp_path).items():
        argv = {"quality": ["quality", str(LLAMA), "--corpus", str(path), "--windows", "1", "--window-len", "16"],
                "calibrate": ["calibrate", str(LLAMA), "--tokens", str(path), "-o", str(tmp_path / "c.json"),
                              "--window-len", "16", "--calib-windows", "1", "--eval-windows", "1"],
                "bench": ["bench", f"tiny={LLAMA_KV}", "--corpus", str(path), "--contexts", "8", "--steps", "2",
                          "--rounds", "1", "--threads", "1"],
                "sweep": ["sweep", "--full", str(LLAMA), "--kv", str(LLAMA_KV), "--tokens", str(path),
                          "-o", str(tmp_path / "sweep")]}[command]
        assert main(argv) == 2, name
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], (name, err)
    assert not list(tmp_path.glob("c.*json")) and not list(tmp_path.glob("sweep.*"))


@pytest.mark.parametrize("command", ["quality", "calibrate"])
def test_a_window_with_nothing_to_score_after_the_bos_is_refused(command, tmp_path, capsys):
    corpus = tmp_path / "tokens.npy"
    np.save(corpus, np.arange(3000, dtype=np.int64) % VOCAB)
    flag = "--corpus" if command == "quality" else "--tokens"
    extra = ["-o", str(tmp_path / "c.json")] if command == "calibrate" else []
    assert main([command, str(LLAMA), flag, str(corpus), "--bos", "1", "--window-len", "2", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--window-len 2" in err[0] and "BOS (id 1)" in err[0] and "3 or more" in err[0]


def test_windows_with_a_bos_need_one_text_token_fewer_each():
    check_windows(3 * 15, 3, 16, bos=1)  # [bos] + 15 text tokens a window
    with pytest.raises(ModelFileError, match="need 48 tokens"):
        check_windows(3 * 15, 3, 16)
    with pytest.raises(ModelFileError, match="--window-len 1 leaves no next-token prediction"):
        check_windows(100, 1, 1)
