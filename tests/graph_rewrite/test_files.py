"""rewrite_file: the input is never touched, the output appears whole or not at all."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import onnx
import onnx_ir as ir
import pytest

import tiny_graphs as tg
from configs import kwta
from ort_run import assert_same_outputs, kwta_nodes, token_feeds
from ortsparse.graph_rewrite import ModelFileError, rewrite_file
from ortsparse.graph_rewrite import files as files_module

EXACT = kwta("all", k_frac=1.0)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def listing(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


@pytest.fixture
def gpt2_file(tmp_path) -> Path:
    path = tmp_path / "gpt2.onnx"
    onnx.save(tg.gpt2_like(), path)
    return path


def test_rewrite_file_keeps_input_byte_identical(gpt2_file, tmp_path):
    before = digest(gpt2_file)
    out = tmp_path / "out.onnx"
    report = rewrite_file(gpt2_file, out, EXACT, progress=False)
    assert digest(gpt2_file) == before
    assert len(report.rewritten) == 9
    written = onnx.load(out)
    onnx.checker.check_model(str(out), full_check=True)
    assert len(kwta_nodes(written)) == 9
    assert listing(tmp_path) == ["gpt2.onnx", "out.onnx"]  # no staging leftovers, no data file
    original = onnx.load(gpt2_file)
    assert_same_outputs(original, written, token_feeds(original))


def test_same_path_is_refused(gpt2_file):
    before = digest(gpt2_file)
    with pytest.raises(ModelFileError, match="is the input file"):
        rewrite_file(gpt2_file, gpt2_file, EXACT, progress=False)
    link = gpt2_file.with_name("link.onnx")
    link.symlink_to(gpt2_file)
    with pytest.raises(ModelFileError, match="is the input file"):
        rewrite_file(gpt2_file, link, EXACT, progress=False)
    assert digest(gpt2_file) == before


def test_missing_input_and_bad_output_dir(tmp_path, gpt2_file):
    with pytest.raises(ModelFileError, match="does not exist"):
        rewrite_file(tmp_path / "nope.onnx", tmp_path / "out.onnx", EXACT, progress=False)
    with pytest.raises(ModelFileError, match="output directory"):
        rewrite_file(gpt2_file, tmp_path / "no" / "dir" / "out.onnx", EXACT, progress=False)
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\x00not a model")
    with pytest.raises(ModelFileError, match="cannot read"):
        rewrite_file(garbage, tmp_path / "out.onnx", EXACT, progress=False)


def test_unwritable_output_directory(tmp_path, gpt2_file, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    if os.geteuid() == 0:  # root ignores directory permissions: pretend
        monkeypatch.setattr(files_module.os, "access", lambda path, mode: False)
    else:
        locked.chmod(0o500)
    try:
        with pytest.raises(ModelFileError, match="not writable"):
            rewrite_file(gpt2_file, locked / "out.onnx", EXACT, progress=False)
    finally:
        locked.chmod(0o700)
    assert listing(locked) == []


def test_failed_save_leaves_no_partial_output(gpt2_file, tmp_path, monkeypatch):
    out = tmp_path / "out.onnx"
    out.write_bytes(b"previous output")
    real_save = ir.save

    def save_then_crash(model, path, **kwargs):
        real_save(model, path, **kwargs)
        Path(path).write_bytes(Path(path).read_bytes()[:100])  # a torn write...
        raise OSError(28, "No space left on device")  # ...then the disk fills up

    monkeypatch.setattr(files_module.ir, "save", save_then_crash)
    with pytest.raises(ModelFileError, match="No space left"):
        rewrite_file(gpt2_file, out, EXACT, progress=False)
    assert out.read_bytes() == b"previous output"
    assert listing(tmp_path) == ["gpt2.onnx", "out.onnx"]


def test_failed_check_leaves_no_output(gpt2_file, tmp_path, monkeypatch):
    def reject_the_output(path):
        if Path(path) != gpt2_file:
            raise onnx.checker.ValidationError("forced failure")

    monkeypatch.setattr(files_module, "check_output", reject_the_output)
    with pytest.raises(RuntimeError, match="a bug"):
        rewrite_file(gpt2_file, tmp_path / "out.onnx", EXACT, progress=False)
    assert listing(tmp_path) == ["gpt2.onnx"]


def test_output_is_held_to_the_check_the_input_passes(gpt2_file, tmp_path, monkeypatch):
    # An input that fails the full check (strict shape inference: contrib ops can cause it) but
    # passes the plain one is accepted on loading; its rewrite is then held to the plain check too.
    def full_check_fails(path):
        raise onnx.shape_inference.InferenceError("forced strict inference failure")

    monkeypatch.setattr(files_module, "check_output", full_check_fails)
    report = rewrite_file(gpt2_file, tmp_path / "out.onnx", EXACT, progress=False)
    assert any("fails onnx.checker's full check (forced strict" in note for note in report.notes)
    onnx.checker.check_model(str(tmp_path / "out.onnx"), full_check=False)


def test_external_data_input_round_trips(tmp_path):
    model = tg.bert_like()
    source = tmp_path / "in"
    source.mkdir()
    saved = onnx.ModelProto()
    saved.CopyFrom(model)  # onnx.save with external data rewrites the proto it is given
    onnx.save(saved, source / "bert.onnx", save_as_external_data=True, location="bert.weights", size_threshold=0)
    before = {name: digest(source / name) for name in listing(source)}
    out = tmp_path / "out" / "bert_kwta.onnx"
    out.parent.mkdir()
    report = rewrite_file(source / "bert.onnx", out, EXACT, progress=False)
    assert {name: digest(source / name) for name in listing(source)} == before
    assert listing(out.parent) == ["bert_kwta.onnx", "bert_kwta.onnx.data"]
    assert any("external data" in note for note in report.notes)
    header = onnx.load(out, load_external_data=False)
    assert any(t.data_location == onnx.TensorProto.EXTERNAL for t in header.graph.initializer)
    onnx.checker.check_model(str(out), full_check=True)
    assert_same_outputs(model, onnx.load(out), token_feeds(model))


def test_size_threshold_switches_to_external_data(tmp_path):
    model = tg.llama_like()
    path = tmp_path / "llama.onnx"
    onnx.save(model, path)
    small = rewrite_file(path, tmp_path / "inline.onnx", EXACT, progress=False)
    assert not (tmp_path / "inline.onnx.data").exists() and not small.notes
    rewrite_file(path, tmp_path / "split.onnx", EXACT, progress=False, external_data_threshold=1024)
    assert (tmp_path / "split.onnx.data").is_file()
    assert_same_outputs(model, onnx.load(tmp_path / "split.onnx"), token_feeds(model))


def test_missing_external_data_is_reported(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(tg.bert_like(), path, save_as_external_data=True, location="w.bin", size_threshold=0)
    (tmp_path / "w.bin").unlink()
    with pytest.raises(ModelFileError, match="external data that is missing"):
        rewrite_file(path, tmp_path / "out.onnx", EXACT, progress=False)
