"""The event technique in the rewriter: flags, composition with KWTA (prior in the same op), exact
settings verified in ORT, overrides."""
from __future__ import annotations

import argparse
import dataclasses

import numpy as np
import pytest
import tiny_graphs as tg
from ort_run import run_reference, token_feeds
from ortsparse.cli import add_technique_arguments, config_from_args
from ortsparse.graph_rewrite import ConfigError, parse_overrides, rewrite_model
from ortsparse.graph_rewrite.techniques import EventSettings


def config(*argv):
    parser = argparse.ArgumentParser()
    add_technique_arguments(parser)
    return config_from_args(parser.parse_args(list(argv)))


def attrs(node):
    import onnx
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def test_flags_make_event_ops_and_kwta_auto_steps_aside():
    out, report = rewrite_model(tg.llama_like(), config("--event-driven=on", "--event-topk=0.3",
                                                        "--event-delta-theta=0.02", "--event-budget-ms=2",
                                                        "--event-quorum=0.5", "--event-gap-tol=0.05",
                                                        "--event-axis=call"))
    ops = [n for n in out.graph.node if n.domain == "ai.ortsparse"]
    assert ops and all(n.op_type == "EventDrivenMatMul" for n in ops)
    a = attrs(ops[0])
    assert a["axis"] == b"call" and a["topk"] == pytest.approx(0.3) and a["budget_ms"] == pytest.approx(2.0)
    assert a["quorum"] == pytest.approx(0.5) and a["gap_tol"] == pytest.approx(0.05) and a["kwta_k"] == 0.0
    assert all(r.new_op == "EventDrivenMatMul" for r in report.rewritten)


def test_kwta_becomes_the_prior_of_the_same_op():
    out, report = rewrite_model(tg.llama_like(), config("--event-driven=on", "--kwta=on", "--kwta-k=0.25"))
    ops = [n for n in out.graph.node if n.domain == "ai.ortsparse"]
    assert ops and {n.op_type for n in ops} == {"EventDrivenMatMul"}  # one op per layer, never two
    assert all(attrs(n)["kwta_k"] == pytest.approx(0.25) for n in ops)
    assert all(list(r.partners) == ["kwta"] for r in report.rewritten)
    assert any("candidate prior" in note for r in report.rewritten for note in r.notes)


def test_targets_split_kwta_and_event_over_layer_classes():
    out, _ = rewrite_model(tg.llama_like(), config("--event-driven=on", "--event-target=attn", "--kwta=on",
                                                   "--kwta-target=mlp"))
    types = {n.op_type for n in out.graph.node if n.domain == "ai.ortsparse"}
    assert types == {"EventDrivenMatMul", "KwtaBlockMatMul"}


def test_exact_settings_rewrite_runs_like_the_original():
    model = tg.llama_like()
    out, report = rewrite_model(model, config("--event-driven=on", "--event-target=both", "--event-topk=1",
                                              "--event-delta-theta=0"))
    assert report.exact
    import ortsparse
    session = ortsparse.inference_session(out.SerializeToString())
    for seed in range(3):  # one session: later calls continue the streams of earlier ones
        feeds = token_feeds(model, seed=seed)
        for got, want in zip(session.run(None, feeds), run_reference(model, feeds)):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_override_entries_and_bad_settings():
    entries = parse_overrides([{"match": "*down*", "event": {"topk": 0.2, "axis": "call"}}])
    cfg = dataclasses.replace(config("--kwta=off"), overrides=entries)
    out, report = rewrite_model(tg.llama_like(), cfg)
    assert report.rewritten and all("down" in r.name and r.new_op == "EventDrivenMatMul" for r in report.rewritten)
    with pytest.raises(ConfigError, match="topk=0"):
        EventSettings(topk=0.0)
    with pytest.raises(ConfigError, match="axis='time'"):
        parse_overrides([{"match": "*", "event": {"axis": "time"}}])
    assert EventSettings(topk=1.0, delta_theta=0.0).is_exact(8) and not EventSettings().is_exact(8)


def test_every_event_flag_reaches_the_op():
    out, _ = rewrite_model(tg.llama_like(), config("--event-driven=on", "--event-stale-beta=0.9",
                                                   "--event-stale-lambda=0.2", "--event-age-max=5",
                                                   "--event-gap-every=8", "--event-block=4",
                                                   "--event-max-gated-rows=1"))
    a = attrs(next(n for n in out.graph.node if n.op_type == "EventDrivenMatMul"))
    assert a["stale_beta"] == pytest.approx(0.9) and a["stale_lambda"] == pytest.approx(0.2)
    assert (a["age_max"], a["gap_every"], a["block"], a["max_gated_rows"]) == (5, 8, 4, 1)
