"""com.microsoft.GroupQueryAttention -> ai.ortsparse.PopcountGroupQueryAttention (rule
attention_ms_gqa): the node is swapped in place (same inputs, outputs and attributes plus the
selection settings), near-misses say why, --attn=popcount alone means the recommended setting of the
form, and the real onnxruntime-genai SmolLM2 folders (fp32, int8, int4) are rewritten whole and run
in onnxruntime_genai's Generator (slow)."""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import ortsparse
from ortsparse.graph_rewrite import RewriteConfig, list_layers, rewrite_model
from ortsparse.graph_rewrite.techniques.popcount import GQA_RECOMMENDED, AttentionSettings

EXACT = RewriteConfig(attention=AttentionSettings(select="none"))
H, HKV, D, HIDDEN = 4, 2, 16, 32


def genai_layer(*, packed=True, rotary=True, dtype=TensorProto.FLOAT, extra_inputs=(), outputs=3, **attrs):
    """One decoder layer's attention as the model builder writes it: x -> MatMul(Wqkv) -> GQA with the
    KV cache as graph inputs / outputs, seqlens_k and total_sequence_length graph inputs."""
    rng = np.random.default_rng(0)
    width = (H + 2 * HKV) * D if packed else H * D
    nodes = [helper.make_node("MatMul", ["x", "w_q"], ["q"], name="/layers.0/attn/q_proj/MatMul")]
    inits = [numpy_helper.from_array(rng.standard_normal((HIDDEN, width)).astype(np.float32) * 0.2, "w_q")]
    if not packed:
        for n in ("k", "v"):
            nodes.append(helper.make_node("MatMul", ["x", f"w_{n}"], [n], name=f"/layers.0/attn/{n}_proj/MatMul"))
            inits.append(numpy_helper.from_array(rng.standard_normal((HIDDEN, HKV * D)).astype(np.float32) * 0.2,
                                                 f"w_{n}"))
    if rotary:
        angle = rng.random((64, D // 2)).astype(np.float32) * 6.28
        inits += [numpy_helper.from_array(np.cos(angle), "cos_cache"), numpy_helper.from_array(np.sin(angle), "sin_cache")]
    inputs = ["q", "" if packed else "k", "" if packed else "v", "past_key", "past_value", "seqlens_k", "total",
              "cos_cache" if rotary else "", "sin_cache" if rotary else "", *extra_inputs]
    node_attrs = dict(num_heads=H, kv_num_heads=HKV, scale=0.25, do_rotary=int(rotary), rotary_interleaved=0,
                      local_window_size=-1, softcap=0.0)
    node_attrs.update(attrs)
    outs = ["attn_out", "present_key", "present_value", "output_qk"][:outputs]
    nodes.append(helper.make_node("GroupQueryAttention", inputs, outs, name="/layers.0/attn/GroupQueryAttention",
                                  domain="com.microsoft", **node_attrs))
    graph_inputs = [helper.make_tensor_value_info("x", dtype, ["b", "s", HIDDEN]),
                    helper.make_tensor_value_info("past_key", dtype, ["b", HKV, "p", D]),
                    helper.make_tensor_value_info("past_value", dtype, ["b", HKV, "p", D]),
                    helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["b"]),
                    helper.make_tensor_value_info("total", TensorProto.INT32, [])]
    for name in extra_inputs:
        if name:
            graph_inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, None))
    graph_outputs = [helper.make_tensor_value_info("attn_out", dtype, ["b", "s", H * D]),
                     helper.make_tensor_value_info("present_key", dtype, ["b", HKV, "t", D]),
                     helper.make_tensor_value_info("present_value", dtype, ["b", HKV, "t", D])]
    if outputs > 3:
        graph_outputs.append(helper.make_tensor_value_info("output_qk", dtype, None))
    graph = helper.make_graph(nodes, "layer", graph_inputs, graph_outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
                             ir_version=9)


def gqa_nodes(model):
    return [n for n in model.graph.node if n.op_type == "PopcountGroupQueryAttention" and n.domain == "ai.ortsparse"]


def attrs_of(node):
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def feeds(rng, past=6, new=1):
    x = rng.standard_normal((1, new, HIDDEN)).astype(np.float32)
    pk = np.zeros((1, HKV, 16, D), np.float32)
    pv = np.zeros((1, HKV, 16, D), np.float32)
    pk[:, :, :past] = rng.standard_normal((1, HKV, past, D))
    pv[:, :, :past] = rng.standard_normal((1, HKV, past, D))
    return {"x": x, "past_key": pk, "past_value": pv, "seqlens_k": np.array([past + new - 1], np.int32),
            "total": np.array(past + new, np.int32)}


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("rotary", [True, False])
def test_swapped_in_place_and_exact(packed, rotary, rng):
    model = genai_layer(packed=packed, rotary=rotary)
    out, report = rewrite_model(model, EXACT)
    (node,) = gqa_nodes(out)
    assert not [n for n in out.graph.node if n.op_type == "GroupQueryAttention"]
    assert list(node.output) == ["attn_out", "present_key", "present_value"]
    assert [o.name for o in out.graph.output] == ["attn_out", "present_key", "present_value"]
    a = attrs_of(node)
    assert a["num_heads"] == H and a["kv_num_heads"] == HKV and a["scale"] == 0.25 and a["select"] == b"none"
    assert a["do_rotary"] == int(rotary) and a["verify_keys"] == 0
    record = report.attention[0]
    assert record.rule == "attention_ms_gqa" and record.new_op == "PopcountGroupQueryAttention"
    assert ("packed QKV" if packed else "separate Q, K, V") in record.notes
    data = feeds(rng)
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, data)
    actual = ortsparse.inference_session(out).run(None, data)
    np.testing.assert_allclose(actual[0], expected[0], rtol=1e-5, atol=1e-6)
    assert np.array_equal(actual[1], expected[1]) and np.array_equal(actual[2], expected[2])


def test_window_sized_kv_buffers_are_swapped_in_place_and_exact(rng):
    """sliding_window_cache=1 (the builder's default for sliding-window layers): taken, the attribute
    passed through; the rewritten layer matches onnxruntime's over a decode that evicts rows."""
    model = genai_layer(local_window_size=8, sliding_window_cache=1)
    out, report = rewrite_model(model, EXACT)
    (node,) = gqa_nodes(out)
    a = attrs_of(node)
    assert a["sliding_window_cache"] == 1 and a["local_window_size"] == 8
    assert "local window 8 (window-sized KV buffers)" in report.attention[0].notes
    theirs = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    ours = ortsparse.inference_session(out)
    kv = {"theirs": [np.zeros((1, HKV, 10, D), np.float32)] * 2, "ours": [np.zeros((1, HKV, 10, D), np.float32)] * 2}
    for total in range(1, 30):  # capacity 10, window 8: rows evicted 3 at a time from step 11 on
        x = rng.standard_normal((1, 1, HIDDEN)).astype(np.float32)
        outputs = {}
        for name, session in (("theirs", theirs), ("ours", ours)):
            outputs[name] = session.run(None, {"x": x, "past_key": kv[name][0], "past_value": kv[name][1],
                                               "seqlens_k": np.array([total - 1], np.int32),
                                               "total": np.array(total, np.int32)})
            kv[name] = outputs[name][1:]
        np.testing.assert_allclose(outputs["ours"][0], outputs["theirs"][0], rtol=1e-5, atol=1e-6)
        resident = total if total <= 10 else total - 3 * -(-(total - 10) // 3)
        for mine, theirs_kv in zip(outputs["ours"][1:], outputs["theirs"][1:]):
            assert np.array_equal(mine[:, :, :resident], theirs_kv[:, :, :resident])


@pytest.mark.parametrize("kwargs,reason", [
    (dict(extra_inputs=("", "", "", "k_scale")), "uses input(s) 12 (k_scale)"),
    (dict(qk_output=1), "qk_output=1"),
    (dict(outputs=4), "output_qk in use"),
    (dict(sliding_window_cache=1), "sliding_window_cache=1 without past_key / past_value or local_window_size > 0"),
    (dict(k_quant_type="PER_CHANNEL"), "k_quant_type='PER_CHANNEL'"),
    (dict(kv_cache_bit_width=4), "kv_cache_bit_width"),
    (dict(dtype=TensorProto.FLOAT16), "has dtype FLOAT16"),
    (dict(rotary=False, do_rotary=1), "do_rotary=1 but no cos_cache / sin_cache"),
])
def test_near_misses_say_why(kwargs, reason):
    model = genai_layer(**kwargs)
    report = list_layers(model, EXACT)
    record = report.attention[0]
    assert not record.rewritten and reason in record.reason, record.reason
    out, _ = rewrite_model(model, EXACT)
    assert not gqa_nodes(out)


def test_extra_inputs_are_passed_through(rng):
    model = genai_layer(extra_inputs=("", "", "head_sink"), smooth_softmax=1)
    out, report = rewrite_model(model, EXACT)
    (node,) = gqa_nodes(out)
    assert list(node.input)[11] == "head_sink" and attrs_of(node)["smooth_softmax"] == 1
    data = {**feeds(rng), "head_sink": rng.standard_normal(H).astype(np.float32)}
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, data)
    actual = ortsparse.inference_session(out).run(None, data)
    np.testing.assert_allclose(actual[0], expected[0], rtol=1e-5, atol=1e-6)


def _config(argv):
    from ortsparse.cli import add_rewrite_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_rewrite_arguments(parser)
    return config_from_args(parser.parse_args(["in.onnx", *argv]))


@pytest.mark.parametrize("argv,expected", [
    (["--attn=popcount"], GQA_RECOMMENDED),
    (["--attn=popcount", "--attn-topk=64"], AttentionSettings(select="popcount", topk=64)),
    (["--attn=pages", "--attn-page-size=8", "--attn-verify-keys=1", "--attn-candidates=0"],
     AttentionSettings(select="pages", page_size=8, verify_keys=1, candidates=0.0)),
    (["--attn=none"], AttentionSettings(select="none")),
    # the event flags keep the recommended selection and add reuse on top
    (["--attn=popcount", "--attn-event=1", "--attn-event-topk=0.5", "--attn-event-gap-tol=0.1"],
     dataclasses.replace(GQA_RECOMMENDED, event=1, event_topk=0.5, event_gap_tol=0.1)),
    # the event-driven flags on attention mean the same per head (age 0 = no limit)
    (["--attn=popcount", "--event-driven=on", "--event-target=attn", "--event-topk=0.25", "--event-gap-every=16"],
     dataclasses.replace(GQA_RECOMMENDED, event=1, event_topk=0.25, event_gap_every=16, event_age_max=2**31 - 1)),
    (["--attn=popcount", "--event-driven=on", "--event-target=both", "--event-age-max=5", "--attn-event=1"],
     dataclasses.replace(GQA_RECOMMENDED, event=1)),  # --attn-event's own settings win
    (["--attn=popcount", "--event-driven=on", "--event-target=mlp"], GQA_RECOMMENDED),
    (["--attn=popcount", "--attn-topk=64", "--event-driven=on", "--event-target=attn"],
     AttentionSettings(select="popcount", topk=64)),  # no page selector: nothing to reuse
    # selective prefill, like the event flags, keeps the recommended selection for decode
    (["--attn=popcount", "--attn-prefill=budget", "--attn-prefill-budget=512"],
     dataclasses.replace(GQA_RECOMMENDED, prefill_select="budget", prefill_budget=512)),
    (["--attn=none", "--attn-prefill=certified", "--attn-prefill-eps=0.01"],
     AttentionSettings(select="none", prefill_select="certified", prefill_eps=0.01)),
    # mass mode: the page selector's per-row budget, written only when on
    (["--attn=pages", "--attn-candidates=8", "--attn-keep-first=4", "--attn-keep-recent=256", "--attn-min-keys=2048",
      "--attn-mass-eps=0.01"],
     AttentionSettings(select="pages", candidates=8.0, keep_first=4, keep_recent=256, min_keys=2048, mass_eps=0.01)),
])
def test_flags_give_the_node_its_settings(argv, expected):
    out, report = rewrite_model(genai_layer(), _config(argv))
    (node,) = gqa_nodes(out)
    assert report.attention[0].settings == expected
    a = attrs_of(node)
    for name, value in expected.gqa_attributes().items():
        got = a[name].decode() if isinstance(a[name], bytes) else a[name]
        assert got == pytest.approx(value), name
    assert ("event" in a) == bool(expected.event)  # written only when on
    assert ("prefill_select" in a) == (expected.prefill_select != "exact")  # written only when not exact
    assert ("mass_eps" in a) == (expected.mass_eps > 0)  # written only when on


@pytest.mark.parametrize("argv", [["--attn=popcount", "--attn-topk=64"], ["--attn=pages", "--attn-candidates=0"],
                                  ["--attn=energy"], ["--attn=none"]])
def test_attn_event_without_the_budgeted_page_selector_is_refused(argv):
    """--attn-event=1 on a core whose selection it cannot reuse: a ConfigError naming the core (it used
    to be written and do nothing); --attn=popcount alone keeps meaning the recommended page setting."""
    from ortsparse.graph_rewrite import ConfigError

    with pytest.raises(ConfigError, match=r"attention core '.*' \(com\.microsoft\.GroupQueryAttention\): --attn-event=1"):
        rewrite_model(genai_layer(), _config([*argv, "--attn-event=1"]))


@pytest.mark.parametrize("argv, meaning", [
    (["--attn=popcount"], True), (["--attn=popcount", "--attn-topk=64"], False), (["--attn=pages"], False)])
def test_the_report_says_what_the_flags_mean_on_this_form(argv, meaning):
    """--attn=popcount alone means the form's recommended setting on a GroupQueryAttention core:
    stated once (techniques.popcount.FORMS) and printed in the rewrite report, record and summary."""
    from ortsparse.graph_rewrite.techniques.popcount import ATTENTION, GQA_FORM

    report = rewrite_model(genai_layer(), _config(argv))[1]
    (record,) = report.attention
    stated = f"--attn=popcount on {GQA_FORM} cores means {GQA_RECOMMENDED.short()}: {ATTENTION.form(GQA_FORM).why}"
    assert record.meaning == (stated if meaning else "")
    assert (f"  {stated}" in report.summary().splitlines()) == meaning
    assert record.to_dict()["meaning"] == record.meaning


def test_attention_is_built_like_a_technique():
    from ortsparse.graph_rewrite.techniques import ATTENTION, CORE_TECHNIQUES, TECHNIQUES, flag_groups
    from ortsparse.graph_rewrite.techniques.popcount import GQA_FORM, GQA_OP_TYPE, OP_TYPE

    assert CORE_TECHNIQUES == {"attention": ATTENTION} and "attention" not in TECHNIQUES  # no per-layer key
    assert flag_groups()[-1] is ATTENTION.flag_group()
    assert ATTENTION.build(GQA_FORM, AttentionSettings())[:2] == (GQA_OP_TYPE, GQA_RECOMMENDED)
    assert ATTENTION.build("eager", AttentionSettings())[:2] == (OP_TYPE, AttentionSettings())
    pages = AttentionSettings(select="pages")
    assert ATTENTION.build(GQA_FORM, pages) == (GQA_OP_TYPE, pages, "")


def test_recommended_setting_is_selective_and_valid():
    assert GQA_RECOMMENDED.select == "pages" and not GQA_RECOMMENDED.exact
    assert AttentionSettings(select="popcount").for_form("eager") == AttentionSettings(select="popcount")


def test_linear_rewrite_of_the_projection_feeds_the_new_node(rng):
    """KWTA on the QKV projection and the attention swap in one pass: the new node reads the KWTA output."""
    from configs import kwta

    model = genai_layer()
    out, report = rewrite_model(model, kwta("all", k_frac=1.0, attention=AttentionSettings(select="none")))
    (node,) = gqa_nodes(out)
    producer = {o: n for n in out.graph.node for o in n.output}[node.input[0]]
    assert producer.op_type == "KwtaBlockMatMul"
    data = feeds(rng)
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, data)
    actual = ortsparse.inference_session(out).run(None, data)
    np.testing.assert_allclose(actual[0], expected[0], rtol=1e-5, atol=1e-6)


def test_a_rewritten_node_is_no_candidate_again():
    out, _ = rewrite_model(genai_layer(), EXACT)
    report = list_layers(out, EXACT)
    assert report.attention == [] and report.attention_cores == 1


# -- real onnxruntime-genai folders ------------------------------------------------------------

MODELS = Path.home() / ".cache" / "ortsparse" / "models" / "smollm2"


def _greedy(folder: Path, ids, n: int):
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(ids) + n, batch_size=1)
    generator = og.Generator(model, params)
    generator.append_tokens(np.asarray(ids, dtype=np.int32))
    out = []
    while not generator.is_done() and len(out) < n:
        generator.generate_next_token()
        out.append(int(generator.get_next_tokens()[0]))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["genai-fp32", "genai-int8", "genai-int4"])
@pytest.mark.parametrize("argv", [["--attn=none"], ["--attn=popcount"]], ids=["none", "popcount"])
def test_genai_folders_are_rewritten_and_generate(variant, argv, tmp_path):
    pytest.importorskip("onnxruntime_genai")
    from ortsparse.graph_rewrite.genai import LIBRARY_FILE, rewrite_genai_folder

    source = MODELS / variant
    if not (source / "genai_config.json").is_file():
        pytest.skip(f"{source} missing (build the genai models first)")
    out = tmp_path / variant
    report = rewrite_genai_folder(source, out, _config(argv)).report
    done = [a for a in report.attention if a.rewritten]
    assert len(done) == 30 and all(a.rule == "attention_ms_gqa" for a in done)
    config = json.loads((out / "genai_config.json").read_text())
    assert config["model"]["decoder"]["session_options"]["custom_ops_library"] == LIBRARY_FILE
    assert (out / LIBRARY_FILE).is_file()
    ids = np.load(MODELS / "corpus_britannica.npy")[:120].tolist()
    tokens = _greedy(out, ids, 20)
    assert len(tokens) == 20
    if variant == "genai-fp32" and argv == ["--attn=none"]:
        assert tokens == _greedy(source, ids, 20)


@pytest.mark.parametrize("attrs", [
    dict(softcap=-1.0), dict(softcap=-0.0), dict(softcap=float("nan")), dict(softcap=float("-inf")),
    dict(local_window_size=-7), dict(local_window_size=-1000), dict(smooth_softmax=2), dict(smooth_softmax=-1),
    dict(do_rotary=2), dict(rotary=True, rotary_interleaved=5),
])
def test_values_onnxruntime_runs_as_off_are_normalised(attrs, rng):
    """onnxruntime 1.32 runs softcap <= 0 (or NaN) as no soft-cap, local_window_size < 0 as no window
    and do_rotary / rotary_interleaved / smooth_softmax != 1 as off; the node written loads and
    matches (issue 23: softcap=-1 and local_window_size=-7 were copied into a node the op refuses)."""
    model = genai_layer(**attrs)
    out, report = rewrite_model(model, EXACT)
    (node,) = gqa_nodes(out)
    a = attrs_of(node)
    assert a.get("softcap", 0.0) == 0.0 or a["softcap"] > 0
    assert a.get("local_window_size", -1) >= -1
    assert all(a.get(flag, 0) in (0, 1) for flag in ("do_rotary", "rotary_interleaved", "smooth_softmax"))
    data = feeds(rng)
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, data)
    actual = ortsparse.inference_session(out).run(None, data)
    np.testing.assert_allclose(actual[0], expected[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("attrs,reason", [
    (dict(scale=-1.0), "scale=-1"),
    (dict(scale=float("nan")), "scale=nan"),
    (dict(softcap=float("inf")), "softcap=inf"),
    (dict(num_heads=3), "num_heads=3"),
    (dict(causal=0, local_window_size=4), "local_window_size=4 with causal=0"),
])
def test_values_the_op_refuses_leave_the_node_with_a_reason(attrs, reason):
    """Never write a node the library refuses: the GroupQueryAttention stays, the report says why."""
    model = genai_layer(**attrs)
    record = list_layers(model, EXACT).attention[0]
    assert not record.rewritten and reason in record.reason, record.reason
    out, _ = rewrite_model(model, EXACT)
    assert not gqa_nodes(out)


def test_cli_rewrite_of_a_none_softcap_writes_a_loadable_model(tmp_path, rng):
    """The reported case end to end: `rewrite-onnx --attn=popcount` exit 0 and a model that loads."""
    from ortsparse.cli import main

    src, out = tmp_path / "gqa.onnx", tmp_path / "out.onnx"
    model = genai_layer(softcap=-1.0, local_window_size=-7)
    src.write_bytes(model.SerializeToString())
    assert main(["rewrite", str(src), "-o", str(out), "--attn", "popcount", "-q"]) == 0
    data = feeds(rng)
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, data)
    actual = ortsparse.inference_session(str(out)).run(None, data)
    np.testing.assert_allclose(actual[0], expected[0], rtol=1e-5, atol=1e-6)


def test_self_check_refuses_to_write_a_node_the_library_refuses(tmp_path, monkeypatch, capsys):
    """The rewriter's self-check (graph_rewrite/load_check.py): a rule that slipped (here: one made
    to copy softcap=-1 through again) makes rewrite-onnx exit 2 naming the node, and writes nothing."""
    from ortsparse.cli import main
    from ortsparse.graph_rewrite.attention_rules import ms_group_query_attention as rule

    monkeypatch.setattr(rule, "_as_onnxruntime_runs_them", lambda attributes: attributes)
    src, out = tmp_path / "gqa.onnx", tmp_path / "out.onnx"
    src.write_bytes(genai_layer(softcap=-1.0).SerializeToString())
    assert main(["rewrite", str(src), "-o", str(out), "--attn", "popcount", "-q"]) == 2
    err = capsys.readouterr().err
    assert "PopcountGroupQueryAttention node '" in err and "softcap=-1" in err and "Traceback" not in err, err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["gqa.onnx"]
