"""ModelSource: a model opened once — its graph parsed once, surveyed once — and what the
measurements need of it derived from that (issue 37 item 2)."""
from pathlib import Path

import numpy as np
import onnx
import pytest

from ortsparse.graph_rewrite.errors import ModelFileError
from ortsparse.calibration import allocation
from ortsparse.measure import perplexity
from ortsparse.measure import source as source_module
from ortsparse.tuning import layer_speed

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny"
GENAI = TINY / "llama_tiny_genai"
KV = TINY / "llama_tiny_kv.torchscript.onnx"


def test_what_a_folder_and_a_file_resolve_to():
    folder = source_module.open_model(GENAI)
    assert folder.folder == GENAI and folder.decoder == GENAI / "model.onnx" and folder.runs_as == GENAI
    assert folder.context_length == 128 and folder.vocabulary == 256 and folder.tokenizer == GENAI / "tokenizer.json"
    inside = source_module.open_model(GENAI / "model.onnx")  # the decoder file of a folder: run as a file
    assert inside.folder is None and inside.runs_as == GENAI / "model.onnx" and inside.context_length == 128
    kv = source_module.open_model(KV)
    assert kv.context_length is None and kv.token_vocabulary == 256
    with pytest.raises(ModelFileError, match="no tokenizer"):
        kv.tokenizer  # noqa: B018 - asked only when a command needs it
    assert source_module.open_model(KV, GENAI).tokenizer == GENAI / "tokenizer.json"


def test_measurements_read_the_graph_once_and_survey_it_once(monkeypatch):
    source = source_module.open_model(KV)
    loads, surveys = [], []
    real_load, real_survey = onnx.load, source_module.survey
    monkeypatch.setattr(onnx, "load", lambda *a, **k: loads.append(a) or real_load(*a, **k))
    monkeypatch.setattr(source_module, "survey", lambda model: surveys.append(1) or real_survey(model))
    monkeypatch.setattr(layer_speed, "SECONDS_PER_CLASS", 0.0)
    tokens = np.random.default_rng(0).integers(0, 256, 256)
    run = perplexity.perplexity(source, tokens, 2, 64)
    assert run["windows"] == 2 and np.isfinite(run["nll"])
    both, every = allocation.gated_layers(source, "both"), allocation.gated_layers(source, "all")
    assert 0 < len(both) < len(every)  # "all" adds the head: two selections of one survey
    prepared = allocation.prepare_lm(source, tokens[:128].reshape(2, 64), tokens[:64].reshape(1, 64),
                                     log=lambda line: None)
    assert prepared.model is source.weights and [layer.name for layer in prepared.layers] == [l.name for l in both]
    assert loads == [] and surveys == [1]  # the weights are read into the parsed graph, not parsed again


def test_a_token_outside_the_embedding_is_refused_from_the_source():
    source = source_module.open_model(KV)
    with pytest.raises(ValueError, match="outside the model's vocabulary of 256"):
        perplexity.perplexity(source, np.full(256, 300), 2, 64)
