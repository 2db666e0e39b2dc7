"""The technique registry: composition rules, generic overrides, a weight technique's own tensors,
flags declared as data, and KWTA's auto (resolved by RewriteConfig, for the CLI and library callers
alike). Fake techniques stand in for ones that are not registered yet."""
from __future__ import annotations

import argparse
import dataclasses

import numpy as np
import pytest
import tiny_graphs as tg
from ortsparse.cli import config_from_args
from configs import kwta as kwta_config
from ortsparse.graph_rewrite import (
    ConfigError,
    KwtaSettings,
    LayerOverride,
    RewriteConfig,
    parse_overrides,
    rewrite_model,
)
from ortsparse.graph_rewrite import compose as compose_module
from ortsparse.graph_rewrite.techniques import (
    AUTO,
    BIAS,
    GATE,
    TARGET,
    TECHNIQUES,
    WEIGHTS,
    Flag,
    OpBuild,
    Switch,
    Technique,
    TechniqueChoice,
    TechniqueSettings,
    flag_groups,
)
from ortsparse.graph_rewrite.techniques.popcount import AttentionSettings


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
        self.switch = Switch(f"--{name}", choices=("on", "off"), default="off", help="fake")
        self.flags = (Flag(f"--{name}-target", field=TARGET, choices=("mlp", "all"), default="mlp", help="layers"),
                      Flag(f"--{name}-scale", field="scale", type=float, default=0.5, help="scale"))

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
    config = RewriteConfig(techniques={"fakea": TechniqueChoice(HalfSettings(scale=2.0), enabled=True, target="down")})
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
    with pytest.raises(ConfigError, match="unknown key.*zzz.*valid: .*fakea, fakeb, kwta, match, node, off"):
        parse_overrides([{"match": "*", "zzz": {}}])
    config = RewriteConfig(overrides=entries, techniques={"kwta": TechniqueChoice(KwtaSettings(), enabled=False)})
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
    assert config_from_args(parser.parse_args([])).choice("kwta").enabled
    config = config_from_args(parser.parse_args(["--fakea", "on", "--fakea-scale", "3"]))
    assert not config.choice("kwta").enabled and config.choice("fakea").enabled
    assert config.choice("fakea").settings == HalfSettings(scale=3.0)
    assert config_from_args(parser.parse_args(["--fakea", "on", "--kwta", "on"])).choice("kwta").enabled
    assert not config_from_args(parser.parse_args(["--kwta", "off"])).choice("kwta").enabled
    assert GATE == TECHNIQUES["kwta"].kind


def test_library_resolves_kwta_auto_like_the_cli(fakes):
    """A library caller who turns another technique on gets no KWTA (and no composition error)."""
    assert RewriteConfig().choice("kwta").enabled
    assert TECHNIQUES["kwta"].default_choice().enabled == AUTO
    on = TechniqueChoice(HalfSettings(), enabled=True, target="mlp")
    config = RewriteConfig(techniques={"fakeb": on})  # fakeb takes no KWTA partner
    assert not config.choice("kwta").enabled
    assert config.off_reason("kwta") == "--kwta=auto (off: --fakeb=on)"
    _, report = rewrite_model(tg.llama_like(), config)
    assert {r.new_op for r in report.rewritten} == {"FakeFakebMatMul"}
    assert all("--kwta" not in r.reason for r in report.skipped)  # auto-off KWTA is no noise in reasons
    attention = RewriteConfig(attention=AttentionSettings(select="none"))
    assert not attention.choice("kwta").enabled
    _, report = rewrite_model(tg.llama_like(), attention)
    assert not report.rewritten and report.layers[0].reason == "--kwta=auto (off: --attn=none)"
    explicit = TechniqueChoice(KwtaSettings(), enabled=True, target="mlp")
    assert RewriteConfig(techniques={"fakeb": on, "kwta": explicit}).choice("kwta").enabled


def test_config_has_one_spelling_of_kwta():
    """KWTA is techniques["kwta"] like any other technique: no second spelling in configs or reports."""
    with pytest.raises(TypeError):
        RewriteConfig(kwta=KwtaSettings(k_frac=0.25))  # noqa (the pre-release keyword is gone)
    with pytest.raises(TypeError):
        LayerOverride("*", kwta={"k_frac": 0.9})
    entry = LayerOverride("*", techniques={"kwta": {"k_frac": 0.9}})
    assert entry.setting("kwta") == {"k_frac": 0.9}
    with pytest.raises(ConfigError, match="unknown technique"):
        LayerOverride("*", techniques={"kwtaa": {}})
    report = rewrite_model(tg.gpt2_like(), kwta_config("all", k_frac=0.25))[1]
    data = report.to_dict()["config"]
    assert "kwta_enabled" not in data and data["techniques"]["kwta"]["enabled"] is True
    assert data["techniques"]["kwta"]["settings"]["k_frac"] == 0.25 and data["techniques"]["kwta"]["target"] == "all"


def test_flags_are_data_and_round_trip_through_argparse():
    """Every flag is declared once (name, type/choices, default, help, settings field): argparse
    is built from it, and parsing nothing gives each technique's default choice."""
    from ortsparse.cli import add_technique_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_technique_arguments(parser)
    config = config_from_args(parser.parse_args([]))
    for name, technique in TECHNIQUES.items():
        default = technique.default_choice()
        assert config.techniques[name].settings == default.settings
        assert config.techniques[name].target == default.target
        fields = {f.name for f in dataclasses.fields(technique.settings_type)}
        for flag in technique.flags:
            assert flag.field in fields | {TARGET, None}, (name, flag.name)
            assert flag.help
    names = [flag.name for group in flag_groups() for flag in group.flags]
    assert len(names) == len(set(names))
    assert {"--kwta", "--kwta-k", "--tt-rank", "--state-pack", "--proc-sparse", "--event-driven", "--attn",
            "--attn-proj-bits"} <= set(names)


# The rewrite flags of rewrite-onnx as they were when each technique hand-wrote its argparse calls:
# declaring them as data must not lose, rename or add one (flags added since are appended to their line).
HISTORICAL_FLAGS = """
--attn --attn-candidates --attn-center --attn-density-max --attn-eps --attn-keep-first --attn-keep-recent
--attn-min-keys --attn-mode --attn-pack-cache --attn-page-size --attn-proj-bits --attn-topk --attn-verify-keys
--attn-event --attn-event-topk --attn-event-age-max --attn-event-gap-every --attn-event-gap-tol
--attn-prefill --attn-prefill-eps --attn-prefill-budget --attn-mass-eps
--event-age-max --event-axis
--event-block --event-budget-ms --event-delta-theta --event-driven --event-gap-every --event-gap-tol
--event-max-gated-rows --event-quorum --event-stale-beta --event-stale-lambda --event-target --event-topk --kwta
--kwta-block --kwta-duty --kwta-duty-mode --kwta-k --kwta-k-abs --kwta-max-gated-rows --kwta-renorm --kwta-score
--kwta-target --kwta-temp --kwta-threshold --proc-base-scale --proc-block --proc-delta-dtype --proc-fanout
--proc-fanout-frac --proc-score --proc-seed --proc-shed-eps --proc-sparse --proc-target --proc-watermark
--state-pack --state-pack-block --state-pack-density-max --state-pack-eps --state-pack-max-gated-rows
--state-pack-popcnt --state-pack-target --tt --tt-d --tt-gap --tt-keep-dense --tt-layout --tt-maxvol-k --tt-method
--tt-min-flop-ratio --tt-rank --tt-target
--weights --weights-block-size --weights-target
""".split()


def test_rewrite_onnx_help_lists_the_same_flags():
    import re

    from ortsparse.cli import add_rewrite_arguments

    parser = argparse.ArgumentParser(prog="rewrite-onnx")
    add_rewrite_arguments(parser)
    declared = {flag.name for group in flag_groups() for flag in group.flags}
    assert declared == set(HISTORICAL_FLAGS)
    listed = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", parser.format_help()))
    assert declared <= listed
    config = config_from_args(parser.parse_args(["in.onnx", "--state-pack=ternary", "--kwta-k=0.25", "--tt-rank=0"]))
    assert config.choice("pack").settings.mode == "ternary" and config.choice("kwta").settings.k_frac == 0.25
    assert config.choice("tt").settings.rank == 0 and not config.choice("tt").enabled
