"""The technique registry: composition rules, generic overrides, a weight technique's own tensors,
and the CLI's --kwta=auto. Fake techniques stand in for ones that are not registered yet."""
from __future__ import annotations

import argparse
import dataclasses

import numpy as np
import pytest
import tiny_graphs as tg
from ortsparse.cli import config_from_args
from ortsparse.graph_rewrite import (
    ConfigError,
    KwtaSettings,
    RewriteConfig,
    parse_overrides,
    rewrite_model,
)
from ortsparse.graph_rewrite import compose as compose_module
from ortsparse.graph_rewrite.techniques import (
    BIAS,
    GATE,
    TECHNIQUES,
    WEIGHTS,
    OpBuild,
    Technique,
    TechniqueChoice,
    TechniqueSettings,
)


@dataclasses.dataclass(frozen=True)
class HalfSettings(TechniqueSettings):
    label = "half"
    scale: float = 0.5

    def attributes(self):
        return {"scale": float(self.scale)}


class FakeWeights(Technique):
    """Stores W * scale as its own initializer: enough to see the pass wire a technique's tensors."""

    kind = WEIGHTS
    settings_type = HalfSettings
    title = "fake"

    def __init__(self, name: str):
        self.name = name
        self.op_type = f"Fake{name.title()}MatMul"

    def add_arguments(self, parser):
        parser.add_argument(f"--{self.name}", choices=("on", "off"), default="off")

    def choice_from_args(self, args):
        return TechniqueChoice(HalfSettings(), enabled=getattr(args, self.name) == "on", target="mlp")

    def build(self, layer, settings, partners):
        return OpBuild(self.op_type, [layer.weight() * settings.scale, BIAS], settings.attributes(),
                       metadata={"ortsparse.fake": str(sorted(partners))}, notes=["fake build"])


@pytest.fixture()
def fakes(monkeypatch):
    for name in ("fakea", "fakeb"):
        monkeypatch.setitem(TECHNIQUES, name, FakeWeights(name))
    monkeypatch.setitem(compose_module.PARTNERS, "fakea", frozenset({"kwta"}))
    return TECHNIQUES


def test_kwta_alone_leads():
    assert compose_module.compose("l", {"kwta": KwtaSettings()}) == ("kwta", {})


def test_two_weight_techniques_on_one_layer_is_an_error_naming_the_layer(fakes):
    with pytest.raises(ConfigError, match="layer 'mlp.0'.*fakea and fakeb.*one weight backend"):
        compose_module.compose("mlp.0", {"fakea": HalfSettings(), "fakeb": HalfSettings()})


def test_weight_technique_leads_and_absorbs_allowed_gate(fakes):
    lead, partners = compose_module.compose("l", {"kwta": KwtaSettings(), "fakea": HalfSettings()})
    assert lead == "fakea" and list(partners) == ["kwta"]
    with pytest.raises(ConfigError, match="FakeFakebMatMul \\(fakeb\\) cannot be combined with kwta"):
        compose_module.compose("l", {"kwta": KwtaSettings(), "fakeb": HalfSettings()})


def test_weight_technique_emits_its_tensors_and_drops_the_unused_original(fakes):
    model = tg.llama_like()
    config = RewriteConfig(kwta_enabled=False,
                           techniques={"fakea": TechniqueChoice(HalfSettings(scale=2.0), enabled=True, target="down")})
    out, report = rewrite_model(model, config)
    nodes = [n for n in out.graph.node if n.op_type == "FakeFakeaMatMul"]
    assert len(nodes) == len(report.rewritten) == 2
    initializers = {t.name: t for t in out.graph.initializer}
    original = {t.name: t for t in model.graph.initializer}
    import onnx.numpy_helper as nh

    for node, record in zip(nodes, report.rewritten):
        stored = nh.to_array(initializers[node.input[1]])
        source = nh.to_array(original[record.weight])
        expected = source.T if stored.shape != source.shape else source
        np.testing.assert_array_equal(stored, expected * 2.0)
        assert record.weight not in initializers  # nothing else used it: dropped
        assert {p.key: p.value for p in node.metadata_props}["ortsparse.fake"] == "[]"
        assert record.attributes == {"scale": 2.0} and "fake build" in record.notes
        assert not record.exact


def test_overrides_take_any_registered_technique(fakes):
    entries = parse_overrides([{"match": "*down*", "fakea": {"scale": 3}}, {"match": "layer:0", "fakeb": "off"}])
    assert entries[0].setting("fakea") == {"scale": 3} and entries[1].setting("fakeb") == "off"
    with pytest.raises(ConfigError, match="unknown half setting.*nope"):
        parse_overrides([{"match": "*", "fakea": {"nope": 1}}])
    with pytest.raises(ConfigError, match="unknown key.*zzz.*valid: .*fakea, fakeb, kwta, match, off"):
        parse_overrides([{"match": "*", "zzz": {}}])
    config = RewriteConfig(overrides=entries, kwta_enabled=False)
    _, report = rewrite_model(tg.llama_like(), config)
    rewritten = report.rewritten
    assert rewritten and all("down" in r.name for r in rewritten)
    assert all(r.settings.scale == 3.0 and r.new_op == "FakeFakeaMatMul" for r in rewritten)


def test_config_rejects_unknown_or_mistyped_technique(fakes):
    with pytest.raises(ConfigError, match="unknown technique 'nope'"):
        RewriteConfig(techniques={"nope": TechniqueChoice(HalfSettings())})
    with pytest.raises(ConfigError, match="must be a HalfSettings"):
        RewriteConfig(techniques={"fakea": TechniqueChoice(KwtaSettings())})


def test_cli_kwta_auto_steps_aside_for_another_technique(fakes):
    from ortsparse.cli import add_technique_arguments

    parser = argparse.ArgumentParser()
    add_technique_arguments(parser)
    assert config_from_args(parser.parse_args([])).kwta_enabled
    config = config_from_args(parser.parse_args(["--fakea", "on"]))
    assert not config.kwta_enabled and config.choice("fakea").enabled
    assert config_from_args(parser.parse_args(["--fakea", "on", "--kwta", "on"])).kwta_enabled
    assert not config_from_args(parser.parse_args(["--kwta", "off"])).kwta_enabled
    assert GATE == TECHNIQUES["kwta"].kind
