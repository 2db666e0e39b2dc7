"""One output policy for every command (graph_rewrite/output_paths.py): no output may be an input,
lie inside an input folder or contain an input; outputs appear together after every check, with
the user's umask. The regression tests name the finding of issue 23 they reproduce; the last test
enumerates every command x output flag x kind of input and asserts refusal, exit 2, nothing changed."""
from __future__ import annotations

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
    from ortsparse.harness import calibrate

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


def test_finding19_tuned_folder_gets_the_umask_and_its_reports(src, text, tmp_path, umask, capsys):
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
