"""ortsparse.zoo.export_shapes and the registry's shape entries: published configurations as
random-weight onnxruntime-genai folders for speed measurements (the config table: fast, no torch;
tiny variants through the real builder: need the models extra; the real builds: slow)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ortsparse.zoo import builds, export_genai, export_shapes, models
from ortsparse.zoo.builds import ModelSpec
from ortsparse.zoo.cache import ModelNotBuiltError
from ortsparse.zoo.export_shapes import SHAPES, parameter_count


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("ORTSPARSE_CACHE", str(root))
    return root


def _models_extra():
    for module in ("torch", "transformers", "onnxruntime_genai"):
        pytest.importorskip(module)


# ------------------------------------------------------------------------------ the config table

def test_the_table_holds_three_published_configurations_between_half_a_and_three_billion():
    assert {"qwen2.5-0.5b", "llama3.2-1b", "qwen2.5-1.5b"} <= set(SHAPES)
    for name, shape in SHAPES.items():
        count = parameter_count(shape)
        assert 0.4e9 <= count <= 3.5e9, (name, count)
        assert abs(count / shape.published_parameters - 1) < 0.03, (name, count, shape.published_parameters)
        assert shape.source and shape.config["initializer_range"] == export_shapes.INIT_STD


@pytest.mark.parametrize("name, parameters", [("qwen2.5-0.5b", 494_032_768), ("llama3.2-1b", 1_235_814_400),
                                              ("qwen2.5-1.5b", 1_543_714_304), ("gemma3-1b", 999_885_952)])
def test_parameter_counts_are_the_released_models_totals(name, parameters):
    """Totals of the released checkpoints (tied output matrices counted once)."""
    assert parameter_count(SHAPES[name]) == parameters


def test_parameter_count_is_what_transformers_builds():
    """The count from the sizes equals the parameters of the transformers model of each architecture
    (tiny sizes, so no weights of real size are made)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    for name, shape in SHAPES.items():
        small = export_shapes.tiny(shape)
        config = getattr(transformers, small.config_class)(**small.config)
        with torch.device("meta"):
            model = getattr(transformers, small.architecture)(config)
        assert parameter_count(small) == sum(p.numel() for p in model.parameters()), name


def test_the_byte_tokenizer_covers_the_vocabulary_and_keeps_the_special_ids(tmp_path):
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    config = {**export_shapes.tiny(SHAPES["gemma3-1b"]).config, "bos_token_id": 2, "eos_token_id": [1, 7], "pad_token_id": 0}
    export_shapes.save_byte_tokenizer(tmp_path, config)
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == config["vocab_size"]
    vocab = tokenizer.get_vocab()
    assert (vocab["<|bos|>"], vocab["<|eos|>"], vocab["<|eos_1|>"], vocab["<|pad|>"]) == (2, 1, 7, 0)
    assert sorted(vocab.values()) == list(range(config["vocab_size"]))  # every id has one token
    text = "Grüße, 世界!\n"
    ids = tokenizer.encode(text).ids
    assert len(ids) == len(text.encode()) and max(ids) < 300 and tokenizer.decode(ids) == text
    assert tokenizer.decode([config["vocab_size"] - 1]) == f"<unused_{config['vocab_size'] - 1}>"
    saved = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert (saved["bos_token"], saved["eos_token"], saved["pad_token"]) == ("<|bos|>", "<|eos|>", "<|pad|>")


# ------------------------------------------------------------------------------ the registry

def test_the_registry_has_an_on_demand_entry_per_shape_and_a_group():
    for name in SHAPES:
        spec = models.MODELS[name]
        assert spec.on_demand and "SPEED ONLY" in spec.description and "random weights" in spec.description
        for precision in ("int8", "int4"):
            folder = f"models/shapes/{name}/genai-{precision}"
            assert spec.files[f"genai-{precision}"] == f"{folder}/genai_config.json"
            assert {Path(p).name for p in spec.files.values() if Path(p).parent.as_posix() == folder} == \
                set(export_genai.GENAI_FILES)
        assert not any(variant.startswith(("hf", "genai-fp32")) for variant in spec.files)  # genai folders only
    group = models.MODELS["shapes"]
    assert group.on_demand and set(group.requires) == set(SHAPES) and not group.files
    assert not any(s.on_demand for n, s in models.MODELS.items() if n not in SHAPES and n != "shapes")


def test_a_bare_build_leaves_the_on_demand_entries(cache_root):
    calls = []

    def builder(name):
        def write(ctx):
            calls.append(name)
            for variant in ctx.spec.files:
                ctx.atomic(ctx.path(variant), lambda tmp: tmp.write_bytes(b"x"))
            return {}
        return write

    registry = {"real": ModelSpec("r", "models/real/manifest.json", {"a": "models/real/a.onnx"}, builder("real")),
                "shape": ModelSpec("s", "models/shape/manifest.json", {"a": "models/shape/a.onnx"}, builder("shape"),
                                   on_demand=True)}
    models.ensure_models(log=lambda _: None, registry=registry)
    assert calls == ["real"] and models.manifest("shape", registry=registry) is None
    models.ensure_models(["shape"], log=lambda _: None, registry=registry)
    assert calls == ["real", "shape"]


def test_cli_models_bare_run_builds_no_shape_model(cache_root, monkeypatch, capsys):
    from ortsparse.cli import main

    built = []
    monkeypatch.setattr(builds, "build_entry", lambda name, registry, log: built.append(name) or {
        "build_seconds": 0, "files": {}, "failed": {}})
    monkeypatch.setattr(builds, "staleness", lambda name, registry: "not built")
    assert main(["models"]) == 0
    assert built and not set(built) & (set(SHAPES) | {"shapes"})
    assert "gemma3" in built
    assert main(["models", "--list"]) == 0
    out = capsys.readouterr().out
    assert all(f"\n{name}: " in out for name in SHAPES) and "SPEED ONLY" in out


def test_model_path_of_an_unbuilt_shape_says_how_to_build_it(cache_root):
    with pytest.raises(ModelNotBuiltError, match=r"ortsparse models qwen2\.5-0\.5b"):
        models.model_path("qwen2.5-0.5b", "genai-int4")


# ------------------------------------------------------------------------------ tiny builds (real builder)

def test_a_tiny_shape_entry_builds_int8_and_int4_folders_with_a_manifest(cache_root, monkeypatch):
    """The registry's build of a shape entry, on a tiny variant of Qwen2.5-0.5B (same code, tiny sizes,
    the real builder): both folders decode through the Generator, the manifest records every file
    and says the weights are random."""
    _models_extra()
    import onnx

    monkeypatch.setitem(SHAPES, "qwen2.5-0.5b", export_shapes.tiny(SHAPES["qwen2.5-0.5b"]))
    models.ensure_models(["qwen2.5-0.5b"], log=lambda _: None)
    data = models.manifest("qwen2.5-0.5b")
    assert data["weights"] == {"random": True, "seed": 0, "std": 0.02, "use": "speed only"}
    assert set(data["files"]) == set(models.MODELS["qwen2.5-0.5b"].files)
    assert all(len(record["sha256"]) == 64 for record in data["files"].values())
    for precision in ("int8", "int4"):
        folder = models.model_path("qwen2.5-0.5b", f"genai-{precision}").parent
        check = data["checks"][f"genai-{precision}"]
        assert check["builder_options"] == f"-p {precision} -e cpu --extra_options accuracy_level=4"
        assert len(check["generator"]["tokens"]) == export_shapes.CHECK_TOKENS
        nodes = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph.node
        assert sum(n.op_type == "MatMulNBits" for n in nodes) >= 2 * 4  # per layer: qkv, o, gate/up, down
        assert sum(n.op_type == "GroupQueryAttention" for n in nodes) == 2
    assert data["shape"]["parameters"] == parameter_count(SHAPES["qwen2.5-0.5b"])
    assert not list((cache_root / "models" / "shapes" / "qwen2.5-0.5b").glob(".*"))  # no temporary left
    assert models.staleness("qwen2.5-0.5b") is None


@pytest.mark.parametrize("name", ["llama3.2-1b", "gemma3-1b"])
def test_tiny_llama3_and_gemma3_shapes_build(tmp_path, name):
    """Llama-3.2's llama3 rope scaling and Gemma-3's per-layer-type rope settings (the flattening
    builder path, at int4 with the quantized options) go through the builder; the Generator's check
    runs with a sliding window (64) longer than its prompt and steps (the Generator's buffers must hold
    the window)."""
    _models_extra()
    shape = export_shapes.tiny(SHAPES[name])
    info = export_shapes.build(shape, {"int4": tmp_path / "int4"}, tmp_path / "tmp", lambda _: None)
    assert len(info["checks"]["genai-int4"]["generator"]["tokens"]) == export_shapes.CHECK_TOKENS
    config = json.loads((tmp_path / "int4" / "genai_config.json").read_text())
    assert config["model"]["vocab_size"] == shape.config["vocab_size"]
    assert config["model"]["decoder"]["num_hidden_layers"] == 2


# ------------------------------------------------------------------------------ the real builds (slow)

@pytest.mark.slow
@pytest.mark.parametrize("name", list(SHAPES))
def test_real_shape_folders_decode(name):
    """Every shape model that is built decodes through the Generator at its published sizes;
    Qwen2.5-0.5B must be built (the others are built on demand)."""
    try:
        folders = {p: models.model_path(name, f"genai-{p}").parent for p in export_shapes.PRECISIONS}
    except ModelNotBuiltError as error:
        if name == "qwen2.5-0.5b":
            pytest.fail(str(error))
        pytest.skip(f"{name} is built on demand: {error}")
    shape = SHAPES[name]
    for folder in folders.values():
        config = json.loads((folder / "genai_config.json").read_text())["model"]
        assert config["vocab_size"] == shape.config["vocab_size"]
        assert config["decoder"]["num_hidden_layers"] == shape.config["num_hidden_layers"]
        assert config["decoder"]["num_key_value_heads"] == shape.config["num_key_value_heads"]
        assert len(export_shapes.check_folder(folder, shape.config["vocab_size"])["tokens"]) == export_shapes.CHECK_TOKENS
