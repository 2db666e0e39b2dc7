"""rewrite-onnx never modifies, overwrites or reads outside what the user named: outputs that alias
an input (or its external data), devices, FIFOs and symlinks are refused; external data outside
the model's folder is refused as ONNX Runtime refuses it; every input or usage error is one line
and exit 2; outputs appear together or not at all, also on SIGTERM / SIGHUP / Ctrl-C."""
from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import onnx
import pytest

import hostile_models as hm
from ortsparse.cli import EXIT_OK, EXIT_USAGE, main, rewrite_onnx_main

HERE = Path(__file__).resolve().parent


def refused(capsys, argv, *fragments, entry=rewrite_onnx_main, prog="rewrite-onnx") -> str:
    """Runs the CLI; asserts exit 2 and a one-line error (no traceback) containing ``fragments``."""
    code = entry([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def inline_model(tmp_path) -> Path:
    path = tmp_path / "model.onnx"
    onnx.save(hm.tiny_graphs.llama_like(), path)
    return path


@pytest.fixture
def external_model(tmp_path) -> Path:
    return hm.external_model(tmp_path / "in")


# ------------------------------------------------------------------ outputs that alias the inputs

INPUT, DATA, OTHER_OUTPUT = "is the input file", "is the input's external data", "is the same file as the"
ALIASES = {  # case: (extra arguments from (model, tmp_path), expected message)
    "report is the input model": (lambda m, t: ["-o", t / "out.onnx", "--report", m], INPUT),
    "output is the input's external data": (lambda m, t: ["-o", m.parent / "model.weights"], DATA),
    "report is the input's external data": (lambda m, t: ["-o", t / "out.onnx", "--report", m.parent / "model.weights"],
                                            DATA),
    "report is the output": (lambda m, t: ["-o", t / "out.onnx", "--report", t / "out.onnx"], OTHER_OUTPUT),
    "report is the output's external data": (lambda m, t: ["-o", t / "out.onnx", "--report", t / "out.onnx.data"],
                                             OTHER_OUTPUT),
    "output is a symlink to the input": (lambda m, t: ["-o", _link(t / "link.onnx", m)], INPUT),
    "report is a symlink to the external data": (
        lambda m, t: ["-o", t / "out.onnx", "--report", _link(t / "r.json", m.parent / "model.weights")], DATA),
    "output is a hard link of the input": (lambda m, t: ["-o", _hardlink(t / "hard.onnx", m)], INPUT),
    "output data would replace the input's data": (
        lambda m, t: ["-o", _rename_data(m, "out.onnx.data").parent / "out.onnx"], DATA),
}


def _link(link: Path, target: Path) -> Path:
    link.symlink_to(target)
    return link


def _hardlink(link: Path, target: Path) -> Path:
    os.link(target, link)
    return link


def _rename_data(model: Path, name: str) -> Path:
    """Moves the input's external data to ``name`` (same folder) and updates the model."""
    (model.parent / "model.weights").rename(model.parent / name)
    hm.redirect_all_external(model, name)
    return model


@pytest.mark.parametrize("case", ALIASES)
def test_outputs_aliasing_an_input_are_refused_and_nothing_changes(case, external_model, tmp_path, capsys):
    arguments, message = ALIASES[case]
    argv = arguments(external_model, tmp_path)
    before = hm.snapshot(tmp_path)
    refused(capsys, [external_model, *argv], message)
    assert hm.snapshot(tmp_path) == before


def test_report_may_not_replace_the_config_file(inline_model, tmp_path, capsys):
    config = tmp_path / "layers.json"
    config.write_text('{"layers": []}')
    before = hm.snapshot(tmp_path)
    refused(capsys, [inline_model, "-o", tmp_path / "out.onnx", "--config", config, "--report", config], "config file")
    assert hm.snapshot(tmp_path) == before


def test_list_layers_report_may_not_replace_the_input(inline_model, tmp_path, capsys):
    before = hm.snapshot(tmp_path)
    refused(capsys, [inline_model, "--list-layers", "--report", inline_model], "is the input file")
    assert hm.snapshot(tmp_path) == before


def test_model_data_and_report_appear_together(external_model, tmp_path, capsys):
    out, report = tmp_path / "out" / "m.onnx", tmp_path / "out" / "m.report.json"
    out.parent.mkdir()
    before = hm.snapshot(external_model.parent)
    assert rewrite_onnx_main([str(external_model), "-o", str(out), "--report", str(report), "-q"]) == EXIT_OK
    assert sorted(os.listdir(out.parent)) == ["m.onnx", "m.onnx.data", "m.report.json"]
    assert hm.snapshot(external_model.parent) == before
    onnx.checker.check_model(str(out), full_check=True)


def test_missing_report_folder_writes_nothing(inline_model, tmp_path, capsys):
    before = hm.snapshot(tmp_path)
    refused(capsys, [inline_model, "-o", tmp_path / "out.onnx", "--report", tmp_path / "nodir" / "r.json"],
            "report directory", "does not exist")
    assert hm.snapshot(tmp_path) == before


# ------------------------------------------------------------------ devices, FIFOs, directories

def _char_device() -> Path:
    path = Path("/dev/null")
    if not path.exists() or not stat.S_ISCHR(path.stat().st_mode):
        pytest.skip("this OS has no /dev/null character device")
    return path


def _fifo(path: Path) -> Path:
    if not hasattr(os, "mkfifo"):
        pytest.skip("this OS has no FIFOs")
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("flag", ["-o", "--report"])
def test_character_device_is_never_replaced(flag, inline_model, tmp_path, capsys):
    device = _char_device()
    before = device.stat()
    argv = [inline_model, "-o", device] if flag == "-o" else [inline_model, "-o", tmp_path / "o.onnx", flag, device]
    refused(capsys, argv, "character device")
    after = device.stat()
    assert stat.S_ISCHR(after.st_mode) and (after.st_ino, after.st_rdev) == (before.st_ino, before.st_rdev)
    assert not (tmp_path / "o.onnx").exists()


def test_symlink_to_a_device_is_refused(inline_model, tmp_path, capsys):
    device = _char_device()
    link = _link(tmp_path / "null.onnx", device)
    refused(capsys, [inline_model, "-o", link], "character device")
    assert link.is_symlink() and stat.S_ISCHR(device.stat().st_mode)


@pytest.mark.parametrize("flag", ["-o", "--report"])
def test_fifo_is_refused_without_blocking(flag, inline_model, tmp_path, capsys):
    fifo = _fifo(tmp_path / "pipe")
    argv = [inline_model, "-o", fifo] if flag == "-o" else [inline_model, "-o", tmp_path / "o.onnx", flag, fifo]
    refused(capsys, argv, "FIFO")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert not (tmp_path / "o.onnx").exists()


def test_directory_output_is_refused(inline_model, tmp_path, capsys):
    (tmp_path / "d.onnx").mkdir()
    refused(capsys, [inline_model, "-o", tmp_path / "d.onnx"], "directory")


# ------------------------------------------------------------------ reads outside the model's folder

def _outside(model: Path, tmp_path: Path, how: str) -> str:
    secret = tmp_path / "secret.bin"
    shutil.copy(model.parent / "model.weights", secret)  # valid bytes: a read would succeed
    if how == "parent":
        hm.redirect_all_external(model, "../secret.bin")
    elif how == "absolute":
        hm.redirect_all_external(model, str(secret))
    elif how == "deep":
        hm.redirect_all_external(model, "../../../../etc/passwd")
    else:  # a symlink inside the folder pointing outside it
        (model.parent / "model.weights").unlink()
        (model.parent / "model.weights").symlink_to(secret)
    return how


@pytest.mark.parametrize("cwd", ["model folder", "elsewhere"])
@pytest.mark.parametrize("how,message", [("parent", "'..' is not allowed"), ("absolute", "must be a path relative"),
                                         ("deep", "'..' is not allowed"), ("symlink", "outside the model's folder")])
def test_external_data_outside_the_model_folder_is_refused(how, message, cwd, external_model, tmp_path, capsys,
                                                           monkeypatch):
    _outside(external_model, tmp_path, how)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(external_model.parent if cwd == "model folder" else work)
    model_arg = external_model.name if cwd == "model folder" else external_model
    before = hm.snapshot(tmp_path)
    refused(capsys, [model_arg, "-o", work / "out.onnx"], message, "ONNX Runtime refuses")
    refused(capsys, [model_arg, "--list-layers"], message)
    assert hm.snapshot(tmp_path) == before


def test_symlinks_that_stay_inside_are_accepted_like_onnx_runtime_does(external_model, tmp_path):
    # onnx.checker refuses any symlinked data file; ONNX Runtime accepts a link whose target stays
    # in the model's folder, or next to the model file's own target (the Hugging Face cache).
    data = external_model.parent / "model.weights"
    data.rename(external_model.parent / "real.weights")
    data.symlink_to("real.weights")
    assert rewrite_onnx_main([str(external_model), "-o", str(tmp_path / "out.onnx"), "-q"]) == EXIT_OK
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshot"
    blobs.mkdir()
    snapshot.mkdir()
    (external_model.parent / "real.weights").rename(blobs / "model.weights")
    external_model.rename(blobs / "model.onnx")
    (snapshot / "model.onnx").symlink_to(blobs / "model.onnx")
    (snapshot / "model.weights").symlink_to(blobs / "model.weights")
    assert rewrite_onnx_main([str(snapshot / "model.onnx"), "-o", str(tmp_path / "out2.onnx"), "-q"]) == EXIT_OK
    import onnxruntime as ort

    ort.InferenceSession(str(snapshot / "model.onnx"), providers=["CPUExecutionProvider"])  # ORT agrees


@pytest.mark.parametrize("fields,message", [({"offset": 10**9}, "past the end"), ({"length": 3}, "does not match"),
                                            ({"offset": -8}, "cannot read")])
def test_bad_external_offsets_are_input_errors(fields, message, external_model, tmp_path, capsys):
    hm.set_external_fields(external_model, **fields)
    refused(capsys, [external_model, "-o", tmp_path / "out.onnx"], message)
    assert not (tmp_path / "out.onnx").exists()


def test_fifo_as_external_data_is_refused_without_blocking(external_model, tmp_path, capsys):
    data = external_model.parent / "model.weights"
    data.unlink()
    _fifo(data)
    refused(capsys, [external_model, "-o", tmp_path / "out.onnx"], "not a regular file")


# ------------------------------------------------------------------ checker, limits, unwritable places

def test_duplicate_initializer_names_are_refused(tmp_path, capsys):
    model = hm.duplicate_initializer_model(tmp_path / "dup.onnx")
    refused(capsys, [model, "-o", tmp_path / "out.onnx"], "several initializers named", "transformer.wte.weight")
    refused(capsys, [model, "--list-layers"], "several initializers named")
    assert not (tmp_path / "out.onnx").exists()


def test_contrib_ops_pass_the_input_check(tmp_path):
    model = hm.contrib_op_model(tmp_path / "contrib.onnx")
    out = tmp_path / "out.onnx"
    assert rewrite_onnx_main([str(model), "-o", str(out), "-q"]) == EXIT_OK
    ops = [(n.domain, n.op_type) for n in onnx.load(out).graph.node]
    assert ("com.microsoft", "FastGelu") in ops and ("ai.ortsparse", "KwtaBlockMatMul") in ops


def test_too_many_proc_blocks_is_an_input_error(tmp_path, capsys):
    model = hm.wide_linear_model(tmp_path / "wide.onnx", k=70_000)
    refused(capsys, [model, "-o", tmp_path / "out.onnx", "--kwta", "off", "--proc-sparse", "on", "--proc-target", "all",
                     "--proc-block", "1"], "65536", "--proc-block")
    assert not (tmp_path / "out.onnx").exists()


def test_output_in_a_pseudo_file_system_is_an_input_error(inline_model, capsys):
    if not Path("/sys/kernel").is_dir():
        pytest.skip("no sysfs here")
    refused(capsys, [inline_model, "-o", "/sys/ortsparse-test.onnx"], "/sys")
    assert not Path("/sys/ortsparse-test.onnx").exists()


# ------------------------------------------------------------------ signals during the save

SAVE_THEN_SIGNAL = textwrap.dedent("""
    import os, signal, sys, time
    import onnx_ir
    sys.path[:0] = {paths!r}
    # As in an interactive shell: a background job (CI started with `&`) inherits SIGINT ignored,
    # and the CLI rightly leaves an ignored SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    real_save = onnx_ir.save

    def save_then_signal(model, path, **kwargs):
        real_save(model, path, **kwargs)  # the staged files exist now
        os.kill(os.getpid(), signal.{signal})
        time.sleep(30)  # the handler interrupts this

    onnx_ir.save = save_then_signal
    from ortsparse.cli import rewrite_onnx_main
    sys.exit(rewrite_onnx_main(sys.argv[1:]))
""")


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGHUP", "SIGINT"])
def test_signal_during_save_leaves_nothing_behind(signame, external_model, tmp_path):
    if not hasattr(signal, signame):
        pytest.skip(f"no {signame} on this OS")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    script = tmp_path / "run.py"
    script.write_text(SAVE_THEN_SIGNAL.format(paths=[str(HERE)], signal=signame))
    result = subprocess.run([sys.executable, str(script), str(external_model), "-o", str(out_dir / "m.onnx"),
                             "--report", str(out_dir / "m.json"), "-q"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 128 + getattr(signal, signame), result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and signame in lines[0], result.stderr
    assert os.listdir(out_dir) == []  # no model, no data, no report, no .ortsparse-rewrite-* folder


# ------------------------------------------------------------------ the other commands that write files

def test_harness_outputs_refuse_inputs_devices_and_each_other(inline_model, tmp_path, capsys):
    prog = "ortsparse"
    run = dict(entry=main, prog=prog)
    refused(capsys, ["quality", inline_model, "--json", inline_model], "is the input", **run)
    refused(capsys, ["validate", inline_model, "--json", inline_model], "is the input", **run)
    refused(capsys, ["validate", inline_model, "--json", tmp_path / "r", "--markdown", tmp_path / "r"], "same file",
            **run)
    refused(capsys, ["calibrate", inline_model, "-o", inline_model], "is the input", **run)
    refused(capsys, ["calibrate", inline_model, "-o", tmp_path / "o.json", "--report", tmp_path / "o.json"],
            "same file", **run)
    fifo = _fifo(tmp_path / "bench.json")
    refused(capsys, ["bench", inline_model, "-o", tmp_path / "bench"], "FIFO", **run)
    refused(capsys, ["sweep", "--full", inline_model, "--kv", inline_model, "-o", tmp_path / "bench"], "FIFO", **run)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    if Path("/dev/null").exists():
        refused(capsys, ["validate", inline_model, "--markdown", "/dev/null"], "character device", **run)


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_config_that_is_not_a_regular_file_is_refused_without_blocking(kind, inline_model, tmp_path, capsys):
    config = _fifo(tmp_path / "layers.json") if kind == "fifo" else _char_device()
    refused(capsys, [inline_model, "-o", tmp_path / "out.onnx", "--config", config], "not a regular file")
    assert not (tmp_path / "out.onnx").exists()


@pytest.mark.parametrize("flags,message", [
    (["--kwta-k-abs", "99999999999999999999"], "does not fit in an int64"),
    (["--kwta-duty", "99999999999999999999"], "does not fit in an int64"),
    (["--proc-sparse", "on", "--proc-watermark", "99999999999999999999"], "does not fit in an int64"),
    (["--attn", "popcount", "--attn-topk", "99999999999999999999"], "does not fit in an int64"),
    (["--kwta-temp", "1e39"], "does not fit in a float32"),
    (["--verify", "1", "--verify-budget", "nan"], "finite number"),
])
def test_out_of_range_settings_are_usage_errors(flags, message, inline_model, tmp_path, capsys):
    refused(capsys, [inline_model, "-o", tmp_path / "out.onnx", *flags], message)
    assert not (tmp_path / "out.onnx").exists()


# ------------------------------------------------------------------ override entries (issue 36)

@pytest.mark.parametrize("entry, label", [({"node": "no_such_node", "kwta": "off"}, "node 'no_such_node'"),
                                          ({"match": "layer:99", "off": True}, "match 'layer:99'"),
                                          ({"match": "/model/typo/MatMul", "off": True}, "match '/model/typo/MatMul'")])
def test_an_override_entry_naming_no_layer_is_an_error(entry, label, inline_model, tmp_path, capsys):
    import json

    config = tmp_path / "layers.json"
    config.write_text(json.dumps({"layers": [{"match": "class:mlp", "kwta": {"k_frac": 0.5}}, entry]}))
    line = refused(capsys, [inline_model, "-o", tmp_path / "out.onnx", "--config", config], f"{config} entry 1",
                   label, "names no linear layer")
    assert refused(capsys, [inline_model, "--list-layers", "--config", config]) == line
    assert not (tmp_path / "out.onnx").exists()


@pytest.mark.parametrize("entry", [{"match": "*nothing_here*", "off": True}, {"match": "role:qkv", "off": True}])
def test_an_override_pattern_may_select_no_layer(entry, inline_model, tmp_path, capsys):
    """A pattern or a class / role may select nothing (one file shared by several models)."""
    import json

    config = tmp_path / "layers.json"
    config.write_text(json.dumps({"layers": [entry]}))
    assert rewrite_onnx_main([str(inline_model), "-o", str(tmp_path / "out.onnx"), "--config", str(config),
                              "-q"]) == EXIT_OK, capsys.readouterr().err
