"""One op schema read by both sides (graph_rewrite/op_schema.json): the C++ header generated from it is
current, the C++ attribute readers read exactly the declared attributes with the declared types and
defaults, and the Python techniques' defaults are the schema's. Each check is also run on a changed
reader or schema, to show it fails when the two sides disagree."""
from __future__ import annotations

import copy
import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest

import ortsparse
from ortsparse.graph_rewrite import op_schema
from ortsparse.graph_rewrite.attention_rules import ms_group_query_attention
from ortsparse.graph_rewrite.techniques.event import EventSettings
from ortsparse.graph_rewrite.techniques.kwta import KwtaSettings
from ortsparse.graph_rewrite.techniques.popcount import GQA_OP_TYPE, GQA_RECOMMENDED, OP_TYPE, AttentionSettings

ROOT = Path(__file__).resolve().parents[2]
ORT = ROOT / "ops" / "ort"
# The C++ files that read each op's attributes (attention_attributes.cc: the selection ones, both forms).
READERS = {
    "PopcountAttention": ("attention_attributes.cc", "popcount_attention.cc"),
    "PopcountGroupQueryAttention": ("attention_attributes.cc", "popcount_group_query_attention.cc"),
    "KwtaBlockMatMul": ("kwta_attributes.cc", "kwta_block_matmul.cc"),
    "EventDrivenMatMul": ("event_driven_matmul.cc",),
}
# KwtaBlockMatMul also reads the state-pack, GLU and weight-form attributes, not (yet) in the schema.
COMPLETE = {"PopcountAttention", "PopcountGroupQueryAttention", "EventDrivenMatMul"}
# The readers' field names where they differ from the attribute's.
FIELDS = {"pack_cache": "cache_keys", "event_topk": "topk", "event_age_max": "age_max", "event_gap_every": "gap_every",
          "event_gap_tol": "gap_tol"}  # event_*: HeadReuseConfig's fields
_CALL = re.compile(r'(get_int|get_float|get_string|read_flag)\(\s*(?:attrs,\s*)?(?:name\()?"(\w+)"\)?(?:\.c_str\(\))?,'
                   r'\s*([^;]+?)\)(?:\s*;|\s*!=|\s*\))')
# for (const char* name : {"a", "b"}) ... get_string(name, DEFAULT): one read per listed attribute
_LOOP = re.compile(r'for \(const char\* name : \{((?:\s*"\w+",?)+)\}\)[^;]*?(get_int|get_float|get_string)\(name,\s*([^)]+)\)')
_KIND = {"get_int": "int", "read_flag": "int", "get_float": "float", "get_string": "string"}
_SELECTION_TEMPLATE = re.compile(r"schema_selection_defaults\(\) \{(.*?)\n\}", re.S)


def reads(source: str) -> list[tuple[str, str, str]]:
    """(attribute, kind, default expression) of every attribute read in ``source``."""
    found = [(name, _KIND[call], default.strip()) for call, name, default in _CALL.findall(source)]
    for names, call, default in _LOOP.findall(source):
        found += [(name, _KIND[call], default.strip()) for name in re.findall(r'"(\w+)"', names)]
    return found


def _literal(kind: str, text: str):
    text = text.strip()
    if kind == "string":
        return text.strip('"') if text.startswith('"') else None
    if text in ("true", "false"):
        return int(text == "true")
    try:
        value = float(text.rstrip("f")) if kind == "float" else int(text)
    except ValueError:
        return None
    return value


def disagreements(op: str, sources: dict[str, str], schema: dict) -> list[str]:
    """Where ``op``'s C++ readers (``sources``: file -> text) and its ``schema`` entry differ."""
    spec = schema["ops"][op]
    declared = {name: attribute for section in op_schema.SECTIONS for name, attribute in spec.get(section, {}).items()}
    text = "\n".join(sources.values())
    found = reads(text)
    problems = []
    for name, kind, default in found:
        if name not in declared:
            if op in COMPLETE:
                problems.append(f"{op}: C++ reads {name!r}, which the schema does not declare")
            continue
        attribute = declared[name]
        if attribute["type"] != kind:
            problems.append(f"{op}.{name}: C++ reads a {kind}, the schema declares a {attribute['type']}")
        value = _literal(kind, default)
        if value is not None:
            expected = float(np.float32(attribute["default"])) if kind == "float" else attribute["default"]
            if (float(np.float32(value)) if kind == "float" else value) != expected:
                problems.append(f"{op}.{name}: C++ default {default} but the schema's is {attribute['default']!r}")
        elif not re.search(rf"(::|\.){re.escape(FIELDS.get(name, name))}\b|default_k_frac", default):
            problems.append(f"{op}.{name}: C++ default {default!r} is not the schema's {name}")
    read_names = {name for name, _, _ in found}
    missing = sorted(set(declared) - read_names)
    if missing:
        problems.append(f"{op}: the schema declares {', '.join(missing)}, which no C++ reader reads")
    template = _SELECTION_TEMPLATE.search(sources.get("attention_attributes.h", ""))
    if template is not None:
        mapped = set(re.findall(r"Schema::(\w+)", template.group(1)))
        # the 4-D adapter's re-encoding attributes configure its Reencoder, not the selection
        selection = set(schema["ops"]["PopcountAttention"]["settings"]) - {"reuse_rows", "reuse_tol"}
        if mapped != selection:
            problems.append(f"schema_selection_defaults maps {sorted(mapped ^ selection)} differently from the "
                            "PopcountAttention settings")
    return problems


def _sources(op: str) -> dict[str, str]:
    files = READERS[op] + (("attention_attributes.h",) if "Attention" in op else ())
    return {name: (ORT / name).read_text() for name in files}


def test_the_generated_header_is_current():
    header = ROOT / op_schema.HEADER
    assert header.read_text() == op_schema.cpp_header(), \
        "ops/ort/op_schema.h is stale: run python scripts/op_schema_header.py"


def test_the_header_follows_a_changed_schema():
    changed = copy.deepcopy(dict(op_schema.schema()))
    changed["ops"]["PopcountAttention"]["settings"]["topk"]["default"] = 128
    assert op_schema.cpp_header(changed) != op_schema.cpp_header()
    assert "static constexpr int64_t topk = 128;" in op_schema.cpp_header(changed)


@pytest.mark.parametrize("op", sorted(READERS))
def test_cpp_readers_read_what_the_schema_declares(op):
    assert disagreements(op, _sources(op), op_schema.schema()) == []


@pytest.mark.parametrize("op, file, before, after", [
    ("PopcountGroupQueryAttention", "popcount_group_query_attention.cc", '"local_window_size", -1',
     '"local_window_size", 0'),
    ("PopcountAttention", "popcount_attention.cc", '"is_causal", schema::PopcountAttention::is_causal',
     '"is_causal", 1'),
    ("PopcountAttention", "attention_attributes.cc", '"topk", defaults.topk', '"topk", defaults.min_keys'),
    ("PopcountAttention", "attention_attributes.cc", 'get_float("eps"', 'get_int("eps"'),
    ("PopcountAttention", "popcount_attention.cc", 'c.scale = attrs', 'c.scale = 0.0f; attrs.get_int("zz", 0); attrs'),
    ("KwtaBlockMatMul", "kwta_attributes.cc", "Gate::temp", "2.0f"),
    ("EventDrivenMatMul", "event_driven_matmul.cc", "Schema::quorum", "0.5f"),
    ("PopcountAttention", "attention_attributes.h", "c.topk = Schema::topk;", ""),
])
def test_a_reader_that_disagrees_is_found(op, file, before, after):
    sources = _sources(op)
    assert before in sources[file]
    sources[file] = sources[file].replace(before, after)
    assert disagreements(op, sources, op_schema.schema())


def test_a_schema_default_the_reader_does_not_have_is_found():
    changed = copy.deepcopy(dict(op_schema.schema()))
    changed["ops"]["PopcountGroupQueryAttention"]["from_graph"]["causal"]["default"] = 0
    assert disagreements("PopcountGroupQueryAttention", _sources("PopcountGroupQueryAttention"), changed)


def _python_defaults(settings_type) -> dict:
    return {field.name: field.default for field in dataclasses.fields(settings_type)}


def test_python_defaults_are_the_schema_defaults():
    attention = _python_defaults(AttentionSettings)
    common = op_schema.defaults(OP_TYPE)
    gqa = op_schema.defaults(GQA_OP_TYPE)
    assert set(attention) <= set(gqa), "an attention setting the op schema does not declare"
    for name, value in attention.items():
        expected = common.get(name, gqa[name])
        assert value == expected and type(value) is type(expected), name
    assert set(AttentionSettings().attributes()) <= set(common)
    assert set(AttentionSettings().gqa_attributes()) <= set(gqa)
    assert {name: getattr(GQA_RECOMMENDED, name) for name in attention} == {name: gqa[name] for name in attention}
    assert _python_defaults(EventSettings) == op_schema.defaults("EventDrivenMatMul")
    assert set(EventSettings().attributes()) == set(op_schema.defaults("EventDrivenMatMul"))
    kwta = _python_defaults(KwtaSettings)
    assert kwta == op_schema.defaults("KwtaBlockMatMul")
    assert set(KwtaSettings().attributes()) == set(kwta)
    assert ms_group_query_attention.INPUTS == op_schema.inputs(GQA_OP_TYPE)
    assert ms_group_query_attention.PASSED_ATTRIBUTES == tuple(op_schema.attributes(GQA_OP_TYPE, "from_graph"))


def _attention_output(rng_seed: int, **attrs) -> np.ndarray:
    from tests.ops import attention_reference as ref

    rng = np.random.default_rng(rng_seed)
    q = rng.standard_normal((1, 2, 2, 16)).astype(np.float32)
    k = rng.standard_normal((1, 2, 1100, 16)).astype(np.float32)  # above min_keys: the selector runs
    v = rng.standard_normal((1, 2, 1100, 16)).astype(np.float32)
    session = ortsparse.inference_session(ref.attention_model(**attrs))
    return session.run(None, {"Q": q, "K": k, "V": v})[0]


def test_the_op_without_attributes_computes_what_the_python_defaults_write():
    """At runtime: a PopcountAttention node with no selection attribute computes exactly what the node
    with every Python default written computes (and a changed setting does change the output)."""
    written = AttentionSettings().attributes()
    bare = _attention_output(0)
    assert np.array_equal(bare, _attention_output(0, **written))
    assert not np.array_equal(bare, _attention_output(0, **{**written, "topk": 8}))
