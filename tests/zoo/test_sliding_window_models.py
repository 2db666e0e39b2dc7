"""Models whose sliding-window layers use window-sized KV buffers (onnxruntime-genai's builder default:
GroupQueryAttention with sliding_window_cache=1), end to end on the tiny Gemma-3-style folder
(models/tiny/gemma3_tiny_genai: 3 sliding-window layers of 8 keys, 1 global layer, random weights):
the harness feeds each layer the buffers it expects, as onnxruntime-genai's Generator does; every
command runs on the folder; rewrite-onnx --attn rewrites every layer and decodes as the input does.
The slow test rebuilds the folder with transformers and the builder."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from ortsparse.cli import main
from ortsparse.zoo.export_genai import greedy_ids
from ortsparse.measure.perplexity import perplexity
from ortsparse.runtime import KVDecoder, kv_layout, lm_feeds, open_session

MODELS = Path(__file__).resolve().parents[2] / "models"
GEMMA = MODELS / "tiny" / "gemma3_tiny_genai"
WINDOW, CAPACITY = 8, 8 + 16  # the Generator's CPU buffers: the window + 16 rows
PROMPT = [int(i) for i in np.random.default_rng(0).integers(3, 256, 13)]
STEPS = 48  # the window buffers compact 3 times


def generator_greedy(folder: Path, ids=PROMPT, tokens: int = STEPS) -> list[int]:
    return greedy_ids(folder, ids, tokens)


def decoder_logits(model: Path, tokens) -> np.ndarray:
    """Teacher-forced logits of a KVDecoder: the prompt in one call, then one token per call."""
    session = open_session(model)
    decoder = KVDecoder(session, kv_layout(session, model))
    rows = [decoder.advance(tokens[:len(PROMPT)])]
    rows += [decoder.advance([t]) for t in tokens[len(PROMPT):-1]]
    return np.stack(rows)


@pytest.fixture(scope="module")
def greedy():
    return generator_greedy(GEMMA)


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    words = "the of and a to in is was for on that by with as at from his her it an were are which".split()
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(" ".join(words[i] for i in rng.integers(0, len(words), 2500)), encoding="utf-8")
    return path


def test_the_layout_gives_window_sized_buffers_to_the_sliding_window_layers():
    session = open_session(GEMMA / "model.onnx")
    layout = kv_layout(session, GEMMA / "model.onnx")
    assert kv_layout(session, GEMMA).capacity == layout.capacity  # the folder tells the same
    by_name = dict(zip(layout.past, layout.capacity))
    for layer in range(4):
        for kind in ("key", "value"):
            assert by_name[f"past_key_values.{layer}.{kind}"] == (CAPACITY if layer < 3 else 0)
    assert [a.shape[2] for a in layout.empty()] == [CAPACITY if c else 0 for c in layout.capacity]
    assert layout.bytes_per_position() == 2 * 2 * 16 * 4  # only the global layer grows
    with pytest.raises(ValueError, match="nothing tells their size"):  # a session alone cannot size them
        kv_layout(session)


def test_the_decoder_and_a_full_window_prefill_agree_with_the_generator(greedy):
    """Greedy tokens of the KVDecoder (window-sized past fed, present bound back) are the Generator's;
    one prefill of the whole sequence from an empty past (what perplexity runs; longer than the
    buffers) gives the same logits as the step-by-step decode."""
    assert len(set(greedy)) > 10  # the random model does not just repeat a token
    session = open_session(GEMMA / "model.onnx")
    layout = kv_layout(session, GEMMA / "model.onnx")
    decoder = KVDecoder(session, layout)
    logits = decoder.advance(PROMPT)
    ours = []
    for _ in range(STEPS):
        ours.append(int(np.argmax(logits)))
        logits = decoder.advance([ours[-1]])
    assert ours == greedy
    sequence = PROMPT + greedy
    stepped = decoder_logits(GEMMA / "model.onnx", sequence)
    (full,) = session.run(["logits"], lm_feeds(session, np.array(sequence), layout))
    np.testing.assert_allclose(full[0, len(PROMPT) - 1:-1], stepped, rtol=1e-4, atol=1e-4)


def test_every_command_runs_on_the_folder(tmp_path, text, steady_tune_speed):
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.random.default_rng(7).integers(0, 256, size=2000).astype(np.int64))
    assert perplexity(GEMMA / "model.onnx", np.load(tokens), 2, 48)["ppl"] > 1
    assert main(["quality", str(GEMMA), "--corpus", str(tokens), "--windows", "2", "--window-len", "48",
                 "--kwta-target", "mlp", "--kwta-k", "0.5", "-q"]) == 0
    assert main(["calibrate", str(GEMMA), "--tokens", str(tokens), "-o", str(tmp_path / "calib.json"),
                 "--calib-windows", "2", "--eval-windows", "2", "--window-len", "64", "--max-dppl", "1.0"]) == 0
    assert json.loads((tmp_path / "calib.json").read_text())
    assert main(["bench", f"input={GEMMA}", "--runners", "ort", "og", "--contexts", "40", "--threads", "1",
                 "--steps", "30", "--warmup", "1", "--corpus", str(tokens), "--rewrite", "input", "--attn", "popcount",
                 "-o", str(tmp_path / "bench")]) == 0
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert {(r["model"], r["runner"]) for r in rows} >= {("input", "og"), ("input+ortsparse", "og")}
    assert all(r["top1_agreement"] == 1.0 for r in rows)  # exact attention on our op: the same tokens
    assert main(["tune", str(GEMMA), "--text", str(text), "-o", str(tmp_path / "tuned"), "--max-dppl", "1.0"]) == 0
    assert json.loads((tmp_path / "tuned.tune.json").read_text())["written"]


@pytest.mark.parametrize("attn", ["none", "popcount"])
def test_attn_rewrites_every_layer_and_decodes_as_the_input(attn, greedy, tmp_path, capsys):
    out = tmp_path / attn
    assert main(["rewrite", str(GEMMA), "-o", str(out), f"--attn={attn}"]) == 0
    assert "4 attention core(s), 4 rewritten" in capsys.readouterr().out
    nodes = [n for n in onnx.load(str(out / "model.onnx"), load_external_data=False).graph.node
             if "GroupQueryAttention" in n.op_type]
    assert len(nodes) == 4 and all(n.op_type == "PopcountGroupQueryAttention" for n in nodes)
    windowed = [n for n in nodes if any(a.name == "sliding_window_cache" and a.i == 1 for a in n.attribute)]
    assert len(windowed) == 3
    assert generator_greedy(out) == greedy
    sequence = PROMPT + greedy
    theirs = decoder_logits(GEMMA / "model.onnx", sequence)
    ours = decoder_logits(out / "model.onnx", sequence)
    assert np.abs(ours - theirs).max() <= 1e-4 * np.abs(theirs).max()


@pytest.mark.parametrize("flags", [["--kwta", "on", "--kwta-k", "1"], ["--attn=none"]])
def test_verify_passes_an_exact_rewrite_of_the_folder(flags, tmp_path, capsys):
    """--verify generates window-sized pasts of the Generator's rows (4 rows, the default past, are
    fewer than the window: the source model cannot run) and compares the present rows the call leaves
    resident (ours zeroes the rest of the buffer, onnxruntime leaves it uninitialised)."""
    assert main(["rewrite", str(GEMMA), "-o", str(tmp_path / "out"), *flags, "--verify", "2"]) == 0
    said = capsys.readouterr().out
    assert "verify: PASSED" in said and f"past_key_values.0.key [1, 2, {CAPACITY}, 16]" in said
    assert "past_key_values.3.key [1, 2, 4, 16]" in said and "attention_mask [1, 12]" in said


def test_verify_compares_only_the_rows_a_window_buffer_holds(monkeypatch):
    """Whatever a call leaves in the window buffers' rows past the resident ones (here NaN, in the
    second model only) is not compared; the resident rows are."""
    from ortsparse import verify

    real_open = verify.open_session
    sizes = {"kv_cache_dim": 16, "past_sequence_length": 4, "sequence_length": 8, "total_sequence_length": 12}

    class Garbage:
        """A session whose window buffers' rows from ``first`` on are NaN after each run."""

        def __init__(self, session, first):
            self.session, self.first = session, first

        def __getattr__(self, name):
            return getattr(self.session, name)

        def run(self, names, feeds):
            values = self.session.run(names, feeds)
            for name, value in zip(names, values):
                if name.split(".")[:2] in (["present", "0"], ["present", "1"], ["present", "2"]):
                    value[:, :, self.first:] = np.nan
            return values

    def verify_with_garbage_from(first):
        opened = []

        def open_session(model, *args, **kwargs):
            opened.append(real_open(model, *args, **kwargs))
            return Garbage(opened[-1], first) if len(opened) == 2 else opened[-1]

        monkeypatch.setattr(verify, "open_session", open_session)
        return verify.verify_models(GEMMA / "model.onnx", GEMMA / "model.onnx", runs=1, shapes=sizes)

    result = verify_with_garbage_from(12)  # 4 past + 8 new positions resident: rows 12.. are not
    assert result.passed and all(o.max_abs == 0 for o in result.outputs)
    assert {o.name: o.shape for o in result.outputs}["present.0.key"] == (1, 2, 12, 16)
    assert not verify_with_garbage_from(11).passed  # a resident row differs: seen


def test_resident_rows_follow_the_buffer():
    from ortsparse.verify import resident_rows

    assert [resident_rows(t, 24, 8) for t in (4, 12, 24, 25, 41, 42)] == [4, 12, 24, 8, 24, 8]
    assert [resident_rows(t, 8, 8) for t in (8, 9, 12)] == [8, 8, 8]


@pytest.mark.slow
def test_the_folder_rebuilds_from_transformers_and_matches_torch(tmp_path):
    """build_tiny_gemma3 (transformers' Gemma3 classes, random weights, the builder) writes a folder
    whose Generator decodes torch's greedy tokens, with the committed folder's graph."""
    import sys

    from ortsparse.zoo.export_genai import build_tiny_gemma3

    build_tiny_gemma3(tmp_path / "gemma", log=lambda _: None)
    sys.path.insert(0, str(MODELS))
    import make_tiny_gemma3_genai as make

    reference = make.torch_greedy(PROMPT, STEPS)
    assert generator_greedy(tmp_path / "gemma") == reference == generator_greedy(GEMMA)
    built = onnx.load(str(tmp_path / "gemma" / "model.onnx"), load_external_data=False)
    committed = onnx.load(str(GEMMA / "model.onnx"), load_external_data=False)
    assert [n.op_type for n in built.graph.node] == [n.op_type for n in committed.graph.node]


def test_a_reset_decoder_keeps_its_window_buffers_alive():
    """After reset() the first past values wrap the layout's zero buffers without copying, and the
    decoder keeps them referenced while bound: a reset decoder gives the same logits again whatever
    was allocated meanwhile. (Seen once in the full suite before the fix: onnxruntime placed a present
    output over a freed buffer and the op refused, "present_key overlaps past_key without being the
    same buffer"; this test did not reproduce that on its own.)"""
    import gc

    session = open_session(GEMMA / "model.onnx")
    layout = kv_layout(session, GEMMA / "model.onnx")
    decoder = KVDecoder(session, layout)
    first = [decoder.advance(PROMPT)] + [decoder.advance([t]) for t in PROMPT[:6]]
    for _ in range(3):
        decoder.reset()
        gc.collect()
        # arrays of the buffers' sizes, NaN: numpy hands freed blocks of a size to the next array
        noise = [np.full_like(a, np.nan) for a in layout.empty() for _ in range(4)]
        again = [decoder.advance(PROMPT)] + [decoder.advance([t]) for t in PROMPT[:6]]
        del noise
        for a, b in zip(first, again):
            np.testing.assert_array_equal(a, b)
