"""ortsparse quality and the library under it (measure.perplexity, .embeddings, .output_error,
.corpus; ortsparse.runtime) on the tiny torch exports (random weights, synthetic tokens and
sentences); the real-model checks are marked slow."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from ortsparse import runtime
from ortsparse.cli import main
from ortsparse.graph_rewrite import KwtaSettings, RewriteConfig, TechniqueChoice
from ortsparse.measure import corpus, embeddings, output_error
from ortsparse.zoo import models
from ortsparse.commands import quality
from ortsparse.measure.perplexity import compare_lm, perplexity

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny"
LLAMA = TINY / "llama_tiny.torchscript.onnx"
LLAMA_KV = TINY / "llama_tiny_kv.torchscript.onnx"
GENAI = TINY / "llama_tiny_genai"  # the onnxruntime-genai builder's graph of llama_tiny's weights
GPT2 = TINY / "gpt2_tiny.dynamo.onnx"
BERT = TINY / "bert_tiny.torchscript.onnx"
VOCAB = 256  # every tiny export (models/tiny/manifest.json)


def rewritten(model, k_frac: float, target: str = "all"):
    config = RewriteConfig(techniques={"kwta": TechniqueChoice(KwtaSettings(k_frac=k_frac), enabled=True, target=target)})
    proto, report = quality.rewrite_in_memory(model, config)
    assert report.rewritten
    return proto


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(7).integers(0, VOCAB, size=2000).astype(np.int64)


@pytest.fixture(scope="module")
def sentences(tmp_path_factory):
    """12 padded sentences of 3..20 tokens, saved as a sentence-transformers-like npz."""
    rng = np.random.default_rng(3)
    lengths = rng.integers(3, 21, size=12)
    ids = np.zeros((12, 20), np.int64)
    mask = np.zeros((12, 20), np.int64)
    for i, n in enumerate(lengths):
        ids[i, :n] = rng.integers(1, VOCAB, size=n)
        mask[i, :n] = 1
    path = tmp_path_factory.mktemp("sentences") / "sentences.npz"
    np.savez(path, input_ids=ids, attention_mask=mask, token_type_ids=np.zeros_like(ids))
    return path


def test_windows_are_consecutive_from_the_offset():
    tokens = np.arange(100)
    windows = corpus.lm_windows(tokens, windows=3, window_len=10, offset=5)
    assert windows.tolist() == [list(range(5, 15)), list(range(15, 25)), list(range(25, 35))]
    with pytest.raises(ValueError, match="need 101 tokens"):
        corpus.lm_windows(tokens, windows=10, window_len=10, offset=1)


def test_perplexity_of_one_window_matches_numpy(tokens):
    window = tokens[:24]
    result = perplexity(LLAMA, tokens, windows=1, window_len=24)
    session = ort.InferenceSession(str(LLAMA), providers=["CPUExecutionProvider"])
    (logits,) = session.run(["logits"], {"input_ids": window[None], "attention_mask": np.ones((1, 24), np.int64),
                                         "position_ids": np.arange(24, dtype=np.int64)[None]})
    z = logits[0, :-1].astype(np.float64)
    log_probs = z - z.max(-1, keepdims=True)
    log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
    nll = -log_probs[np.arange(23), window[1:]]
    assert result["tokens"] == 23
    assert result["nll"] == pytest.approx(nll.mean(), rel=1e-9)
    assert result["ppl"] == pytest.approx(math.exp(nll.mean()), rel=1e-9)
    assert result["predictions"].tolist() == [z.argmax(-1).tolist()]


def test_dense_against_itself(tokens):
    result = compare_lm(LLAMA, LLAMA, tokens, windows=3, window_len=32)
    assert result["dppl"] == 0.0
    assert result["top1_agreement"] == 1.0 == result["agreement"]
    assert result["tokens"] == 3 * 31
    assert result["metrics"] == {}  # nothing gated, no metrics


def test_exact_rewrite_keeps_perplexity(tokens):
    result = compare_lm(LLAMA, rewritten(LLAMA, 1.0), tokens, windows=3, window_len=32)
    assert abs(result["dppl"]) < 1e-5
    assert result["top1_agreement"] == 1.0
    assert result["metrics"]["ops"]["KwtaBlockMatMul"]["keep_ratio"] == 1.0


def test_gated_rewrite_changes_perplexity_and_reports_keep_ratios(tokens):
    gated = rewritten(LLAMA, 0.3)
    result = compare_lm(LLAMA, gated, tokens, windows=3, window_len=32)
    assert result["top1_agreement"] < 1.0
    assert result["dppl"] != 0.0
    assert result["ppl_dense"] == pytest.approx(perplexity(LLAMA, tokens, 3, 32)["ppl"])
    metrics = result["metrics"]
    keep = metrics["ops"]["KwtaBlockMatMul"]["keep_ratio"]
    assert 0.3 <= keep < 0.35  # ceil(0.3 * K) / K per layer
    assert len(metrics["nodes"]) == 15  # every linear layer of the 2-layer Llama (target all)
    assert 0.3 <= metrics["weighted_keep_ratio"] < 0.35


def test_perplexity_of_a_kv_decoder_prefills_from_an_empty_past(tokens):
    """Same weights, decode graph scored with an empty past: the full export's perplexity."""
    full = perplexity(LLAMA, tokens, windows=2, window_len=24)
    kv = perplexity(LLAMA_KV, tokens, windows=2, window_len=24)
    assert kv["ppl"] == pytest.approx(full["ppl"], rel=1e-5)
    assert (kv["predictions"] == full["predictions"]).all()


def test_perplexity_refuses_short_corpora_and_foreign_tokens(tokens):
    with pytest.raises(ValueError, match="need"):
        perplexity(LLAMA_KV, tokens[:10], windows=1, window_len=16)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        perplexity(LLAMA, np.full(64, 999), windows=1, window_len=16)


def test_embedding_cosine(sentences):
    arrays = dict(np.load(sentences))
    vectors = embeddings.sentence_embeddings(BERT, sentences)
    assert vectors.shape == (12, 64)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-12)
    # sentence 0 by hand: mean over its real tokens only
    n = int(arrays["attention_mask"][0].sum())
    session = ort.InferenceSession(str(BERT), providers=["CPUExecutionProvider"])
    (hidden,) = session.run(["last_hidden_state"], {k: v[:1, :n] for k, v in arrays.items()})
    manual = hidden[0].astype(np.float64).mean(0)
    np.testing.assert_allclose(vectors[0], manual / np.linalg.norm(manual), atol=1e-5)

    same = embeddings.compare_embeddings(BERT, BERT, sentences, batch_size=5)
    assert same["sentences"] == 12
    assert same["cosine_mean"] == pytest.approx(1.0, abs=1e-12)
    assert same["cosine_min"] == pytest.approx(1.0, abs=1e-12)
    gated = embeddings.compare_embeddings(BERT, rewritten(BERT, 0.3, "both"), sentences)
    assert gated["cosine_min"] <= gated["cosine_mean"] < 1.0
    assert gated["metrics"]["ops"]["KwtaBlockMatMul"]["keep_ratio"] < 0.5


def test_feeds_for_calibration_windows_and_sentence_batches(tokens, sentences):
    session = runtime.open_session(BERT)
    batches = corpus.encoder_batches(sentences, batch_size=5)
    assert [b["input_ids"].shape[0] for b in batches] == [5, 5, 2]
    feeds = runtime.lm_feeds(session, batches[2])
    assert set(feeds) == {"input_ids", "attention_mask", "token_type_ids"} and feeds["input_ids"].shape == (2, 20)
    window = corpus.lm_windows(tokens, 2, 16)[1]
    feeds = runtime.lm_feeds(runtime.open_session(LLAMA), window)
    assert feeds["input_ids"].tolist() == [tokens[16:32].tolist()]
    assert feeds["position_ids"].tolist() == [list(range(16))]


def test_compare_outputs_uses_verify_and_the_exact_budget():
    exact = output_error.compare_outputs(GPT2, rewritten(GPT2, 1.0), runs=2)
    assert exact["budget"] == 1e-4 and exact["passed"]
    assert [o["name"] for o in exact["outputs"]] == ["logits"]
    gated = output_error.compare_outputs(GPT2, rewritten(GPT2, 0.3), runs=1, shapes="seq=5")
    assert gated["budget"] == 0.5
    assert gated["input_shapes"]["input_ids"] == [1, 5]
    assert gated["outputs"][0]["rel_l2"] > 1e-3


def test_gated_layers_exact():
    assert output_error.gated_layers_exact(LLAMA)
    assert output_error.gated_layers_exact(rewritten(LLAMA, 1.0))
    assert not output_error.gated_layers_exact(rewritten(LLAMA, 0.9))


def test_opset_domains_reads_only_the_top_level_of_a_file(tmp_path):
    import onnx

    path = tmp_path / "rewritten.onnx"
    onnx.save(rewritten(LLAMA, 0.5), path)
    assert runtime.opset_domains(path) == {o.domain for o in onnx.load(path).opset_import} == {"", "ai.ortsparse"}
    assert runtime.uses_ortsparse(path) and not runtime.uses_ortsparse(LLAMA)
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(Exception):
        runtime.opset_domains(broken)


def test_detect_kind():
    assert quality.detect_kind(LLAMA) == "lm"
    assert quality.detect_kind(LLAMA_KV) == "lm"  # a decoder: windows prefill from an empty past
    assert quality.detect_kind(BERT) == "embedding"


def test_cli_lm_writes_json(tokens, tmp_path, capsys):
    corpus = tmp_path / "tokens.npy"
    np.save(corpus, tokens)
    out = tmp_path / "q.json"
    code = main(["quality", str(LLAMA), "--corpus", str(corpus), "--windows", "2", "--window-len", "32",
                 "--kwta-k", "0.5", "--kwta-target", "both", "--json", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "dppl" in text and "top-1 agreement" in text
    data = json.loads(out.read_text())
    assert data["result"]["kind"] == "lm" and data["result"]["tokens"] == 62
    assert data["rewritten"] == "in memory"
    assert data["rewrite"]["mlp"]["rewritten"] == 6
    # a budget that cannot be met -> exit 1
    assert main(["quality", str(LLAMA), "--corpus", str(corpus), "--windows", "1", "--window-len", "16",
                 "--kwta-k", "0.3", "--kwta-target", "all", "--max-dppl", "-1", "-q"]) == 1


def test_quality_runs_on_the_genai_graph(tokens, tmp_path, capsys):
    """A genai folder is scored on its own decoder graph (GroupQueryAttention, empty past): the
    same perplexity as the full export of the same weights; a rewritten folder is measured on the
    graph it runs, and agrees with the in-memory rewrite."""
    from ortsparse.graph_rewrite.genai import rewrite_genai_folder

    assert perplexity(GENAI / "model.onnx", tokens, 2, 24)["ppl"] == pytest.approx(
        perplexity(LLAMA, tokens, 2, 24)["ppl"], rel=1e-5)
    corpus = tmp_path / "tokens.npy"
    np.save(corpus, tokens)
    flags = ["--kwta-target", "mlp", "--kwta-k", "0.5"]
    common = ["--corpus", str(corpus), "--windows", "2", "--window-len", "24"]
    assert main(["quality", str(GENAI), *common, *flags, "--json", str(tmp_path / "mem.json"), "-q"]) == 0
    in_memory = json.loads((tmp_path / "mem.json").read_text())["result"]
    assert in_memory["dppl"] != 0 and in_memory["top1_agreement"] < 1
    config = RewriteConfig(techniques={"kwta": TechniqueChoice(KwtaSettings(k_frac=0.5), enabled=True, target="mlp")})
    rewrite_genai_folder(GENAI, tmp_path / "gated", config)
    assert main(["quality", str(GENAI), "--rewritten", str(tmp_path / "gated"), *common,
                 "--json", str(tmp_path / "folder.json"), "-q"]) == 0
    folder = json.loads((tmp_path / "folder.json").read_text())["result"]
    assert folder["ppl_rewritten"] == pytest.approx(in_memory["ppl_rewritten"], rel=1e-6)
    assert folder["metrics"]["ops"]["KwtaBlockMatMul"]["keep_ratio"] == pytest.approx(0.5)
    assert main(["quality", str(tmp_path / "gated" / "missing"), *common]) == 2


def test_cli_embedding_and_generic_with_a_rewritten_file(sentences, tmp_path, capsys):
    import onnx

    out = tmp_path / "bert.kwta.onnx"
    onnx.save(rewritten(BERT, 1.0, "both"), out)
    assert main(["quality", str(BERT), "--rewritten", str(out), "--sentences", str(sentences)]) == 0
    assert "embedding cosine over 12 sentences: mean 1.000000" in capsys.readouterr().out
    assert main(["quality", str(BERT), "--rewritten", str(out), "--kind", "generic", "--runs", "1"]) == 0
    assert "verify: PASSED" in capsys.readouterr().out


def test_cli_missing_corpus_is_a_usage_error(tmp_path):
    assert main(["quality", str(LLAMA), "--corpus", str(tmp_path / "none.npy")]) == 2


# --------------------------------------------------------------------------- real models (cache)

@pytest.mark.slow
def test_smollm2_dense_perplexity_on_britannica():
    model = models.real_model_path("smollm2", "full.torchscript.onnx")
    tokens = corpus.default_corpus()
    assert model.is_file() and tokens.is_file(), "SmolLM2 cache missing (run `ortsparse models`)"
    result = perplexity(model, corpus.load_corpus_tokens(tokens), windows=8, window_len=512,
                        session_options={"intra_op_num_threads": 2})
    assert result["tokens"] == 8 * 511
    assert result["ppl"] == pytest.approx(26.14, rel=0.05)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["torchscript.onnx", "dynamo.onnx", "torchscript.ortopt.onnx"])
def test_minilm_self_cosine_and_torch_reference(variant):
    model = models.real_model_path("minilm", variant)
    sentences = corpus.default_sentences()
    assert model.is_file() and sentences.is_file(), "MiniLM cache missing (run `ortsparse models`)"
    result = embeddings.compare_embeddings(model, model, sentences)
    assert result["cosine_mean"] == pytest.approx(1.0, abs=1e-9)
    assert result["cosine_min"] == pytest.approx(1.0, abs=1e-9)
    reference = np.load(sentences).get("embeddings")  # sentence-transformers' own, when the cache kept them
    if reference is not None:
        reference = reference / np.linalg.norm(reference, axis=1, keepdims=True)
        cosine = (embeddings.sentence_embeddings(model, sentences) * reference).sum(axis=1)
        assert cosine.min() > 0.99999
