"""Windows start the way the model's own generation path starts (issue 29): a BOS token first when
the tokenizer adds one (tokenizer_config.json add_bos_token, else tokenizer.json's template), never
from genai_config's bos_token_id alone; the BOS position's prediction is not scored; every report says
what was used and how far dppl moves from window to window."""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from ortsparse.cli import main
from ortsparse.graph_rewrite.errors import ModelFileError
from ortsparse.measure.corpus import first_scored, lm_windows, text_per_window
from ortsparse.measure.perplexity import compare_lm, dppl_spread, perplexity
from ortsparse.measure.text import BosChoice, resolve_bos, tokenizer_bos
from ortsparse.runtime import kv_layout, lm_feeds, open_session

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny"
GENAI = TINY / "llama_tiny_genai"
LLAMA = TINY / "llama_tiny.torchscript.onnx"
WORDS = ["<unk>", "<bos>", "<eos>", "the", "capital", "of", "France", "is", "Paris.", "Hello", "world.", "1", "2", "3"]


def tiny_tokenizer(folder: Path, *, template: bool, config: dict | None = None) -> Path:
    """A word-level tokenizer.json (ids as WORDS) whose post-processor adds <bos> when ``template``,
    with a tokenizer_config.json of ``config`` beside it when given."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<unk>", "<bos>", "<eos>"])
    if template:  # Gemma-3 / Llama-3 style: "<bos> $A"
        tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                                 special_tokens=[("<bos>", 1)])
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder / "tokenizer.json"


def test_a_template_that_adds_bos(tmp_path):
    bos = tokenizer_bos(tiny_tokenizer(tmp_path, template=True))
    assert (bos.id, bos.token) == (1, "<bos>") and "post-processor adds <bos>" in bos.source


def test_a_tokenizer_that_adds_none(tmp_path):
    bos = tokenizer_bos(tiny_tokenizer(tmp_path, template=False))
    assert bos.id is None and "adds none" in bos.source


def test_tokenizer_config_decides_when_it_says(tmp_path):
    # Llama-2 / Gemma style: add_bos_token true in the config (transformers rebuilds the template from it).
    added = tokenizer_bos(tiny_tokenizer(tmp_path / "a", template=False,
                                         config={"add_bos_token": True, "bos_token": {"content": "<bos>"}}))
    assert added.id == 1 and "add_bos_token true" in added.source
    # And false wins over a template that would add one.
    off = tokenizer_bos(tiny_tokenizer(tmp_path / "b", template=True, config={"add_bos_token": False}))
    assert off.id is None and "add_bos_token false" in off.source
    # No add_bos_token key (SmolLM2 / GPT-2 style config): the template decides.
    assert tokenizer_bos(tiny_tokenizer(tmp_path / "c", template=False, config={"bos_token": "<bos>"})).id is None


def test_add_bos_without_a_bos_token_is_a_one_line_error(tmp_path):
    path = tiny_tokenizer(tmp_path, template=False, config={"add_bos_token": True})
    with pytest.raises(ModelFileError, match="add_bos_token is true but no BOS token"):
        tokenizer_bos(path)


def test_genai_bos_token_id_alone_is_not_a_bos():
    # The tiny genai folder names bos_token_id 1, as every genai_config does; its tokenizer adds none.
    assert json.loads((GENAI / "genai_config.json").read_text())["model"]["bos_token_id"] == 1
    assert tokenizer_bos(GENAI / "tokenizer.json").id is None


def test_resolve_bos_spec(tmp_path):
    assert resolve_bos("none", GENAI).id is None
    assert resolve_bos("7", GENAI, vocab_size=256).id == 7
    assert resolve_bos("auto", LLAMA).source == "no tokenizer beside the model to ask"
    with pytest.raises(ModelFileError, match="outside the model's vocabulary"):
        resolve_bos("300", GENAI, vocab_size=256)
    with pytest.raises(ModelFileError, match="expected auto, none or a token id"):
        resolve_bos("yes", GENAI)


def test_windows_with_bos_hold_one_text_token_fewer():
    tokens = np.arange(100, 200)
    plain = lm_windows(tokens, 3, 10, offset=5)
    assert plain.tolist() == [list(range(105 + 10 * i, 115 + 10 * i)) for i in range(3)]
    with_bos = lm_windows(tokens, 3, 10, offset=5, bos=1)
    assert with_bos.shape == (3, 10) and (with_bos[:, 0] == 1).all()
    assert with_bos[:, 1:].tolist() == [list(range(105 + 9 * i, 114 + 9 * i)) for i in range(3)]
    assert text_per_window(10, 1) == 9 and text_per_window(10) == 10
    assert (first_scored(None), first_scored(1)) == (0, 1)
    with pytest.raises(ValueError, match="window_len >= 3"):
        lm_windows(tokens, 1, 2, bos=1)


def _reference_nll(model, windows, first):
    """Mean -log p(target) over the scored positions, from the whole logits in float64."""
    session = open_session(model)
    kv = kv_layout(session, model)
    total, count = 0.0, 0
    for window in windows:
        logits = session.run(["logits"], lm_feeds(session, window, kv))[0][0].astype(np.float64)
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        targets = window[first + 1:]
        total -= logp[np.arange(first, len(window) - 1), targets].sum()
        count += targets.size
    return total / count, count


@pytest.mark.parametrize("bos", [None, 1])
def test_the_bos_position_is_not_scored(bos):
    tokens = np.random.default_rng(0).integers(3, 256, 200)
    result = perplexity(LLAMA, tokens, windows=3, window_len=16, bos=bos)
    windows = lm_windows(tokens, 3, 16, bos=bos)
    nll, count = _reference_nll(str(LLAMA), windows, first_scored(bos))
    assert result["tokens"] == count == 3 * (16 - 1 - (bos is not None))
    assert result["nll"] == pytest.approx(nll, rel=1e-6)
    assert result["bos"]["id"] == bos
    # With and without BOS the same text tokens are scored: each window's text tokens 2..n.
    assert result["predictions"].shape == (3, text_per_window(16, bos) - 1)


def test_dppl_spread_over_windows():
    dense, rewritten = [2.0, 2.5, 3.0, 2.2], [2.01, 2.49, 3.05, 2.2]
    spread = dppl_spread(dense, rewritten)
    diff = np.subtract(rewritten, dense)
    assert spread["dppl_windows"] == pytest.approx(np.expm1(diff).tolist())
    assert spread["dppl_stderr"] == pytest.approx(np.exp(diff.mean()) * diff.std(ddof=1) / 2)
    assert dppl_spread([2.0], [2.1])["dppl_stderr"] is None


def test_compare_lm_reports_windows_and_spread():
    import onnx

    from ortsparse.graph_rewrite import KwtaSettings, RewriteConfig, TechniqueChoice, rewrite_model

    model = onnx.load(str(LLAMA))
    every_layer = TechniqueChoice(KwtaSettings(k_frac=0.5), enabled=True, target="all")
    gated, _ = rewrite_model(model, RewriteConfig(techniques={"kwta": every_layer}))
    tokens = np.random.default_rng(1).integers(3, 256, 400)
    result = compare_lm(model, gated, tokens, windows=4, window_len=32,
                        bos=BosChoice(1, "<1>", "a test tokenizer adds it"))
    assert len(result["dppl_windows"]) == 4 and result["dppl_stderr"] > 0
    # The mean log ratio over windows is the dppl (equal token counts per window).
    assert np.log1p(result["dppl_windows"]).mean() == pytest.approx(np.log1p(result["dppl"]), rel=1e-9, abs=1e-12)
    text = result["window_construction"]
    assert "4 windows x 32 positions" in text and "BOS <1> (id 1) + 31 text tokens" in text
    assert "a test tokenizer adds it" in text and "nor the BOS position" in text


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("The capital of France is Paris. " * 40, encoding="utf-8")
    return path


@pytest.mark.parametrize("adds_bos", [False, True])
def test_quality_report_says_what_was_used(tmp_path, text, adds_bos, capsys):
    folder = tmp_path / "model"
    shutil.copytree(GENAI, folder)
    if adds_bos:  # the same model, its tokenizer configured to add <1> first
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    out = tmp_path / "q.json"
    assert main(["quality", str(folder), "--text", str(text), "--windows", "3", "--window-len", "16",
                 "--kwta-k", "0.5", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())["result"]
    assert result["bos"]["id"] == (1 if adds_bos else None)
    assert result["tokens"] == 3 * (15 - adds_bos)
    assert len(result["dppl_windows"]) == 3 and result["dppl_stderr"] is not None
    assert result["window_construction"] in printed and "std error over 3 windows" in printed
    assert ("BOS <1> (id 1)" in printed) == adds_bos and ("no BOS" in printed) != adds_bos


@pytest.mark.parametrize("command", ["quality", "calibrate", "tune"])
def test_a_bad_bos_is_a_one_line_error(tmp_path, text, capsys, command):
    from ortsparse.cli import EXIT_USAGE

    extra = {"quality": [], "calibrate": ["-o", tmp_path / "c.json"], "tune": ["-o", tmp_path / "t"]}[command]
    argv = [command, GENAI, "--text", text, "--bos", "999", *extra]
    assert main([str(a) for a in argv]) == EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--bos 999 is outside the model's vocabulary of 256" in err[0], err
    assert not list(tmp_path.glob("c*.json")) and not (tmp_path / "t").exists()
