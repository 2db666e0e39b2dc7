"""One output policy for every command (graph_rewrite/output_paths.py): no output may be an input,
lie inside an input folder or contain an input; outputs appear together after every check, with
the user's umask. The regression tests name the finding of issue 23 they reproduce; the last test
enumerates every command x output flag x kind of input and asserts refusal, exit 2, nothing changed."""
from __future__ import annotations

import errno
import hashlib
import os
import random
import shutil
import stat
from pathlib import Path

import numpy as np
import pytest

import hostile_models as hm
from ortsparse.cli import EXIT_OK, EXIT_USAGE, main, rewrite_onnx_main
from ortsparse.graph_rewrite import KwtaSettings, ModelFileError, RewriteConfig, TechniqueChoice
from ortsparse.graph_rewrite.genai import rewrite_genai_folder

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny"
GENAI = TINY / "llama_tiny_genai"
FULL = TINY / "llama_tiny.torchscript.onnx"
KV = TINY / "llama_tiny_kv.torchscript.onnx"
DENSE = RewriteConfig(techniques={"kwta": TechniqueChoice(KwtaSettings(), enabled=False)})


def tree_hash(folder: Path) -> dict[str, str]:
    """Every entry below ``folder``: a hash of its bytes, or what it is (links, folders)."""
    result = {}
    for entry in sorted(folder.rglob("*")):
        key = str(entry.relative_to(folder))
        if entry.is_symlink():
            result[key] = "-> " + os.readlink(entry)
        elif entry.is_file():
            result[key] = hashlib.sha256(entry.read_bytes()).hexdigest()
        else:
            result[key] = "dir" if entry.is_dir() else "special"
    return result


def refused(capsys, code: int, *fragments: str) -> str:
    """Asserts exit 2 and one error line (no traceback) holding ``fragments``; returns the line."""
    err = capsys.readouterr().err
    assert code == EXIT_USAGE, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and ": error: " in lines[0], err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def write_text(path: Path) -> Path:
    rng = random.Random(0)
    words = "the of and a to in is was for on that by with as at from his her it an were are which".split()
    path.write_text(" ".join(rng.choice(words) for _ in range(2500)), encoding="utf-8")
    return path


@pytest.fixture
def src(tmp_path) -> Path:
    folder = tmp_path / "src"
    shutil.copytree(GENAI, folder)
    return folder


@pytest.fixture
def text(tmp_path) -> Path:
    return write_text(tmp_path / "text.txt")


@pytest.fixture
def ours(tmp_path, src) -> Path:
    """An output folder ortsparse wrote before (so a new run may replace it)."""
    rewrite_genai_folder(src, tmp_path / "out", DENSE)
    return tmp_path / "out"


# ------------------------------------------------------------------ findings of issue 23

@pytest.mark.parametrize("name", ["model.onnx.data", "genai_config.json", "tokenizer.json"])
def test_finding4_report_onto_a_file_of_the_source_folder_is_refused(name, src, tmp_path, capsys):
    before = tree_hash(tmp_path)
    code = rewrite_onnx_main([str(src), "-o", str(tmp_path / "o"), "--report", str(src / name), "-q"])
    refused(capsys, code, "inside the source folder", "only read")
    assert tree_hash(tmp_path) == before


def test_finding4_report_into_the_output_folder_is_refused(src, tmp_path, capsys):
    before = tree_hash(tmp_path)
    code = rewrite_onnx_main([str(src), "-o", str(tmp_path / "o"), "--report", str(tmp_path / "o" / "model.onnx")])
    refused(capsys, code, "inside the output folder")
    assert tree_hash(tmp_path) == before


def test_finding5_tune_report_stem_in_the_source_folder_is_refused(src, text, tmp_path, capsys):
    before = tree_hash(tmp_path)
    code = main(["tune", str(src), "--text", str(text), "-o", str(tmp_path / "o"), "--report",
                 str(src / "genai_config")])
    refused(capsys, code, "genai_config.json", "inside the source folder")
    assert tree_hash(tmp_path) == before


def test_finding6_tune_report_inside_an_existing_output_folder_is_refused(src, text, ours, tmp_path, capsys):
    before = tree_hash(tmp_path)
    code = main(["tune", str(src), "--text", str(text), "-o", str(ours), "--report", str(ours / "rep"),
                 "--max-dppl", "1.0"])
    refused(capsys, code, "inside the output folder")
    assert tree_hash(tmp_path) == before


def test_finding7_output_folder_holding_the_config_is_refused(src, ours, tmp_path, capsys):
    (ours / "layers.json").write_text('{"layers": []}')
    before = tree_hash(tmp_path)
    code = rewrite_onnx_main([str(src), "-o", str(ours), "--config", str(ours / "layers.json"), "-q"])
    refused(capsys, code, "contains the config file")
    assert tree_hash(tmp_path) == before


def test_finding7_tune_onto_its_reference_folder_is_refused(src, text, ours, tmp_path, capsys):
    before = tree_hash(tmp_path)
    code = main(["tune", str(src), "--text", str(text), "--reference", str(ours), "-o", str(ours),
                 "--max-dppl", "1.0"])
    refused(capsys, code, "the reference model")
    assert tree_hash(tmp_path) == before


def test_finding8_calibrate_into_a_genai_model_folder_is_refused(src, text, tmp_path, capsys):
    before = tree_hash(tmp_path)
    code = main(["calibrate", str(src), "--text", str(text), "-o", str(src / "model.onnx"), "--window-len", "64",
                 "--calib-windows", "1", "--eval-windows", "1"])
    refused(capsys, code, "inside the input model")
    assert tree_hash(tmp_path) == before


def test_finding8_quality_json_onto_the_weights_of_a_genai_folder_is_refused(src, tmp_path, capsys):
    before = tree_hash(tmp_path)
    code = main(["quality", str(src), "--json", str(src / "model.onnx.data"), "--kind", "generic", "--runs", "1"])
    refused(capsys, code, "inside the input model")
    assert tree_hash(tmp_path) == before


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_finding9_a_symlink_leaving_the_source_folder_is_refused(kind, src, tmp_path, capsys):
    outside = tmp_path / "private"
    outside.mkdir()
    (outside / "secret.txt").write_text("not for the model folder")
    (src / "notes").symlink_to(outside / "secret.txt" if kind == "file" else outside)
    before = tree_hash(tmp_path)
    code = rewrite_onnx_main([str(src), "-o", str(tmp_path / "o"), "-q"])
    refused(capsys, code, str(src / "notes"), "outside the folder")
    assert tree_hash(tmp_path) == before


def test_finding10_symlinks_inside_the_source_are_kept(src, tmp_path, capsys):
    (src / "extra").mkdir()
    (src / "extra" / "a.txt").write_text("inside")
    (src / "linked").symlink_to("extra")  # a symlinked sub-folder
    (src / "alias.json").symlink_to(src / "tokenizer.json")  # an absolute link to a file inside
    assert rewrite_onnx_main([str(src), "-o", str(tmp_path / "o"), "-q"]) == EXIT_OK
    out = tmp_path / "o"
    assert (out / "linked" / "a.txt").read_text() == "inside"
    assert (out / "linked").is_symlink() and (out / "linked").resolve() == (out / "extra").resolve()
    assert (out / "alias.json").resolve() == (out / "tokenizer.json").resolve()  # inside the new folder


def test_finding12_a_bad_report_leaves_no_output_folder(src, tmp_path, capsys):
    (tmp_path / "some_dir").mkdir()
    before = tree_hash(tmp_path)
    code = rewrite_onnx_main([str(src), "-o", str(tmp_path / "o"), "--report", str(tmp_path / "some_dir"), "-q"])
    refused(capsys, code, "is a directory")
    assert tree_hash(tmp_path) == before


@pytest.mark.parametrize("failure", [KeyboardInterrupt, ModelFileError])
def test_finding13_calibrate_writes_nothing_when_the_held_out_check_fails(failure, text, tmp_path, monkeypatch,
                                                                          capsys):
    from ortsparse.commands import calibrate

    def fail(*args, **kwargs):
        raise failure("the held-out check failed") if failure is ModelFileError else failure()

    monkeypatch.setattr(calibrate, "compare_lm", fail)
    before = tree_hash(tmp_path)
    code = main(["calibrate", str(FULL), "--text", str(text), "--tokenizer", str(GENAI), "-o",
                 str(tmp_path / "layers.json"), "--window-len", "64", "--calib-windows", "1", "--eval-windows", "1",
                 "--target", "mlp"])
    assert code == (130 if failure is KeyboardInterrupt else EXIT_USAGE), capsys.readouterr().err
    assert tree_hash(tmp_path) == before  # no layers.json without its report


def test_finding15_output_folder_that_is_a_dangling_symlink_is_refused(src, tmp_path, capsys):
    (tmp_path / "o").symlink_to(tmp_path / "nowhere")
    before = tree_hash(tmp_path)
    code = rewrite_onnx_main([str(src), "-o", str(tmp_path / "o"), "-q"])
    refused(capsys, code, "does not exist")
    assert tree_hash(tmp_path) == before


def test_finding15_output_folder_linked_to_another_file_system_is_written_there(src, tmp_path):
    other = Path("/dev/shm")
    if not other.is_dir() or os.stat(other).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("no second file system (/dev/shm) to link to")
    target = Path(os.path.realpath(other)) / f"ortsparse-test-{os.getpid()}-{tmp_path.name}"
    target.mkdir()
    try:
        (tmp_path / "o").symlink_to(target)
        assert rewrite_onnx_main([str(src), "-o", str(tmp_path / "o"), "-q"]) == EXIT_OK
        assert (tmp_path / "o").is_symlink() and (target / "genai_config.json").is_file()
        assert not [p for p in other.iterdir() if p.name.startswith(".ortsparse")]
    finally:
        shutil.rmtree(target, ignore_errors=True)


@pytest.fixture
def umask():
    previous = os.umask(0o022)
    yield lambda mask: os.umask(mask)
    os.umask(previous)


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_finding19_rewritten_folders_get_the_umask(mask, src, tmp_path, umask):
    umask(mask)
    assert rewrite_onnx_main([str(src), "-o", str(tmp_path / "o"), "-q"]) == EXIT_OK
    assert stat.S_IMODE(os.stat(tmp_path / "o").st_mode) == 0o777 & ~mask


def test_finding19_tuned_folder_gets_the_umask_and_its_reports(src, text, tmp_path, umask, capsys, steady_tune_speed):
    umask(0o022)
    assert main(["tune", str(src), "--text", str(text), "-o", str(tmp_path / "o"), "--max-dppl", "1.0",
                 "--windows", "1"]) == EXIT_OK
    assert stat.S_IMODE(os.stat(tmp_path / "o").st_mode) == 0o755
    assert (tmp_path / "o.tune.json").is_file() and (tmp_path / "o" / "genai_config.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ortsparse")]


def test_bench_writes_no_report_unless_asked(tmp_path, monkeypatch, capsys):
    corpus = tmp_path / "tokens.npy"
    np.save(corpus, np.random.default_rng(0).integers(0, 256, size=256))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    code = main(["bench", f"dense={KV}", "--contexts", "8", "--threads", "1", "--steps", "2", "--warmup", "1",
                 "--corpus", str(corpus), "--runners", "ort"])
    assert code == EXIT_OK
    assert list(work.iterdir()) == []
    assert "| dense" in capsys.readouterr().out  # the table is printed instead


# ------------------------------------------------------------------ the library API

def test_inputs_expand_folders_and_follow_links(src, tmp_path):
    from ortsparse.graph_rewrite.output_paths import Inputs

    outside = tmp_path / "elsewhere.txt"
    outside.write_text("x")
    (src / "link.txt").symlink_to(outside)
    inputs = Inputs().add(src, "the source folder")
    assert inputs.describe(outside)[0] == "is"  # the target of a link in the folder is read too
    assert inputs.describe(src / "new.json")[0] == "inside"
    assert inputs.describe(tmp_path / "new.json") is None
    model = hm.external_model(tmp_path / "m")
    assert "external data" in Inputs().add_model(model).describe(model.parent / "model.weights")[1]


def test_outputs_commit_together_and_discard_on_error(tmp_path):
    from ortsparse.graph_rewrite.output_paths import Inputs, OutputFiles

    with OutputFiles(Inputs()) as outputs:
        a = outputs.add(tmp_path / "new" / "a.json", "report", create_dirs=True)
        folder = outputs.add_folder(tmp_path / "folder", "output")
        outputs.write_text(a, "a")
        (outputs.staged(folder) / "f.txt").write_text("f")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # not committed: nothing, not even new/
    with OutputFiles(Inputs()) as outputs:
        a = outputs.add(tmp_path / "new" / "a.json", "report", create_dirs=True)
        folder = outputs.add_folder(tmp_path / "folder", "output")
        outputs.write_text(a, "a")
        (outputs.staged(folder) / "f.txt").write_text("f")
        outputs.commit()
    assert (tmp_path / "new" / "a.json").read_text() == "a" and (tmp_path / "folder" / "f.txt").read_text() == "f"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder", "new"]


# ------------------------------------------------------------------ every command x output flag x input kind

@pytest.fixture(scope="module")
def inputs_tree(tmp_path_factory) -> Path:
    """Every kind of input, in one folder: a model with external data, a genai folder, a reference
    model, a config, a text, a tokenizer, token ids, a sentence set."""
    root = tmp_path_factory.mktemp("policy") / "in"
    hm.external_model(root, "model.onnx", "model.weights")
    shutil.copytree(GENAI, root / "src")
    shutil.copyfile(KV, root / "ref.onnx")
    (root / "layers.json").write_text('{"layers": []}')
    write_text(root / "text.txt")
    shutil.copyfile(GENAI / "tokenizer.json", root / "tokenizer.json")
    np.save(root / "tokens.npy", np.arange(512))
    with open(root / "tokens.json", "wb") as handle:  # token ids under a name a report stem can reach
        np.save(handle, np.arange(512))
    np.savez(root / "sentences.npz", input_ids=np.ones((2, 4), np.int64), attention_mask=np.ones((2, 4), np.int64))
    return root


# command: (entry point, arguments, {output flag: kind}, {input name: files or folder it names})
FILE, FOLDER, STEM = "file", "folder", "stem"
COMMANDS = {
    "rewrite-onnx FILE": (rewrite_onnx_main, ["model.onnx", "--config", "layers.json"],
                          {"-o": FILE, "--report": FILE}),
    "rewrite-onnx DIR": (rewrite_onnx_main, ["src", "--config", "layers.json"], {"-o": FOLDER, "--report": FILE}),
    "rewrite-onnx --list-layers": (rewrite_onnx_main, ["src", "--list-layers", "--config", "layers.json"],
                                   {"--report": FILE}),
    "tune DIR": (main, ["tune", "src", "--text", "text.txt", "--tokenizer", "tokenizer.json", "--reference", "ref.onnx"],
                 {"-o": FOLDER, "--report": STEM}),
    "tune FILE": (main, ["tune", "model.onnx", "--text", "text.txt", "--tokenizer", "tokenizer.json"],
                  {"-o": FILE, "--report": STEM}),
    "calibrate --text": (main, ["calibrate", "src", "--text", "text.txt", "--tokenizer", "tokenizer.json",
                                "--reference", "ref.onnx"], {"-o": FILE, "--report": FILE}),
    "calibrate --tokens": (main, ["calibrate", "model.onnx", "--tokens", "tokens.npy"], {"-o": FILE, "--report": FILE}),
    "quality --text": (main, ["quality", "model.onnx", "--rewritten", "src", "--text", "text.txt", "--tokenizer",
                              "tokenizer.json", "--config", "layers.json"], {"--json": FILE}),
    "quality --corpus": (main, ["quality", "src", "--corpus", "tokens.npy", "--sentences", "sentences.npz"],
                         {"--json": FILE}),
    "bench": (main, ["bench", "a=model.onnx", "b=src", "--corpus", "tokens.npy", "--config", "layers.json"],
              {"-o": STEM}),
    "sweep": (main, ["sweep", "--full", "model.onnx", "--kv", "ref.onnx", "--tokens", "tokens.json"], {"-o": STEM}),
    "validate": (main, ["validate", "model.onnx", "src", "--config", "layers.json"],
                 {"--json": FILE, "--markdown": FILE}),
}
STEM_SUFFIXES = {"tune": (".json", ".md", ".png"), "bench": (".json", ".md"), "sweep": (".json", ".md", ".png")}


def _inputs_of(arguments: list[str]) -> list[str]:
    names = [a.split("=", 1)[-1] for a in arguments if not a.startswith("-")]
    return [n for n in names if n in {"model.onnx", "src", "ref.onnx", "layers.json", "text.txt", "tokenizer.json",
                                      "tokens.npy", "tokens.json", "sentences.npz"}]


def _targets(command: str, kind: str) -> list[str]:
    """Output paths (relative to the inputs' folder) that are, lie in or hold an input of ``command``."""
    arguments = COMMANDS[command][1]
    names = _inputs_of(arguments)
    files = [n for n in names if n != "src"] + (["model.weights"] if "model.onnx" in names else [])
    folders = ["src"] if "src" in names else []
    if kind == FILE:
        return files + folders + [f"{f}/genai_config.json" for f in folders] + [f"{f}/new.json" for f in folders]
    if kind == FOLDER:
        return files + folders + [f"{f}/sub" for f in folders] + ["."]
    suffixes = STEM_SUFFIXES[arguments[0] if arguments[0] in STEM_SUFFIXES else "tune"]
    return ([f[: -len(s)] for f in files for s in suffixes if f.endswith(s)]
            + [f"{f}/genai_config" for f in folders] + [f"{f}/new" for f in folders])


CASES = [(command, flag, target) for command, (_, _, flags) in COMMANDS.items() for flag, kind in flags.items()
         for target in _targets(command, kind)]


@pytest.mark.parametrize("command, flag, target", CASES)
def test_no_command_writes_over_what_it_reads(command, flag, target, inputs_tree, tmp_path, capsys):
    entry, arguments, flags = COMMANDS[command]

    def where(argument: str) -> str:
        if argument.startswith("-"):
            return argument
        name, _, path = argument.rpartition("=")
        return f"{name}={inputs_tree / path}" if name else str(inputs_tree / path)

    argv = [arguments[0] if entry is main else where(arguments[0]), *map(where, arguments[1:])]
    for other, kind in flags.items():  # the other outputs go somewhere harmless
        argv += [other, str(inputs_tree / target) if other == flag else
                 str(tmp_path / ("fresh" if kind == FOLDER else "fresh.json" if kind == FILE else "fresh"))]
    before = tree_hash(inputs_tree.parent)
    refused(capsys, entry(argv), "only read")
    assert tree_hash(inputs_tree.parent) == before
    assert not list(tmp_path.iterdir())


def test_genai_config_refuses_a_library_copy_that_is_a_folder(src, tmp_path, capsys):
    out = tmp_path / "o"
    rewrite_genai_folder(src, out, RewriteConfig(techniques={"kwta": TechniqueChoice(KwtaSettings(k_frac=0.5),
                                                                                     enabled=True, target="mlp")}))
    (out / "libortsparse_ops.so").unlink()
    (out / "libortsparse_ops.so").mkdir()
    before = tree_hash(tmp_path)
    refused(capsys, main(["genai-config", str(out)]), "libortsparse_ops.so is not a regular file")
    assert tree_hash(tmp_path) == before


def test_sweep_writes_its_report_and_plot_together(tmp_path, capsys):
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, 256, size=512))
    stem = tmp_path / "new" / "sweep"
    assert main(["sweep", "--full", str(FULL), "--kv", str(KV), "--tokens", str(tokens), "--scopes", "mlp", "--keeps",
                 "0.5", "--blocks", "1", "--windows", "1", "--window-len", "32", "--context", "8", "--steps", "2",
                 "-o", str(stem)]) == EXIT_OK
    assert sorted(p.name for p in stem.parent.iterdir()) == ["sweep.json", "sweep.md", "sweep.png"]


# ------------------------------------------------------------------ findings of issue 36

GATED = ["--kwta-target", "mlp"]  # a rewrite that uses ortsparse ops (the folder needs the library)


def tokens_file(path: Path, size: int = 600) -> Path:
    np.save(path, np.random.default_rng(0).integers(0, 256, size=size))
    return path


@pytest.mark.parametrize("kind", ["external data file", "genai folder"])
def test_36_finding6_validate_passes_models_with_external_data(kind, src, tmp_path, capsys):
    model = hm.external_model(tmp_path / "m") if kind == "external data file" else src
    report = tmp_path / "validate.json"
    code = main(["validate", str(model), "--runs", "1", "--timing-runs", "0", "--json", str(report), "-q"])
    import json

    results = json.loads(report.read_text())["models"]
    assert code == EXIT_OK and [r["status"] for r in results] == ["ok"], [(r["stage"], r["reason"]) for r in results]


def test_36_finding7_a_library_path_with_a_trailing_slash_is_not_up_to_date(src, tmp_path, capsys):
    out = tmp_path / "o"
    assert rewrite_onnx_main([str(src), "-o", str(out), *GATED, "-q"]) == EXIT_OK
    config = out / "genai_config.json"
    config.write_text(config.read_text().replace('"libortsparse_ops.so"', '"libortsparse_ops.so/"'))
    assert main(["genai-config", str(out), "--check"]) == 1
    assert "'libortsparse_ops.so/' is missing" in capsys.readouterr().out
    assert main(["genai-config", str(out)]) == EXIT_OK  # the refresh mends the entry
    assert '"libortsparse_ops.so"' in config.read_text()
    assert main(["genai-config", str(out), "--check"]) == EXIT_OK


def test_36_finding10_an_output_folder_name_too_long_is_one_line(src, text, tmp_path, capsys):
    long = tmp_path / ("x" * 300)
    before = tree_hash(tmp_path)
    refused(capsys, rewrite_onnx_main([str(src), "-o", str(long), "-q"]), "File name too long")
    refused(capsys, main(["tune", str(src), "--text", str(text), "-o", str(long)]), "File name too long")
    assert tree_hash(tmp_path) == before


def _disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_36_finding10_a_write_error_in_a_genai_folder_is_one_line_and_leaves_nothing(src, tmp_path, monkeypatch,
                                                                                   capsys):
    from ortsparse.graph_rewrite import genai

    monkeypatch.setattr(genai.ir, "save", _disk_full)  # the decoder is written while the folder is staged
    before = tree_hash(tmp_path)
    refused(capsys, rewrite_onnx_main([str(src), "-o", str(tmp_path / "o"), "-q"]), "cannot write",
            str(tmp_path / "o"), "No space left on device")
    assert tree_hash(tmp_path) == before


def test_36_finding10_tune_says_a_write_error_after_calibrating_in_one_line_exit_2(src, text, tmp_path, monkeypatch,
                                                                                   capsys, steady_tune_speed):
    from ortsparse.graph_rewrite import genai

    monkeypatch.setattr(genai.ir, "save", _disk_full)
    before = tree_hash(tmp_path)
    code = main(["tune", str(src), "--text", str(text), "-o", str(tmp_path / "o"), "--max-dppl", "1.0",
                 "--windows", "1"])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE, err  # not 1 ("nothing written: the budget")
    assert "Traceback" not in err and "ortsparse: error: cannot write" in err.strip().splitlines()[-1], err
    assert tree_hash(tmp_path) == before


def test_36_finding11_a_symlink_loop_in_the_source_is_one_line_before_calibrating(src, text, tmp_path, monkeypatch,
                                                                                  capsys):
    from ortsparse.tuning import tune

    (src / "loop1").symlink_to("loop2")
    (src / "loop2").symlink_to("loop1")
    before = tree_hash(tmp_path)
    refused(capsys, rewrite_onnx_main([str(src), "-o", str(tmp_path / "o"), "-q"]), "symlink loop")

    def calibration_started(*args, **kwargs):
        raise AssertionError("the folder's links are checked before the calibration")

    monkeypatch.setattr(tune, "plan_windows", calibration_started)
    refused(capsys, main(["tune", str(src), "--text", str(text), "-o", str(tmp_path / "o")]), "symlink loop")
    assert tree_hash(tmp_path) == before


def test_36_finding12_a_folder_a_link_points_to_is_protected_but_not_walked(src, tmp_path, monkeypatch):
    """Declaring a folder as input walks that folder only: a link to /usr (seconds), / (dies in /proc)
    or another user's folder (PermissionError) must not be walked."""
    from ortsparse.graph_rewrite import output_paths

    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "deep").mkdir(parents=True)
    (elsewhere / "deep" / "file.txt").write_text("not read by any command")
    (src / "shared").symlink_to(elsewhere)
    walked, real_walk = [], os.walk
    monkeypatch.setattr(output_paths.os, "walk", lambda top, *a, **k: walked.append(top) or real_walk(top, *a, **k))
    inputs = output_paths.Inputs().add(src, "the source folder")
    assert walked == [os.path.realpath(src)]
    assert inputs.describe(elsewhere / "new.json")[0] == "inside"  # still never written into
    assert inputs.describe(tmp_path / "new.json") is None


def test_36_finding12_an_unresolvable_link_in_an_input_folder_is_skipped(src, tmp_path, monkeypatch):
    """A link whose target cannot be resolved (here: a component we may not read, as in /proc of
    another user) does not stop the command that merely reads the folder."""
    from ortsparse.graph_rewrite import output_paths

    (src / "private").symlink_to("/nowhere/at/all")
    real_realpath = os.path.realpath

    def refusing_realpath(path, *args, **kwargs):
        if str(path).endswith("private"):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_realpath(path, *args, **kwargs)

    monkeypatch.setattr(output_paths.os.path, "realpath", refusing_realpath)
    inputs = output_paths.Inputs().add(src, "the source folder")
    assert inputs.describe(src / "tokenizer.json") == ("inside", f"the source folder {real_realpath(src)}")


DAMAGES = ["truncated-data", "corrupt-model", "text-as-model"]


@pytest.mark.parametrize("how", DAMAGES)
@pytest.mark.parametrize("command", ["bench folder", "bench file", "quality", "tune", "calibrate"])
def test_36_finding13_a_damaged_model_is_one_line_for_every_command(command, how, src, text, tmp_path, capsys):
    if command == "bench file":
        model = hm.damage(hm.external_model(tmp_path / "m").parent, how) / "model.onnx"
    else:
        model = hm.damage(src, how)
    tokens = tokens_file(tmp_path / "tokens.npy")
    argv = {"bench folder": ["bench", f"a={model}", "--corpus", str(tokens), "--contexts", "8", "--steps", "1",
                             "--warmup", "0", "--runners", "ort"],
            "bench file": ["bench", f"a={model}", "--corpus", str(tokens), "--contexts", "8", "--steps", "1",
                           "--warmup", "0", "--runners", "ort"],
            "quality": ["quality", str(model), "--corpus", str(tokens), "--runs", "1"],
            "tune": ["tune", str(model), "--text", str(text), "-o", str(tmp_path / "o"), "--windows", "1"],
            "calibrate": ["calibrate", str(model), "--text", str(text), "-o", str(tmp_path / "c.json"),
                          "--window-len", "64", "--calib-windows", "1", "--eval-windows", "1"]}[command]
    before = tree_hash(tmp_path)
    code = main(argv)
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "model.onnx" in err, err
    assert tree_hash(tmp_path) == before


@pytest.mark.parametrize("command", ["quality", "calibrate", "tune"])
def test_36_finding15_hard_linked_external_data_is_read_as_onnx_runtime_reads_it(command, src, text, tmp_path,
                                                                                capsys, steady_tune_speed):
    os.link(src / "model.onnx.data", tmp_path / "second-name.data")  # a hard link, as a dedup tool makes
    tokens = tokens_file(tmp_path / "tokens.npy", 2000)
    argv = {"quality": ["quality", str(src), "--corpus", str(tokens), "--runs", "1", "--window-len", "64",
                        "--windows", "2"],
            "calibrate": ["calibrate", str(src), "--text", str(text), "-o", str(tmp_path / "c.json"), "--window-len",
                          "64", "--calib-windows", "1", "--eval-windows", "1", "--target", "mlp"],
            "tune": ["tune", str(src), "--text", str(text), "-o", str(tmp_path / "o"), "--max-dppl", "1.0",
                     "--windows", "1"]}[command]
    assert main(argv) == EXIT_OK, capsys.readouterr().err


def test_36_finding15_load_proto_reads_hard_linked_data_like_the_original(tmp_path):
    import onnx

    from ortsparse.runtime import load_proto

    model = hm.external_model(tmp_path / "m")
    expected = onnx.load(str(model))
    os.link(model.parent / "model.weights", tmp_path / "other.weights")
    loaded = load_proto(model, load_weights=True)
    assert loaded.SerializeToString() == expected.SerializeToString()


def test_36_finding19_the_current_directory_is_never_an_output_folder(src, text, tmp_path, monkeypatch, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.chdir(empty)
    refused(capsys, rewrite_onnx_main([str(src), "-o", ".", "-q"]), "is the current directory")
    refused(capsys, main(["tune", str(src), "--text", str(text), "-o", "."]), "is the current directory")
    assert os.getcwd() == str(empty) and list(empty.iterdir()) == []


def test_36_finding20_a_file_output_ending_in_a_slash_is_refused(tmp_path, capsys):
    before = tree_hash(tmp_path)
    refused(capsys, rewrite_onnx_main([str(FULL), "-o", f"{tmp_path / 'newdir'}/", "-q"]), "names a folder")
    refused(capsys, rewrite_onnx_main([str(FULL), "-o", str(tmp_path / "m.onnx"), "--report",
                                       f"{tmp_path / 'reports'}/", "-q"]), "names a folder")
    assert tree_hash(tmp_path) == before


@pytest.mark.parametrize("stem, expected", [("reports/", "reports/bench"), (".", "bench"), ("run1", "run1")])
def test_36_finding20_a_report_stem_naming_a_folder_writes_inside_it(stem, expected, tmp_path, monkeypatch, capsys):
    tokens = tokens_file(tmp_path / "tokens.npy", 256)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert main(["bench", f"dense={KV}", "--contexts", "8", "--threads", "1", "--steps", "2", "--warmup", "1",
                 "--corpus", str(tokens), "--runners", "ort", "-o", stem]) == EXIT_OK, capsys.readouterr().err
    written = sorted(str(p.relative_to(work)) for p in work.rglob("*") if p.is_file())
    assert written == [f"{expected}.json", f"{expected}.md"]


@pytest.mark.parametrize("failure", [OSError(errno.ENOSPC, "No space left on device"), ValueError("bad value"),
                                     "onnx"])
def test_36_errors_after_the_long_part_are_one_line_exit_2_and_nothing_written(failure, text, tmp_path, monkeypatch,
                                                                                capsys):
    """The class: whatever the user's files raise late in a command (a disk that fills, a value the
    libraries refuse) is one line and exit 2 from the top level, and the staged outputs are gone."""
    import onnx

    from ortsparse.commands import calibrate

    def fail(*args, **kwargs):
        if failure == "onnx":
            raise onnx.checker.ValidationError("the held-out model is refused")
        raise failure

    monkeypatch.setattr(calibrate, "compare_lm", fail)  # after the calibration
    before = tree_hash(tmp_path)
    code = main(["calibrate", str(FULL), "--text", str(text), "--tokenizer", str(GENAI), "-o",
                 str(tmp_path / "layers.json"), "--window-len", "64", "--calib-windows", "1", "--eval-windows", "1",
                 "--target", "mlp"])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("ortsparse: error: "), err
    assert tree_hash(tmp_path) == before
