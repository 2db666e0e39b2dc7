"""The state-pack technique: flags, settings, composition with KWTA, and the rewritten model."""
from __future__ import annotations

import argparse

import onnx
import pytest
import tiny_graphs as tg
from configs import kwta, without_kwta
from ort_run import assert_same_outputs, kwta_nodes, token_feeds
from ortsparse.cli import add_technique_arguments, config_from_args
from ortsparse.graph_rewrite import ConfigError, KwtaSettings, RewriteConfig, parse_overrides, rewrite_model
from ortsparse.graph_rewrite import compose as compose_module
from ortsparse.graph_rewrite.techniques import PackSettings, TechniqueChoice


def parse(argv):
    parser = argparse.ArgumentParser()
    add_technique_arguments(parser)
    return config_from_args(parser.parse_args(argv))


def attrs(node):
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def test_flags():
    config = parse(["--state-pack=ternary", "--state-pack-eps", "0", "--state-pack-popcnt",
                    "--state-pack-density-max", "0.5"])
    choice = config.choice("pack")
    assert choice.enabled and choice.target == "down"
    assert choice.settings == PackSettings(mode="ternary", eps=0.0, density_max=0.5)
    assert not config.choice("kwta").enabled  # --kwta=auto steps aside
    assert not parse([]).choice("pack").enabled


@pytest.mark.parametrize("bad,message", [
    (dict(mode="quad"), "mode='quad'"), (dict(eps=-1.0), "eps=-1.0"), (dict(density_max=0.0), "density_max=0.0"),
])
def test_bad_settings(bad, message):
    with pytest.raises(ConfigError, match=message):
        PackSettings(**bad)


def test_exact_rewrite_of_down_projections():
    model = tg.llama_like()
    config = RewriteConfig(techniques={  # KWTA's auto steps aside for the library caller too
        "pack": TechniqueChoice(PackSettings(eps=0.0, density_max=1.0), enabled=True, target="down")})
    out, report = rewrite_model(model, config)
    onnx.checker.check_model(out, full_check=True)
    nodes = kwta_nodes(out)
    assert len(nodes) == len(report.rewritten) == 2 and all("down" in r.name for r in report.rewritten)
    for node in nodes:
        a = attrs(node)
        assert a["pack_mode"] == b"binary" and a["pack_eps"] == 0.0 and a["k_frac"] == 1.0
    assert report.exact
    assert_same_outputs(model, out, token_feeds(model))


def test_composed_with_kwta_in_one_op():
    assert compose_module.compose("l", {"kwta": KwtaSettings(), "pack": PackSettings()}) == (
        "pack", {"kwta": KwtaSettings()})
    model = tg.llama_like()
    config = kwta("down", k_frac=0.5, techniques={
        "pack": TechniqueChoice(PackSettings(eps=0.0), enabled=True, target="down")})
    out, report = rewrite_model(model, config)
    nodes = kwta_nodes(out)
    assert len(nodes) == 2
    a = attrs(nodes[0])
    assert a["k_frac"] == 0.5 and a["pack_mode"] == b"binary"
    assert not report.exact
    with pytest.raises(ConfigError, match="duty=1"):
        rewrite_model(model, kwta("down", duty=2, techniques={
            "pack": TechniqueChoice(PackSettings(), enabled=True, target="down")}))


def test_override_entry():
    entries = parse_overrides([{"match": "*down*", "pack": {"mode": "ternary", "eps": 0.01}}])
    _, report = rewrite_model(tg.llama_like(), without_kwta(overrides=entries))
    assert report.rewritten and all(r.settings.mode == "ternary" for r in report.rewritten)
