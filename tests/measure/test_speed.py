"""ortsparse bench (the real decode loop over several models and runners) and ortsparse.runtime's
decoder feeds on the tiny exports and the tiny genai folder: feeds, byte accounting, report rows,
the CLI. No timing is asserted."""
import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from ortsparse.graph_rewrite import KwtaSettings, RewriteConfig, TechniqueChoice, rewrite_model
from ortsparse.cli import main
from ortsparse.measure import speed
from ortsparse.runtime import decode_feeds, open_session

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny"
KV = TINY / "llama_tiny_kv.torchscript.onnx"
FULL = TINY / "llama_tiny.torchscript.onnx"
GENAI = TINY / "llama_tiny_genai"  # the genai builder's graph of llama_tiny's weights
TOKENS = np.random.default_rng(5).integers(0, 256, size=400)


def test_kv_feeds_follow_the_graph():
    feeds = decode_feeds(KV, new_tokens=1, past=12, vocab=256)
    assert feeds["input_ids"].shape == (1, 1)
    assert feeds["attention_mask"].shape == (1, 13)
    assert feeds["position_ids"].tolist() == [[12]]
    assert feeds["past_key_values.0.key"].shape == (1, 2, 12, 16)
    out = open_session(KV).run(None, feeds)
    assert out[0].shape == (1, 1, 256)


def test_prefill_feeds_for_full_export():
    feeds = decode_feeds(FULL, new_tokens=5, past=0, vocab=256)
    assert feeds["input_ids"].shape == (1, 5) and feeds["position_ids"].tolist() == [[0, 1, 2, 3, 4]]


def test_weight_bytes_count_linear_weights_and_keep_ratio():
    model = onnx.load(str(KV))
    dense_bytes = speed.weight_bytes_per_token(model)
    inits = {i.name: i for i in model.graph.initializer}
    expected = sum(int(np.prod(inits[n.input[1]].dims)) * 4 for n in model.graph.node
                   if n.op_type == "MatMul" and n.input[1] in inits)
    assert dense_bytes == expected
    config = RewriteConfig(techniques={"kwta": TechniqueChoice(KwtaSettings(k_frac=0.5), enabled=True, target="mlp")})
    rewritten, report = rewrite_model(model, config)
    gated = {r.name for r in report.rewritten}
    nodes = [n for n in rewritten.graph.node if n.op_type == "KwtaBlockMatMul"]
    assert len(nodes) == len(gated) > 0
    half = speed.weight_bytes_per_token(rewritten, {n.name: 0.5 for n in nodes})
    gated_bytes = sum(int(np.prod({i.name: i for i in rewritten.graph.initializer}[n.input[1]].dims)) * 4 for n in nodes)
    assert half == pytest.approx(dense_bytes - gated_bytes / 2)


def test_bench_rows_cover_every_model_runner_and_context():
    """The real loop over a KV export, its KWTA rewrite and a genai folder (both runners)."""
    model = onnx.load(str(KV))
    rewritten, _ = rewrite_model(model, RewriteConfig(techniques={"kwta": TechniqueChoice(KwtaSettings(k_frac=0.5), enabled=True, target="mlp")}))
    candidates = [speed.Candidate("dense", model), speed.Candidate("ortsparse", rewritten),
                  speed.Candidate("genai", GENAI, ("ort", "og"))]
    payload = speed.bench(candidates, TOKENS, contexts=(4, 9), threads=(1,), steps=3, warmup=1, prefill_chunk=4,
                          rounds=2, log=lambda *_: None)
    rows = payload["rows"]
    # rounds are spread over the run: every setting of round 1 before any of round 2
    assert [r["run"] for r in rows] == [0] * 8 + [1] * 8
    assert len(payload["ratios"]) == 8
    for summary in payload["ratios"]:
        group = [r["speedup"] for r in rows if (r["context"], r["model"], r["runner"]) ==
                 (summary["context"], summary["model"], summary["runner"])]
        assert summary["speedup"]["rounds"] == 2
        assert summary["speedup"]["min"] == min(group) and summary["speedup"]["max"] == max(group)
        assert summary["speedup"]["min"] <= summary["speedup"]["median"] <= summary["speedup"]["max"]
    assert {(r["context"], r["model"], r["runner"]) for r in rows} == {
        (c, m, k) for c in (4, 9) for m, k in [("dense", "ort"), ("ortsparse", "ort"), ("genai", "ort"), ("genai", "og")]}
    assert len(rows) == 2 * 4 * 2  # two rounds of every setting
    assert all(r["tokens_per_s"] > 0 and r["bound_tokens_per_s"] > 0 for r in rows)
    assert all(r["speedup"] == 1.0 and r["top1_agreement"] == 1.0 for r in rows if r["model"] == "dense")
    # the genai graph has the dense export's weights: same predictions through both runners
    assert all(r["top1_agreement"] == 1.0 for r in rows if r["model"] == "genai")
    dense = next(r for r in rows if r["model"] == "dense")
    ours = next(r for r in rows if r["model"] == "ortsparse")
    assert ours["weight_mb"] < dense["weight_mb"] and ours["keep_ratio"] == pytest.approx(0.5)
    og = next(r for r in rows if r["runner"] == "og")
    assert og["kv_copy_mb"] == 0 and dense["kv_copy_mb"] == pytest.approx(2 * dense["kv_mb"])
    assert dense["kv_mb"] == pytest.approx(4 * 2 * 16 * 4 * (4 + 1 + 2) / 1e6)  # 4 K/V tensors, mean position 7
    assert len(payload["stability"]) == 8 and all(s["spread"] >= 0 for s in payload["stability"])
    text = speed.markdown(payload, "cmd", "title")
    assert text.count("\n| 1 | ") == 8 + 8 and "Stability" in text  # the table and the stability rows
    assert "Neighbour: none" in text and "speedup min / median" in text


def test_bench_with_orts_spinning_pool_runs_the_models_in_turn_and_says_so():
    model = onnx.load(str(KV))
    rewritten, _ = rewrite_model(model, RewriteConfig(techniques={"kwta": TechniqueChoice(KwtaSettings(k_frac=0.5), enabled=True, target="mlp")}))
    candidates = [speed.Candidate("dense", model), speed.Candidate("ortsparse", rewritten)]
    payload = speed.bench(candidates, TOKENS, contexts=(6,), threads=(2,), steps=3, warmup=1, prefill_chunk=4,
                          rounds=2, spinning=True, log=lambda *_: None)
    assert payload["loop"]["spinning"] is True
    ours = [r for r in payload["rows"] if r["model"] == "ortsparse"]
    assert len(ours) == 2 and all(r["keep_ratio"] == pytest.approx(0.5) for r in ours)  # its own counters
    text = speed.markdown(payload, "cmd", "title")
    assert "ORT's default spinning pool" in text and "allow_spinning=0" not in text
    assert "allow_spinning=0" in speed.markdown({**payload, "loop": {**payload["loop"], "spinning": False}}, "c", "t")


def test_bench_shortens_the_prompt_to_the_models_length():
    payload = speed.bench([speed.Candidate("genai", GENAI, ("og",))], TOKENS, contexts=(128,), threads=(1,), steps=3,
                          warmup=1, rounds=1, log=lambda *_: None)
    (row,) = payload["rows"]
    assert row["positions"] == [124, 127] and row["prompt"] == 124  # the tiny model holds 128 positions


def test_models_resolve_from_names_and_paths(tmp_path):
    kv = speed.resolve_model(f"mine={KV}")
    assert kv.runners == ("ort",) and kv.graph == KV
    folder = speed.resolve_model(f"g={GENAI}", ["og"])
    assert folder.is_genai and folder.runners == ("og",) and folder.graph == GENAI / "model.onnx"
    with pytest.raises(KeyError, match="unknown model"):
        speed.resolve_model("nonsense")
    with pytest.raises(FileNotFoundError):
        speed.resolve_model(f"x={tmp_path / 'missing.onnx'}")
    with pytest.raises(ValueError, match="genai_config.json"):
        speed.resolve_model(f"x={tmp_path}")


def test_cli_bench_writes_the_report(tmp_path, capsys):
    corpus = tmp_path / "tokens.npy"
    np.save(corpus, TOKENS)
    stem = tmp_path / "bench"
    code = main(["bench", f"dense={KV}", f"genai={GENAI}", "--contexts", "8", "--threads", "1", "--steps", "2",
                 "--warmup", "1", "--corpus", str(corpus), "--rewrite", "genai", "--kwta-target", "mlp",
                 "--kwta-k", "0.5", "--rounds", "2", "--neighbour", "stream", "-o", str(stem)])
    assert code == 0
    payload = json.loads(stem.with_suffix(".json").read_text())
    assert payload["loop"]["rounds"] == 2 and payload["neighbour"]["kind"] == "stream"
    assert payload["neighbour"]["read_gbs"] > 0 and payload["neighbour"]["buffer_mb"] >= 256
    assert {(r["model"], r["runner"]) for r in payload["rows"]} == {
        ("dense", "ort"), ("genai", "ort"), ("genai", "og"), ("genai+ortsparse", "ort"), ("genai+ortsparse", "og")}
    gated = [r for r in payload["rows"] if r["model"] == "genai+ortsparse"]
    assert all(r["keep_ratio"] == pytest.approx(0.5) for r in gated)  # the og row borrows the ORT run's counts
    assert payload["config"]["rewrite"] == "genai"
    assert "genai+ortsparse | og" in stem.with_suffix(".md").read_text()
    assert main(["bench", "nonsense", "--corpus", str(corpus)]) == 2


def test_stream_neighbour_streams_and_stops():
    """The neighbour reads a buffer larger than the L3 while the block runs and is gone after it."""
    import time

    from ortsparse.benchmarking import StreamNeighbour

    with StreamNeighbour(max_seconds=60) as beside:
        pid = beside.process.pid
        time.sleep(0.5)
        assert beside.process.poll() is None
    assert beside.process.poll() is not None  # stopped, not left running
    assert beside.result["read_gbs"] > 0 and beside.result["buffer_mb"] >= 256
    assert pid > 0


def test_bench_refuses_zero_rounds():
    with pytest.raises(ValueError, match="rounds"):
        speed.bench([speed.Candidate("genai", GENAI, ("og",))], TOKENS, contexts=(8,), threads=(1,), rounds=0)


def test_request_shapes_parse_and_refuse():
    from ortsparse.measure.request import RequestShape, parse_requests

    assert parse_requests("512:64, 4096:256") == [RequestShape(512, 64), RequestShape(4096, 256)]
    for bad in ("512", "512:0", "0:5", "a:b", "512:64,", "-3:4"):
        with pytest.raises(ValueError, match="PROMPT:ANSWER|no request"):
            parse_requests(bad)


def test_request_bench_times_prompt_and_answer(tmp_path):
    """A whole request per model: the first token's time plus the answer's steps make the total; the
    same model twice agrees on every answer token and its ratios sit around 1."""
    from ortsparse.measure.request import RequestShape, request_bench, request_markdown

    candidates = [speed.Candidate("genai", GENAI, ("og", "ort")), speed.Candidate("copy", GENAI, ("og",))]
    payload = request_bench(candidates, TOKENS, [RequestShape(20, 6), RequestShape(40, 1)], rounds=2,
                            log=lambda *_: None)
    rows = payload["rows"]
    assert len(rows) == 2 * 2 * 3  # rounds x requests x (model, runner)
    for r in rows:
        assert r["total_s"] == pytest.approx(r["ttft_s"] + r["decode_s"])
        assert r["answer_agreement"] == 1.0  # same weights, same tokens
        if r["answer"] == 1:
            assert r["decode_s"] == 0 and np.isnan(r["decode_speedup"])
    reference = [r for r in rows if (r["model"], r["runner"]) == ("genai", "og")]
    assert all(r["total_speedup"] == 1.0 for r in reference)
    assert {(r["request"], r["model"], r["runner"]) for r in payload["ratios"]} == {
        (q, m, k) for q in ("20+6", "40+1") for m, k in [("genai", "og"), ("genai", "ort"), ("copy", "og")]}
    text = request_markdown(payload, "cmd")
    assert text.count("\n| 1 | ") == 6 and "first token" in text
    with pytest.raises(ValueError, match="does not fit"):
        request_bench(candidates, TOKENS, [RequestShape(120, 20)], rounds=1, log=lambda *_: None)


def test_cli_bench_request_writes_the_report(tmp_path):
    corpus = tmp_path / "tokens.npy"
    np.save(corpus, TOKENS)
    stem = tmp_path / "req"
    assert main(["bench", f"genai={GENAI}", "--runners", "og", "--threads", "1", "--corpus", str(corpus),
                 "--request", "16:4", "--rounds", "1", "-o", str(stem)]) == 0
    payload = json.loads(stem.with_suffix(".json").read_text())
    assert payload["requests"] == ["16+4"] and len(payload["rows"]) == 1
    assert payload["command"] == (f"ortsparse bench genai={GENAI} --runners og --threads 1 --corpus {corpus} "
                                  f"--request 16:4 --rounds 1 -o {stem}")  # the arguments main() was given
    assert main(["bench", f"genai={GENAI}", "--corpus", str(corpus), "--request", "16", "-o", str(stem)]) == 2
    assert main(["bench", f"genai={GENAI}", "--corpus", str(corpus), "--request", "120:20", "-o", str(stem)]) == 2


def test_cli_bench_spinning_writes_its_policy(tmp_path):
    corpus = tmp_path / "tokens.npy"
    np.save(corpus, TOKENS)
    stem = tmp_path / "req"
    assert main(["bench", f"genai={GENAI}", f"copy={GENAI}", "--runners", "og", "--threads", "2", "--spinning",
                 "--corpus", str(corpus), "--request", "16:4", "--rounds", "1", "-o", str(stem)]) == 0
    payload = json.loads(stem.with_suffix(".json").read_text())
    assert payload["spinning"] is True and {r["answer_agreement"] for r in payload["rows"]} == {1.0}
    assert "ORT's default spinning pool" in stem.with_suffix(".md").read_text()


def test_request_speed_gives_the_worst_round_ratio():
    from ortsparse.measure.request import request_speed

    out = request_speed({"input": GENAI, "copy": GENAI}, TOKENS, prompt=24, answer=4, rounds=2)
    assert set(out) == {"input", "copy"} and out["input"]["speedup"] == 1.0
    assert out["copy"]["request"] == "24+4" and out["copy"]["total_s"] > 0
    assert out["copy"]["speedup"] <= out["copy"]["speedup_median"]


def test_tune_verdict_reads_the_request_when_measured():
    from ortsparse.tuning.results import SpeedCheck
    from ortsparse.tuning.tune import EXIT_WRITTEN, EXIT_WRITTEN_SLOWER, verdict

    decode = {"input": {"tokens_per_s": 100.0}, "tuned": {"tokens_per_s": 130.0, "speedup": 1.2}}
    request = {"input": {"speedup": 1.0}, "tuned": {"speedup": 0.93, "request": "3840+256"}}
    status, line = verdict("OUT", 0.01, SpeedCheck(128, "ONNX Runtime session", decode, request))
    assert status == EXIT_WRITTEN_SLOWER and "0.93x request time (3840+256" in line and "SLOWER" in line
    status, line = verdict("OUT", 0.01, SpeedCheck(128, "ONNX Runtime session", decode))
    assert status == EXIT_WRITTEN and "1.20x decode at context 128, worst round" in line
