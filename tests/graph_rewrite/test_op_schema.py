"""One op schema read by both sides (graph_rewrite/op_schema.json): the C++ header generated from it is
current; every registered op has an entry; each op's C++ attribute readers (a shared reader counted
at each call, with its prefix) read exactly the declared attributes with the declared types and
defaults; the Python techniques' defaults are the schema's; and every attribute a rewrite writes is
declared. Each check is also run on a changed reader or schema, to show it fails when the two sides
disagree."""
from __future__ import annotations

import copy
import dataclasses
import re
from pathlib import Path

import numpy as np
import onnx
import pytest

import ortsparse
from ortsparse.graph_rewrite import op_schema
from ortsparse.graph_rewrite.attention_rules import ms_group_query_attention
from ortsparse.graph_rewrite.config import config_from_flags
from ortsparse.graph_rewrite.rewrite import rewrite_model
from ortsparse.graph_rewrite.rules import DOMAIN
from ortsparse.graph_rewrite.techniques import TECHNIQUES
from ortsparse.graph_rewrite.techniques.event import EventSettings
from ortsparse.graph_rewrite.techniques.kwta import KwtaSettings
from ortsparse.graph_rewrite.techniques.proc import kwta_gate_attributes
from ortsparse.graph_rewrite.techniques.popcount import GQA_OP_TYPE, GQA_RECOMMENDED, OP_TYPE, AttentionSettings

ROOT = Path(__file__).resolve().parents[2]
ORT = ROOT / "ops" / "ort"
# The C++ files that read each op's attributes (attention_attributes.cc: the selection ones, both forms).
READERS = {
    "PopcountAttention": ("attention_attributes.cc", "popcount_attention.cc"),
    "PopcountGroupQueryAttention": ("attention_attributes.cc", "popcount_group_query_attention.cc"),
    "KwtaBlockMatMul": ("kwta_block_matmul.cc",),
    "EventDrivenMatMul": ("event_driven_matmul.cc",),
    "ProcSparseMatMul": ("proc_sparse_matmul.cc",),
    "TTMatMul": ("tt_matmul.cc",),
}
# Readers shared by several ops, called as (attrs, "<prefix>", <default of k_frac>): their reads count
# at each call, with the call's prefix (ProcSparseMatMul's kwta_* gate).
SHARED = {"read_kwta_attributes": ("kwta_attributes.cc", "default_k_frac")}
# The readers' field names where they differ from the attribute's (attention_attributes.cc's `defaults.x`).
FIELDS = {"pack_cache": "cache_keys", "event": "enabled", "event_topk": "topk", "event_age_max": "age_max", "event_gap_every": "gap_every",
          "event_gap_tol": "gap_tol"}  # event_*: HeadReuseConfig's fields
_KIND = {"get_int": "int", "read_flag": "int", "get_float": "float", "get_string": "string", "get_ints": "ints"}
_CALL = re.compile(r"\b(get_ints|get_int|get_float|get_string|read_flag|" + "|".join(SHARED) + r")\(")
_NAME = re.compile(r'^(?:name\()?"(\w+)"\)?(?:\.c_str\(\))?$')  # "x", or name("x").c_str() in a prefixed reader
_ALIAS = re.compile(r"using (\w+) = schema::(\w+);")
_SELECTION_TEMPLATE = re.compile(r"schema_selection_defaults\(\) \{(.*?)\n\}", re.S)


def _arguments(text: str, start: int) -> list[str]:
    """The top-level comma-separated arguments of the call whose '(' ends just before ``start``."""
    args, depth, current, quoted = [], 0, [], False
    for char in text[start:]:
        if char == '"':
            quoted = not quoted
        elif not quoted and char in "({[":
            depth += 1
        elif not quoted and char in ")}]":
            if depth == 0:
                break
            depth -= 1
        elif not quoted and char == "," and depth == 0:
            args.append("".join(current).strip())
            current = []
            continue
        current.append(char)
    return args + ["".join(current).strip()]


def reads(sources: dict[str, str], files, prefix: str = "", bound: dict[str, str] | None = None
          ) -> list[tuple[str, str, str | None, str]]:
    """(attribute, kind, default expression or None, prefix) of every attribute ``files`` read; a call of a
    SHARED reader adds that reader's reads with the call's prefix (``bound``: its parameters' arguments)."""
    found = []
    for file in files:
        text = sources[file]
        for call in _CALL.finditer(text):
            args = _arguments(text, call.end())
            function = call.group(1)
            if function in SHARED:
                shared_file, parameter = SHARED[function]
                if len(args) == 3 and args[1].startswith('"'):  # a call, not the definition
                    found += reads(sources, (shared_file,), args[1].strip('"'), {parameter: args[2]})
                continue
            name_arg, default = (args[1], args[2]) if function == "read_flag" else (args[0], args[1:] and args[1])
            name = _NAME.match(name_arg)
            if name is None:  # a helper's own definition or a declaration: read through its callers
                continue
            if bound and default in bound:
                default = bound[default]
            found.append((prefix + name.group(1), _KIND[function], default or None, prefix))
    return found


def _literal(kind: str, text: str):
    text = text.strip()
    if kind == "string":
        return text.strip('"') if text.startswith('"') else None
    if text in ("true", "false"):
        return int(text == "true")
    try:
        return float(text.rstrip("f")) if kind == "float" else int(text)
    except ValueError:
        return None


def _same(kind: str, a, b) -> bool:
    return float(np.float32(a)) == float(np.float32(b)) if kind == "float" else a == b


def _declared(schema: dict, op: str) -> dict:
    spec = schema["ops"][op]
    return {name: attribute for section in op_schema.SECTIONS for name, attribute in spec.get(section, {}).items()}


def _default_problem(op, name, kind, default, prefix, attribute, schema, aliases) -> str | None:
    """Why the C++ default expression ``default`` of ``op.name`` is not the schema's, or None."""
    if "required" in attribute:
        return None if default is None else f"{op}.{name}: C++ reads it with default {default!r}, the schema requires it"
    if default is None:
        return f"{op}.{name}: C++ requires it, the schema gives a default"
    if "default_from" in attribute:
        ok = default == attribute["default_from"]
        return None if ok else f"{op}.{name}: C++ default {default!r}, the schema's is the value of {attribute['default_from']}"
    expected = attribute["default"]
    value = _literal(kind, default)
    if value is not None:
        return None if _same(kind, value, expected) else f"{op}.{name}: C++ default {default} but the schema's is {expected!r}"
    reference = re.fullmatch(r"(?:schema::)?(\w+)::(\w+)(?:\s*!=\s*0)?", default)
    if reference is not None:  # a constant of the generated header: the same attribute, the same value
        other_op, other = aliases.get(reference.group(1), reference.group(1)), reference.group(2)
        if other not in (name, name[len(prefix):]):
            return f"{op}.{name}: C++ default {default!r} is another attribute's"
        if other_op not in schema["ops"] or "default" not in _declared(schema, other_op).get(other, {}):
            return f"{op}.{name}: C++ default {default!r} is not in the schema"
        other_default = _declared(schema, other_op)[other]["default"]
        return None if _same(kind, other_default, expected) else \
            f"{op}.{name}: C++ default {default} (= {other_default!r}) but the schema's is {expected!r}"
    field = re.search(r"\bdefaults\.(?:event\.)?(\w+)", default)  # read_selection_attributes: the op's template
    if field is not None and field.group(1) == FIELDS.get(name, name):
        return None
    return f"{op}.{name}: C++ default {default!r} is not the schema's {name}"


def disagreements(op: str, sources: dict[str, str], schema: dict) -> list[str]:
    """Where ``op``'s C++ readers (``sources``: file -> text) and its ``schema`` entry differ."""
    declared = _declared(schema, op)
    aliases = {alias: target for text in sources.values() for alias, target in _ALIAS.findall(text)}
    found = reads(sources, READERS[op])
    problems = []
    for name, kind, default, prefix in found:
        if name not in declared:
            problems.append(f"{op}: C++ reads {name!r}, which the schema does not declare")
            continue
        attribute = declared[name]
        if attribute["type"] != kind:
            problems.append(f"{op}.{name}: C++ reads a {kind}, the schema declares a {attribute['type']}")
            continue
        problem = _default_problem(op, name, kind, default, prefix, attribute, schema, aliases)
        if problem:
            problems.append(problem)
    missing = sorted(set(declared) - {name for name, _, _, _ in found})
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
    files = READERS[op] + tuple(file for file, _ in SHARED.values()) + (("attention_attributes.h",) if "Attention" in op else ())
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


def test_every_op_has_a_schema_and_readers():
    """Each op the library registers (kOpName of an adapter) has a schema entry and its reader files here,
    and every adapter file that reads an attribute is one of those readers."""
    registered = set()
    reading = set()
    for path in ORT.glob("*.cc"):
        text = path.read_text()
        registered |= set(re.findall(r'kOpName = "(\w+)"', text))
        if any(_NAME.match((_arguments(text, call.end()) + [""])[0]) for call in _CALL.finditer(text)):
            reading.add(path.name)
    assert registered == set(op_schema.schema()["ops"]) == set(READERS)
    assert reading <= {file for files in READERS.values() for file in files} | {f for f, _ in SHARED.values()}


@pytest.mark.parametrize("op", sorted(READERS))
def test_cpp_readers_read_what_the_schema_declares(op):
    assert disagreements(op, _sources(op), op_schema.schema()) == []


def test_a_prefixed_shared_reader_counts_with_its_prefix():
    names = {name: default for name, _, default, _ in reads(_sources("ProcSparseMatMul"), READERS["ProcSparseMatMul"])}
    assert names["kwta_temp"] == "Gate::temp" and names["kwta_k_frac"] == "Schema::kwta_k_frac"
    assert "temp" not in names


@pytest.mark.parametrize("op, file, before, after", [
    ("PopcountGroupQueryAttention", "popcount_group_query_attention.cc", '"local_window_size", Schema::local_window_size',
     '"local_window_size", 0'),
    ("PopcountAttention", "popcount_attention.cc", '"is_causal", schema::PopcountAttention::is_causal',
     '"is_causal", 1'),
    ("PopcountAttention", "attention_attributes.cc", '"topk", defaults.topk', '"topk", defaults.min_keys'),
    ("PopcountAttention", "attention_attributes.cc", 'get_float("eps"', 'get_int("eps"'),
    ("PopcountAttention", "popcount_attention.cc", 'c.scale = attrs', 'c.scale = 0.0f; attrs.get_int("zz", 0); attrs'),
    ("KwtaBlockMatMul", "kwta_attributes.cc", "Gate::temp", "2.0f"),
    ("KwtaBlockMatMul", "kwta_block_matmul.cc", '"pack_eps", Schema::pack_eps', '"pack_eps", 1e-4f'),
    ("KwtaBlockMatMul", "kwta_block_matmul.cc", '"glu", Schema::glu', '"glu", Schema::pack_mode'),
    ("KwtaBlockMatMul", "kwta_block_matmul.cc", 'const int64_t block = attrs', 'attrs.get_int("zz", 0); const int64_t block = attrs'),
    ("EventDrivenMatMul", "event_driven_matmul.cc", "Schema::quorum", "0.5f"),
    ("PopcountAttention", "attention_attributes.h", "c.topk = Schema::topk;", ""),
    ("TTMatMul", "tt_matmul.cc", '"nan_guard", Schema::nan_guard', '"nan_guard", 0'),
    ("TTMatMul", "tt_matmul.cc", 'get_ints("ranks")', 'get_ints("rank")'),
    ("ProcSparseMatMul", "proc_sparse_matmul.cc", '"fanout", Schema::fanout', '"fan_out", Schema::fanout'),
    ("ProcSparseMatMul", "proc_sparse_matmul.cc", "Schema::kwta_k_frac", "0.5f"),
    ("ProcSparseMatMul", "proc_sparse_matmul.cc", '"kwta_block", block', '"kwta_block", 32'),
    ("ProcSparseMatMul", "kwta_attributes.cc", 'name("duty")', 'name("duty_")'),
])
def test_a_reader_that_disagrees_is_found(op, file, before, after):
    sources = _sources(op)
    assert before in sources[file]
    sources[file] = sources[file].replace(before, after)
    assert disagreements(op, sources, op_schema.schema())


def _changed(op: str, name: str, **spec) -> dict:
    changed = copy.deepcopy(dict(op_schema.schema()))
    section = next(section for section in op_schema.SECTIONS if name in changed["ops"][op].get(section, {}))
    changed["ops"][op][section][name] = {"type": changed["ops"][op][section][name]["type"], **spec}
    return changed


@pytest.mark.parametrize("checked, changed", [
    # C++ reads KwtaBlockMatMul's defaults for ProcSparseMatMul's kwta_* gate: the two must agree
    ("ProcSparseMatMul", _changed("ProcSparseMatMul", "kwta_temp", default=2.0)),
    ("ProcSparseMatMul", _changed("KwtaBlockMatMul", "duty_mode", default="hold")),
    ("ProcSparseMatMul", _changed("ProcSparseMatMul", "kwta_block", default=32)),
    ("TTMatMul", _changed("TTMatMul", "ranks", default=[1])),  # C++ refuses a node without it
    ("TTMatMul", _changed("TTMatMul", "gap", required=True)),
])
def test_a_schema_the_reader_does_not_follow_is_found(checked, changed):
    assert disagreements(checked, _sources(checked), changed)


def _python_defaults(settings_type) -> dict:
    return {field.name: field.default for field in dataclasses.fields(settings_type)}


# Settings whose technique default is not the op's: the op's means "off" or "exact", the technique's is
# what switching the technique on means.
OWN_DEFAULTS = {("pack", "pack_mode"): "the op's none = no bitmap; --state-pack's on = binary",
                ("pack", "pack_eps"): "the op's 0 = exact; the technique's 1e-4 skips near-zero blocks"}


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
    op_kwta = op_schema.defaults("KwtaBlockMatMul")
    assert kwta == {name: op_kwta[name] for name in kwta}
    assert set(KwtaSettings().attributes()) == set(kwta)
    gate = kwta_gate_attributes(KwtaSettings(), 64)
    assert set(gate) <= set(op_schema.attributes("ProcSparseMatMul"))
    assert ms_group_query_attention.INPUTS == op_schema.inputs(GQA_OP_TYPE)
    assert ms_group_query_attention.PASSED_ATTRIBUTES == tuple(op_schema.attributes(GQA_OP_TYPE, "from_graph"))


@pytest.mark.parametrize("technique", sorted(name for name, t in TECHNIQUES.items() if t.op_type in op_schema.schema()["ops"]))
def test_technique_defaults_are_their_ops_defaults(technique):
    """Each setting a technique writes as one of its op's 'settings' attributes defaults to the op's value
    (OWN_DEFAULTS aside, which must then really differ)."""
    op = TECHNIQUES[technique].op_type
    written = TECHNIQUES[technique].settings_type().attributes()
    op_defaults = op_schema.defaults(op)
    compared = sorted(set(written) & set(op_defaults))
    assert compared, f"{technique} writes none of {op}'s settings"
    for name in compared:
        if (technique, name) in OWN_DEFAULTS:
            assert written[name] != op_defaults[name], f"{technique}.{name} is the op's default: drop it from OWN_DEFAULTS"
        else:
            assert written[name] == op_defaults[name] and type(written[name]) is type(op_defaults[name]), name


TINY = ROOT / "models" / "tiny"
_ONNX_TYPES = {onnx.AttributeProto.INT: "int", onnx.AttributeProto.FLOAT: "float", onnx.AttributeProto.STRING: "string",
               onnx.AttributeProto.INTS: "ints"}
# Rewrites that between them emit every op, each form and composition (flag dest -> value, as the CLI).
REWRITES = [
    ("llama_tiny.dynamo.onnx", {"kwta": "on", "state_pack": "binary"}),
    ("llama_tiny.dynamo.onnx", {"tt": "on", "tt_rank": 2, "tt_min_flop_ratio": 0.0, "tt_gap": 0.0}),
    ("llama_tiny.dynamo.onnx", {"proc_sparse": "on", "kwta": "on"}),
    ("llama_tiny.dynamo.onnx", {"weights": "int4", "kwta": "on"}),
    ("bert_tiny.dynamo.onnx", {"event_driven": "on"}),
    ("llama_tiny_sdpa.dynamo.onnx", {"attn": "pages", "attn_event": 1}),
    ("llama_tiny_genai/model.onnx", {"attn": "popcount"}),
]


def test_every_attribute_the_rewriter_writes_is_declared():
    """End to end: the nodes the rewriter emits carry only attributes the schema declares, with its types."""
    seen, problems = set(), []
    for model, flags in REWRITES:
        rewritten, _ = rewrite_model(onnx.load(TINY / model), config_from_flags(flags))
        for node in rewritten.graph.node:
            if node.domain != DOMAIN:
                continue
            seen.add(node.op_type)
            declared = op_schema.attributes(node.op_type) | {
                name: spec for section in op_schema.SECTIONS[1:] for name, spec in op_schema.attributes(node.op_type, section).items()}
            for attribute in node.attribute:
                spec = declared.get(attribute.name)
                if spec is None or spec["type"] != _ONNX_TYPES.get(attribute.type):
                    problems.append(f"{model} {flags}: {node.op_type}.{attribute.name} ({attribute.type}) vs {spec}")
    assert problems == []
    assert seen == set(op_schema.schema()["ops"])


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
