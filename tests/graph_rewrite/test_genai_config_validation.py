"""`ortsparse genai-config` judges the library onnxruntime-genai will load, and hostile genai folders
(a config that is not an object, non-finite numbers, wrong types, deep nesting, NUL in a file name, a
folder where the library copy goes, a broken record) are one-line errors, exit 2, with nothing changed
(issue 23, findings 11, 14, 16)."""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from ortsparse import get_library_path
from ortsparse.cli import EXIT_USAGE, main, rewrite_onnx_main
from ortsparse.graph_rewrite import KwtaSettings, RewriteConfig, TechniqueChoice
from ortsparse.graph_rewrite.genai import LIBRARY_FILE, RECORD_FILE, library_state, rewrite_genai_folder

GENAI = Path(__file__).resolve().parents[2] / "models" / "tiny" / "llama_tiny_genai"
KWTA = RewriteConfig(techniques={"kwta": TechniqueChoice(KwtaSettings(k_frac=0.5), enabled=True, target="mlp")})


def snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(folder.rglob("*"))}


def one_line(capsys, code: int, expected: int = EXIT_USAGE) -> str:
    captured = capsys.readouterr()
    assert code == expected, captured
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    return lines[0]


@pytest.fixture(scope="module")
def rewritten(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("genai") / "out"
    rewrite_genai_folder(GENAI, out, KWTA)
    return out


@pytest.fixture()
def folder(rewritten, tmp_path) -> Path:
    copy = tmp_path / "out"
    shutil.copytree(rewritten, copy)
    return copy


def set_library(folder: Path, value) -> None:
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["decoder"]["session_options"]["custom_ops_library"] = value
    (folder / "genai_config.json").write_text(json.dumps(config))


def test_check_judges_the_library_genai_loads_another_file_in_the_folder(folder, capsys):
    assert main(["genai-config", str(folder), "--check"]) == 0
    (folder / "libold_ops.so").write_bytes(b"an older build")  # genai would load this one
    set_library(folder, "libold_ops.so")
    assert main(["genai-config", str(folder), "--check"]) == 1
    out = capsys.readouterr().out
    assert "missing or out of date" in out and "libold_ops.so differs" in out
    assert main(["genai-config", str(folder)]) == 0
    state = library_state(folder)
    assert state["configured"] == LIBRARY_FILE and state["current"]
    assert main(["genai-config", str(folder), "--check"]) == 0


@pytest.mark.parametrize("value", ["absolute", "../elsewhere/libortsparse_ops.so", "missing.so"])
def test_check_refuses_a_library_genai_cannot_load(folder, capsys, value):
    if value == "absolute":
        value = str(Path(get_library_path()).resolve())  # identical bytes, but outside the folder
    set_library(folder, value)
    assert main(["genai-config", str(folder), "--check"]) == 1
    out = capsys.readouterr().out
    assert "missing or out of date" in out
    assert main(["genai-config", str(folder)]) == 0
    assert library_state(folder)["configured"] == LIBRARY_FILE
    assert main(["genai-config", str(folder), "--check"]) == 0


def _deep(levels: int) -> str:
    return '{"model": ' + "[" * levels + "]" * levels + "}"


HOSTILE_CONFIGS = {
    "a list": "[1, 2]",
    "a string": '"model"',
    "null": "null",
    "infinite head_size": None,  # built from the real config below
    "NaN context": None,
    "session_options a list": None,
    "session_options a string": None,
    "deep nesting": _deep(100_000),
    "NUL in filename": None,
    "head_size a string": None,
    "head_size 0": None,  # runtime/genai_config.py's _positive_int: 0 is not positive
    "custom_ops_library a number": None,
}


def hostile_config(folder: Path, how: str) -> str:
    text = HOSTILE_CONFIGS[how]
    if text is not None:
        return text
    config = json.loads((folder / "genai_config.json").read_text())
    decoder = config["model"]["decoder"]
    if how == "infinite head_size":
        return json.dumps(config).replace('"head_size": 16', '"head_size": Infinity')
    if how == "NaN context":
        return json.dumps(config).replace('"context_length": 128', '"context_length": NaN')
    if how == "session_options a list":
        decoder["session_options"] = ["custom_ops_library", "x.so"]
    elif how == "session_options a string":
        decoder["session_options"] = "libortsparse_ops.so"
    elif how == "NUL in filename":
        decoder["filename"] = "model.onnx\u0000.txt"
    elif how == "head_size a string":
        decoder["head_size"] = "16"
    elif how == "head_size 0":
        decoder["head_size"] = 0
    elif how == "custom_ops_library a number":
        decoder["session_options"]["custom_ops_library"] = 7
    return json.dumps(config)


@pytest.mark.parametrize("how", sorted(HOSTILE_CONFIGS))
def test_hostile_genai_configs_are_one_line_errors(folder, tmp_path, capsys, how):
    text = hostile_config(folder, how)
    assert text != (folder / "genai_config.json").read_text()
    (folder / "genai_config.json").write_text(text)
    before = snapshot(folder)
    for argv in (["genai-config", str(folder)], ["genai-config", str(folder), "--check"],
                 ["quality", str(folder), "--windows", "1", "--window-len", "8"]):
        line = one_line(capsys, main(argv))
        assert "genai_config.json" in line, line
    line = one_line(capsys, rewrite_onnx_main([str(folder), "-o", str(tmp_path / "again")]))
    assert "genai_config.json" in line
    assert snapshot(folder) == before
    assert not (tmp_path / "again").exists()


def test_a_folder_where_the_library_copy_goes_changes_nothing(folder, capsys):
    (folder / LIBRARY_FILE).unlink()
    (folder / LIBRARY_FILE).mkdir()
    (folder / LIBRARY_FILE / "keep.txt").write_text("mine")
    before = snapshot(folder)
    line = one_line(capsys, main(["genai-config", str(folder)]))
    assert LIBRARY_FILE in line and "not a regular file" in line
    assert snapshot(folder) == before


@pytest.mark.parametrize("record", ["[1]", '"x"', "{ nope"])
def test_a_broken_record_is_refused_before_the_library_is_replaced(folder, capsys, record):
    (folder / LIBRARY_FILE).write_bytes(b"an older build")  # refresh would replace it
    (folder / RECORD_FILE).write_text(record)
    before = snapshot(folder)
    line = one_line(capsys, main(["genai-config", str(folder)]))
    assert RECORD_FILE in line
    assert snapshot(folder) == before


def test_a_missing_folder_is_named_as_given(tmp_path, capsys):
    missing = tmp_path / "nonexistent"
    line = one_line(capsys, main(["genai-config", f"{missing}/"]))
    assert f"{missing} does not exist" in line
