"""The real decode loop (ortsparse.measure.decode) and ortsparse.runtime's KV decoders on the tiny
Llama (KV export, full export, and the genai builder's graph of the same weights): the cache grows
every step, the continuation is teacher-forced, models advance round-robin, agreement is computed.
No timing is asserted."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ortsparse.graph_rewrite import KwtaSettings, RewriteConfig, TechniqueChoice, rewrite_model
from ortsparse.measure import decode
from ortsparse.runtime import KVDecoder, kv_layout, lm_feeds, open_session

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny"
KV = TINY / "llama_tiny_kv.torchscript.onnx"
FULL = TINY / "llama_tiny.torchscript.onnx"
GENAI = TINY / "llama_tiny_genai"
TOKENS = np.random.default_rng(11).integers(0, 256, size=300)


def full_logits(tokens: np.ndarray) -> np.ndarray:
    session = open_session(FULL)
    return session.run(["logits"], lm_feeds(session, tokens))[0][0]


@pytest.mark.parametrize("graph", [KV, GENAI / "model.onnx"], ids=["torchscript-kv", "genai"])
def test_kv_decoder_grows_the_cache_and_matches_the_full_export(graph):
    session = open_session(graph)
    layout = kv_layout(session, graph)
    assert (layout.kv_heads, layout.head_dim) == (2, 16)  # the genai graph's symbolic head size comes from its config
    decoder = KVDecoder(session, layout)
    reference = full_logits(TOKENS[:40])
    got = decoder.advance(TOKENS[:16])  # a prefill chunk
    np.testing.assert_allclose(got, reference[15], atol=1e-4)
    for position in range(16, 40):  # then one token per step, the cache one longer each time
        got = decoder.advance(TOKENS[position:position + 1])
        assert decoder.position == position + 1
        assert all(value.shape()[2] == position + 1 for value in decoder.past)
        np.testing.assert_allclose(got, reference[position], atol=1e-4)
    decoder.reset()
    assert decoder.position == 0 and all(value.shape()[2] == 0 for value in decoder.past)
    every = decoder.advance(TOKENS[:12], every=True)  # a teacher-forced chunk: the logits of each position
    assert every.shape == (12, reference.shape[-1])
    np.testing.assert_allclose(every, reference[:12], atol=1e-4)


def test_the_genai_head_size_is_read_from_the_graph_when_no_config_is_beside_it():
    import onnx

    proto = onnx.load(str(GENAI / "model.onnx"))  # weights loaded: the proto runs without its folder
    session = open_session(proto)
    assert kv_layout(session, proto).head_dim == 16  # o_proj reads num_heads * head size inputs
    with pytest.raises(ValueError, match="symbolic"):
        kv_layout(session)  # nothing to tell it


class Recorder:
    """A stepper that records what it was fed (and in which order the loop called it)."""

    runner = "test"

    def __init__(self, name: str, calls: list, answer: int | None = None):
        self.name, self.calls, self.answer = name, calls, answer
        self.fed: list[int] = []

    def reset(self, capacity: int) -> None:
        self.calls.append((self.name, "reset", capacity))
        self.fed = []

    def advance(self, ids):
        ids = [int(i) for i in np.asarray(ids).reshape(-1)]
        self.calls.append((self.name, "advance", len(ids)))
        self.fed += ids
        logits = np.zeros(256, np.float32)
        logits[self.answer if self.answer is not None else (ids[-1] + 1) % 256] = 1.0
        return logits


def test_loop_is_round_robin_teacher_forced_and_scores_agreement():
    calls: list = []
    steppers = {"a": Recorder("a", calls), "b": Recorder("b", calls, answer=7)}
    loop = decode.plan(10, steps=5, warmup=2, offset=3)
    result = decode.decode_loop(steppers, TOKENS, loop, prefill_chunk=4, reference="a", measure_metrics=False)
    # prefill 10 tokens in chunks 4 4 2, each chunk to every model in turn, then 7 single steps
    advances = [(n, size) for n, what, size in calls if what == "advance"]
    assert advances[:6] == [("a", 4), ("b", 4), ("a", 4), ("b", 4), ("a", 2), ("b", 2)]
    assert advances[6:] == [("a", 1), ("b", 1)] * 7
    assert [c for c in calls if c[1] == "reset"] == [("a", "reset", 17), ("b", "reset", 17)]
    # both were fed the corpus, whatever they predicted
    expected = TOKENS[3:3 + 10 + 7].tolist()
    assert steppers["a"].fed == steppers["b"].fed == expected
    a, b = result["a"], result["b"]
    assert len(a["step_seconds"]) == 5 and len(a["predictions"]) == 7  # warm-up untimed, still predicted
    assert a["predictions"] == [(t + 1) % 256 for t in TOKENS[13:20]]
    assert a["top1_agreement"] == 1.0
    assert b["top1_agreement"] == pytest.approx(np.mean(np.asarray(a["predictions"]) == 7))
    following = TOKENS[14:21]
    assert b["next_token_accuracy"] == pytest.approx(np.mean(following == 7))
    assert a["tokens_per_s"] == pytest.approx(1 / a["median_s"])
    # NLL of the corpus's next token under each model's logits (one-hot 1.0 over 256 classes)
    hit, miss = np.log(255 + np.e) - 1.0, np.log(255 + np.e)
    nll_a = np.where(following == np.asarray(a["predictions"]), hit, miss).mean()
    nll_b = np.where(following == 7, hit, miss).mean()
    assert a["mean_nll"] == pytest.approx(nll_a) and b["mean_nll"] == pytest.approx(nll_b)
    assert a["dppl_vs_reference"] == 0.0 and b["dppl_vs_reference"] == pytest.approx(np.expm1(nll_b - nll_a))


def test_a_loop_in_turn_runs_each_model_whole_and_scores_alike():
    """interleave=False (for spinning pools): every model's prefill and steps in one go, the same
    corpus, the same results as the alternated loop."""
    calls: list = []
    steppers = {"a": Recorder("a", calls), "b": Recorder("b", calls, answer=7)}
    loop = decode.plan(10, steps=5, warmup=2, offset=3)
    alternated = decode.decode_loop(steppers, TOKENS, loop, prefill_chunk=4, reference="a", measure_metrics=False)
    calls.clear()
    in_turn = decode.decode_loop(steppers, TOKENS, loop, prefill_chunk=4, reference="a", measure_metrics=False,
                                 interleave=False, settle_s=0.0)
    advances = [(n, size) for n, what, size in calls if what == "advance"]
    assert advances == [("a", 4), ("a", 4), ("a", 2)] + [("a", 1)] * 7 + [("b", 4), ("b", 4), ("b", 2)] + [("b", 1)] * 7
    assert steppers["a"].fed == steppers["b"].fed == TOKENS[3:3 + 10 + 7].tolist()
    for name in "ab":
        for key in ("predictions", "top1_agreement", "next_token_accuracy", "mean_nll", "dppl_vs_reference"):
            assert in_turn[name][key] == alternated[name][key]


def test_the_spinning_thread_policy_is_orts_default_pool():
    from ortsparse.runtime import thread_options
    assert thread_options(2) == {"intra_op_num_threads": 2, "allow_spinning": False}
    assert thread_options(2, spinning=True) == {"intra_op_num_threads": 2, "allow_spinning": None}
    assert decode.genai_session_options(2, spinning=True) == {"intra_op_num_threads": 2}


def test_plan_fits_the_models_longest_sequence():
    assert decode.plan(128, 16, 4).prompt == 128
    fitted = decode.plan(8192, 64, 4, max_positions=8192)
    assert (fitted.prompt, fitted.last_position) == (8124, 8191)
    with pytest.raises(ValueError, match="do not fit"):
        decode.plan(100, 60, 10, max_positions=50)


def test_loop_refuses_a_short_corpus_and_an_unknown_reference():
    steppers = {"a": Recorder("a", [])}
    with pytest.raises(ValueError, match="needs 21 tokens"):
        decode.decode_loop(steppers, TOKENS[:20], decode.plan(10, 8, 2), measure_metrics=False)
    with pytest.raises(ValueError, match="reference"):
        decode.decode_loop(steppers, TOKENS, decode.plan(10, 8, 2), reference="z", measure_metrics=False)


def test_real_steppers_agree_and_a_gated_model_counts_its_decode_steps():
    import onnx

    gated, _ = rewrite_model(onnx.load(str(KV)), RewriteConfig(
        techniques={"kwta": TechniqueChoice(KwtaSettings(k_frac=0.3), enabled=True, target="all")}))
    steppers = {"dense": decode.open_stepper(KV, "ort", 1), "genai-ort": decode.open_stepper(GENAI, "ort", 1),
                "genai-og": decode.open_stepper(GENAI, "og", 2), "gated": decode.open_stepper(gated, "ort", 1)}
    loop = decode.plan(40, steps=12, warmup=2)
    result = decode.decode_loop(steppers, TOKENS, loop, prefill_chunk=16, reference="dense")
    assert result["genai-ort"]["top1_agreement"] == result["genai-og"]["top1_agreement"] == 1.0
    assert result["genai-og"]["predictions"] == result["dense"]["predictions"]
    assert result["gated"]["top1_agreement"] < 1.0
    counters = result["_metrics"]
    calls = [v["calls"] for k, v in counters.items() if not k.startswith("total/") and v.get("calls")]
    assert calls and set(calls) == {14}  # reset after the prefill: one call per decode step


def test_genai_stepper_threads_and_capacity():
    stepper = decode.GenaiStepper(GENAI, threads=2)
    assert decode.genai_session_options(2) == {"intra_op_num_threads": 2, "session.intra_op.allow_spinning": "0"}
    assert decode.genai_session_options(1) == {"intra_op_num_threads": 1}
    stepper.reset(500)  # more than the model's 128 positions: the Generator's buffer is capped
    logits = stepper.advance(TOKENS[:100])
    np.testing.assert_allclose(logits, full_logits(TOKENS[:100])[99], atol=1e-4)


@pytest.mark.slow
def test_real_loop_ours_and_genai_fp32_predict_alike():
    """SmolLM2: our TorchScript KV export and the genai fp32 folder (both runners) in the real loop
    on the corpus: the same next-token predictions at every decode step."""
    from ortsparse.zoo import models
    from ortsparse.measure.corpus import load_corpus_tokens

    try:
        ours, folder = models.model_path("smollm2", "kv.torchscript"), models.genai_folder_path("fp32")
    except models.ModelNotBuiltError as error:
        pytest.fail(str(error))
    steppers = {"ours": decode.open_stepper(ours, "ort", 1), "genai-ort": decode.open_stepper(folder, "ort", 1),
                "genai-og": decode.open_stepper(folder, "og", 1)}
    result = decode.decode_loop(steppers, load_corpus_tokens(), decode.plan(200, 8, 2), prefill_chunk=128,
                                reference="ours", measure_metrics=False)
    assert result["genai-ort"]["top1_agreement"] == result["genai-og"]["top1_agreement"] == 1.0
    assert result["ours"]["next_token_accuracy"] > 0.2  # a trained model on real text
