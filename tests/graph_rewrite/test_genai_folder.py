"""rewrite-onnx on onnxruntime-genai folders (ortsparse.graph_rewrite.genai) and `ortsparse
genai-config`, on the tiny genai folder (the builder's graph of llama_tiny): the new folder runs in
onnxruntime_genai unchanged, the source is never modified, bad input writes nothing."""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import onnxruntime_genai as og
import pytest

from ortsparse.cli import main, rewrite_onnx_main
from ortsparse.graph_rewrite import KwtaSettings, ModelFileError, RewriteConfig, TechniqueChoice
from ortsparse.graph_rewrite.genai import (LIBRARY_FILE, is_folder_rewrite, library_state, refresh_genai_library,
                                           rewrite_genai_folder)
from ortsparse.runtime import KVDecoder, kv_layout, open_session

GENAI = Path(__file__).resolve().parents[2] / "models" / "tiny" / "llama_tiny_genai"
KWTA = RewriteConfig(techniques={"kwta": TechniqueChoice(KwtaSettings(k_frac=0.5), enabled=True, target="mlp")})
DENSE = RewriteConfig(techniques={"kwta": TechniqueChoice(KwtaSettings(), enabled=False)})
TOKENS = np.random.default_rng(2).integers(0, 256, size=24)


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture()
def source(tmp_path) -> Path:
    folder = tmp_path / "src"
    shutil.copytree(GENAI, folder)
    (folder / "chat_template.jinja").write_text("{{ messages }}")  # any other file must be carried over
    return folder


def generator_logits(folder: Path) -> np.ndarray:
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=64)
    generator = og.Generator(model, params)
    generator.append_tokens(TOKENS.astype(np.int32))
    return np.asarray(generator.get_logits()).reshape(-1)


def test_the_rewritten_folder_runs_in_onnxruntime_genai(source, tmp_path):
    before = digest(source)
    result = rewrite_genai_folder(source, tmp_path / "out", KWTA)
    out = tmp_path / "out"
    assert result.folder == out and result.library == out / LIBRARY_FILE
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["chat_template.jinja", "genai_config.json", LIBRARY_FILE, "model.onnx", "model.onnx.data", "ortsparse.json",
         "tokenizer.json", "tokenizer_config.json"])
    assert (out / "chat_template.jinja").read_text() == "{{ messages }}"
    config = json.loads((out / "genai_config.json").read_text())
    assert config["model"]["decoder"]["session_options"]["custom_ops_library"] == LIBRARY_FILE  # relative: inside
    assert digest(source) == before  # the source is never modified
    assert len(result.report.rewritten) == 6
    # the Generator (the app path) runs the gated graph: its logits are the ORT session's of that graph
    session = open_session(result.model_file)
    expected = KVDecoder(session, kv_layout(session, result.model_file)).advance(TOKENS)
    np.testing.assert_allclose(generator_logits(out), expected, atol=1e-4)
    assert not np.allclose(generator_logits(out), generator_logits(source), atol=1e-3)  # and it is gated
    record = json.loads((out / "ortsparse.json").read_text())
    assert record["library_sha256"] == hashlib.sha256((out / LIBRARY_FILE).read_bytes()).hexdigest()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ortsparse")]  # no staging left


def test_nothing_rewritten_needs_no_library(source, tmp_path):
    result = rewrite_genai_folder(source, tmp_path / "out", DENSE)
    assert result.library is None and not (tmp_path / "out" / LIBRARY_FILE).exists()
    config = json.loads((tmp_path / "out" / "genai_config.json").read_text())
    assert "custom_ops_library" not in config["model"]["decoder"]["session_options"]
    np.testing.assert_allclose(generator_logits(tmp_path / "out"), generator_logits(source), atol=1e-5)


def test_an_earlier_output_is_replaced_and_other_paths_are_refused(source, tmp_path):
    out = tmp_path / "out"
    rewrite_genai_folder(source, out, KWTA)
    rewrite_genai_folder(source, out, DENSE)  # written by us: replaced
    assert not (out / LIBRARY_FILE).exists()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ModelFileError, match="not written by ortsparse"):
        rewrite_genai_folder(source, foreign, KWTA)
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]


def break_config(folder: Path, how: str) -> None:
    if how == "no config":
        (folder / "genai_config.json").unlink()
    elif how == "not json":
        (folder / "genai_config.json").write_text("{ nope")
    elif how == "missing model":
        (folder / "model.onnx").unlink()
    elif how == "missing data":
        (folder / "model.onnx.data").unlink()
    elif how == "no filename":
        config = json.loads((folder / "genai_config.json").read_text())
        del config["model"]["decoder"]["filename"]
        (folder / "genai_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("how, message", [
    ("no config", "has no genai_config.json"), ("not json", "not valid JSON"),
    ("missing model", "names the decoder model model.onnx, which does not exist"),
    ("missing data", "external data that is missing"), ("no filename", "filename is missing")])
def test_bad_folders_are_one_line_errors_and_write_nothing(source, tmp_path, capsys, how, message):
    break_config(source, how)
    with pytest.raises(ModelFileError, match=message):
        rewrite_genai_folder(source, tmp_path / "out", KWTA)
    capsys.readouterr()
    assert rewrite_onnx_main([str(source), "-o", str(tmp_path / "out"), "--kwta-target", "mlp"]) == 2
    err = capsys.readouterr().err
    assert message.split()[0] in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # nothing written, no staging left


def test_outputs_that_would_touch_the_source_are_refused(source, tmp_path):
    for output in (source, source / "inner"):
        with pytest.raises(ModelFileError, match="source folder"):
            rewrite_genai_folder(source, output, KWTA)
    with pytest.raises(ModelFileError, match="contains the source"):
        rewrite_genai_folder(source, tmp_path, KWTA)
    (tmp_path / "file.onnx").write_bytes(b"x")
    with pytest.raises(ModelFileError, match="is a file"):
        rewrite_genai_folder(source, tmp_path / "file.onnx", KWTA)


def test_cli_takes_the_folder_or_its_model_file(source, tmp_path, capsys):
    assert is_folder_rewrite(source, tmp_path / "a") and is_folder_rewrite(source / "model.onnx", tmp_path / "a")
    assert not is_folder_rewrite(source / "model.onnx", tmp_path / "a.onnx")  # a plain model file out
    assert rewrite_onnx_main([str(source), "-o", str(tmp_path / "a"), "--kwta-target", "mlp", "--verify", "1"]) == 0
    out = capsys.readouterr().out
    assert "onnxruntime-genai folder" in out and "verify: PASSED" in out
    assert rewrite_onnx_main([str(source / "model.onnx"), "-o", str(tmp_path / "b"), "-q"]) == 0
    assert (tmp_path / "b" / "genai_config.json").is_file()
    assert rewrite_onnx_main([str(source / "model.onnx"), "-o", str(tmp_path / "c.onnx"), "-q", "--no-check"]) == 0
    assert (tmp_path / "c.onnx").is_file() and not (tmp_path / "c.onnx").is_dir()
    assert rewrite_onnx_main([str(source), "--list-layers"]) == 0
    assert "qkv_proj" in capsys.readouterr().out


def test_genai_config_refreshes_an_outdated_library_copy(source, tmp_path, capsys):
    out = tmp_path / "out"
    rewrite_genai_folder(source, out, KWTA)
    assert main(["genai-config", str(out), "--check"]) == 0
    (out / LIBRARY_FILE).write_bytes(b"an older build")
    config = json.loads((out / "genai_config.json").read_text())
    del config["model"]["decoder"]["session_options"]["custom_ops_library"]
    (out / "genai_config.json").write_text(json.dumps(config))
    assert main(["genai-config", str(out), "--check"]) == 1
    assert "refreshes it" in capsys.readouterr().out
    assert main(["genai-config", str(out)]) == 0
    state = library_state(out)
    assert state["current"] and state["configured"] == LIBRARY_FILE
    assert refresh_genai_library(out)["changed"] is False
    generator_logits(out)  # runs again
    assert main(["genai-config", str(source)]) == 0  # a dense folder: nothing to do
    assert "no library needed" in capsys.readouterr().out
    assert main(["genai-config", str(tmp_path / "nowhere")]) == 2


def test_attention_values_onnxruntime_runs_as_off_give_a_loadable_folder(source, tmp_path, capsys):
    """issue 23: GroupQueryAttention with softcap=-1 / local_window_size=-7 (onnxruntime: none) ended a
    folder rewrite with --attn=popcount in a "(a bug)" traceback; now the values are written as the
    op's "off" and the folder loads and generates as the source does."""
    import onnx

    decoder = source / "model.onnx"
    model = onnx.load(str(decoder), load_external_data=False)
    for node in model.graph.node:
        if node.op_type == "GroupQueryAttention":
            kept = [a for a in node.attribute if a.name not in ("softcap", "local_window_size")]
            del node.attribute[:]
            node.attribute.extend(kept + [onnx.helper.make_attribute("softcap", -1.0),
                                          onnx.helper.make_attribute("local_window_size", -7)])
    onnx.save(model, str(decoder))
    expected = generator_logits(source)
    out = tmp_path / "out"
    assert rewrite_onnx_main([str(source), "-o", str(out), "--attn", "popcount", "-q"]) == 0, \
        capsys.readouterr().err
    rewritten = onnx.load(str(out / "model.onnx"), load_external_data=False)
    assert any(n.op_type == "PopcountGroupQueryAttention" for n in rewritten.graph.node)
    np.testing.assert_allclose(generator_logits(out), expected, rtol=1e-4, atol=1e-4)


def test_a_decoder_that_would_not_load_is_exit_2_and_nothing_written(source, tmp_path, monkeypatch, capsys):
    """The folder's last check (the whole decoder opened in ONNX Runtime) is a one-line exit 2, not a
    traceback: forced here by a rule that copies a refused value and the node check switched off."""
    import onnx

    from ortsparse.graph_rewrite import genai
    from ortsparse.graph_rewrite.attention_rules import ms_group_query_attention as rule

    decoder = source / "model.onnx"
    model = onnx.load(str(decoder), load_external_data=False)
    for node in model.graph.node:
        if node.op_type == "GroupQueryAttention":
            kept = [a for a in node.attribute if a.name != "softcap"]
            del node.attribute[:]
            node.attribute.extend(kept + [onnx.helper.make_attribute("softcap", -1.0)])
    onnx.save(model, str(decoder))
    monkeypatch.setattr(rule, "_as_onnxruntime_runs_them", lambda attributes: attributes)
    monkeypatch.setattr(genai, "check_nodes_load", lambda model: None)
    out = tmp_path / "out"
    assert rewrite_onnx_main([str(source), "-o", str(out), "--attn", "popcount", "-q"]) == 2
    err = capsys.readouterr().err
    assert "would not load in ONNX Runtime" in err and "softcap=-1" in err and "Traceback" not in err, err
    assert not out.exists()
