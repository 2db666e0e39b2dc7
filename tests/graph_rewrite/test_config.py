"""Settings validation and the override file format (JSON and TOML)."""
from __future__ import annotations

import json

import pytest

from ortsparse.graph_rewrite import (
    ConfigError, KwtaSettings, LayerOverride, RewriteConfig, TechniqueChoice, load_overrides, parse_overrides,
)


def test_defaults_follow_the_op_contract_with_single_row_blocks():
    settings = KwtaSettings()
    assert settings.attributes() == {"k_frac": 0.5, "k_abs": 0, "score": "l2", "threshold": 0.0, "temp": 1.0,
                                     "duty": 1, "duty_mode": "dense", "renorm": 0, "block": 1,
                                     "max_gated_rows": 0}


@pytest.mark.parametrize("bad", [
    {"k_frac": 0.0}, {"k_frac": 1.5}, {"k_abs": -1}, {"score": "max"}, {"threshold": -1.0}, {"temp": 0.0},
    {"duty": 0}, {"duty_mode": "sometimes"}, {"renorm": 2}, {"block": 0},
])
def test_invalid_settings_are_config_errors(bad):
    with pytest.raises(ConfigError):
        KwtaSettings(**bad)


def test_exactness():
    assert KwtaSettings(k_frac=1.0).is_exact(64)
    assert not KwtaSettings(k_frac=0.9).is_exact(64)
    assert KwtaSettings(k_frac=0.1, k_abs=64).is_exact(64)
    assert not KwtaSettings(k_frac=0.1, k_abs=32).is_exact(64)
    assert not KwtaSettings(k_frac=1.0, threshold=0.1).is_exact(64)


def test_unknown_target_rejected():
    with pytest.raises(ConfigError, match="target"):
        RewriteConfig(techniques={"kwta": TechniqueChoice(KwtaSettings(), target="everything")})


def test_override_matching():
    assert LayerOverride("*mlp*").matches(3, "/h.0/mlp/fc", "mlp", "up")
    assert not LayerOverride("*mlp*").matches(3, "/h.0/attn/q", "attn", "q")
    assert LayerOverride("layer:3").matches(3, "x", "attn", "q")
    assert not LayerOverride("layer:3").matches(13, "x", "attn", "q")
    assert LayerOverride("class:attn").matches(0, "x", "attn", "q")
    assert LayerOverride("role:down").matches(0, "x", "mlp", "down")
    assert not LayerOverride("role:down").matches(0, "x", "mlp", "up")


def test_a_node_entry_matches_its_exact_name_only():
    """``node`` is not a glob: the characters fnmatch reads as patterns are literal there."""
    name = "/model/layers.0/mlp[x]/down*?"
    (entry,) = parse_overrides([{"node": name, "kwta": "off"}])
    assert entry.matches(0, name, "mlp", "down")
    assert not entry.matches(0, "/model/layers.0/mlpx/downab", "mlp", "down")
    assert not entry.matches(0, "layer:0", "mlp", "down") and not LayerOverride(node="layer:0").matches(
        0, "x", "mlp", "down")
    assert entry.label == f"node {name!r}"


@pytest.mark.parametrize("entry, message", [
    ({"kwta": {"k_frac": 0.5}}, "missing 'match'"),
    ({"match": "*", "node": "x"}, "not both"),
    ({"node": "", "kwta": "off"}, "'node' must be a non-empty string"),
    ({"node": 3, "kwta": "off"}, "'node' must be a non-empty string"),
    ({"match": "layer:x"}, "layer:<index>"),
    ({"match": "class:ffn"}, "class must be one of"),
    ({"match": "*", "kwta": {"k": 0.5}}, "unknown KWTA setting"),
    ({"match": "*", "kwta": {"k_frac": 3}}, "k_frac"),
    ({"match": "*", "kwta": "maybe"}, "must be \"off\""),
    ({"match": "*", "zz": {}}, "unknown key"),
        ({"match": "*", "tt": {"nope": 1}}, "unknown TT setting"),
    ({"match": "*", "off": "yes"}, "'off' must be true or false"),
])
def test_bad_entries_are_explained(entry, message):
    with pytest.raises(ConfigError, match=message):
        parse_overrides([entry], source="f.json")


def test_json_and_toml_files_read_the_same(tmp_path):
    entries = [{"match": "*down*", "kwta": {"k_frac": 0.9, "renorm": True}},
               {"match": "layer:0", "kwta": "off"}, {"match": "class:head", "off": True}]
    json_path = tmp_path / "overrides.json"
    json_path.write_text(json.dumps({"layers": entries}))
    toml_path = tmp_path / "overrides.toml"
    toml_path.write_text(
        '[[layers]]\nmatch = "*down*"\nkwta = { k_frac = 0.9, renorm = true }\n\n'
        '[[layers]]\nmatch = "layer:0"\nkwta = "off"\n\n'
        '[[layers]]\nmatch = "class:head"\noff = true\n')
    from_json = load_overrides(json_path)
    from_toml = load_overrides(toml_path)
    strip = [(o.match, o.off, o.setting("kwta")) for o in from_json]
    assert strip == [(o.match, o.off, o.setting("kwta")) for o in from_toml]
    assert from_json[0].source.endswith("overrides.json entry 0")
    assert load_overrides(tmp_path / "overrides.json") == from_json
    assert KwtaSettings().updated(from_json[0].setting("kwta")).renorm == 1


def test_a_bare_list_is_accepted(tmp_path):
    path = tmp_path / "o.json"
    path.write_text('[{"match": "layer:1", "off": true}]')
    assert load_overrides(path)[0].off


def test_unreadable_or_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_overrides(tmp_path / "missing.json")
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_overrides(broken)
    wrong = tmp_path / "wrong.json"
    wrong.write_text('{"entries": []}')
    with pytest.raises(ConfigError, match="unknown top-level key"):
        load_overrides(wrong)
