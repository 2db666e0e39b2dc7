"""One schema per op, read by both sides: the attributes (name, type, default) and input names of the
ai.ortsparse ops live in ``op_schema.json`` beside this module. The techniques take their settings'
defaults from it (:func:`defaults`); the C++ attribute readers include ``ops/ort/op_schema.h``, which
:func:`cpp_header` renders from the same file (``python scripts/op_schema_header.py``
rewrites it; tests/graph_rewrite/test_op_schema.py fails when it is stale).
"""
from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

SCHEMA_FILE = Path(__file__).with_name("op_schema.json")
HEADER = Path("ops") / "ort" / "op_schema.h"  # relative to the repository root
SECTIONS = ("settings", "from_graph", "built", "refused")  # the attribute groups of an op, in header order
_CPP_TYPES = {"int": "int64_t", "float": "float", "string": "const char*"}


@functools.lru_cache(maxsize=1)
def schema() -> Mapping[str, Any]:
    """The decoded schema file (``{"ops": {op: {section: {attribute: {type, default}}, "inputs": [...]}}}``)."""
    return json.loads(SCHEMA_FILE.read_text())


def attributes(op: str, section: str = "settings") -> dict[str, dict[str, Any]]:
    """``{attribute: {"type": ..., "default": ...}}`` of one section of ``op``."""
    return dict(schema()["ops"][op].get(section, {}))


def defaults(op: str, section: str = "settings") -> dict[str, Any]:
    """``{attribute: default}`` of one section of ``op`` (the op's value when the attribute is absent;
    attributes without a fixed default, ``required`` or ``default_from``, are left out)."""
    return {name: spec["default"] for name, spec in attributes(op, section).items() if "default" in spec}


def inputs(op: str) -> tuple[str, ...]:
    """The op's input names, by index."""
    return tuple(schema()["ops"][op]["inputs"])


def _cpp_value(kind: str, value: Any) -> str:
    if kind == "string":
        return json.dumps(value)
    if kind == "int":
        return str(int(value))
    single = float(np.float32(value))  # what the float attribute holds: the exact float32, as a hex literal
    return f"{single.hex()}f /* {value!r} */"


def cpp_header(data: Mapping[str, Any] | None = None) -> str:
    """``ops/ort/op_schema.h``: per op a struct of ``static constexpr`` defaults (every section) and,
    when the op has them, its input names."""
    data = data or schema()
    lines = ["// Generated from graph_rewrite/op_schema.json by graph_rewrite/op_schema.py; do not edit.",
             "// Regenerate: python scripts/op_schema_header.py",
             "#pragma once", "", "#include <cstdint>", "", "namespace ortsparse::ort::schema {", ""]
    for op, spec in data["ops"].items():
        lines.append(f"struct {op} {{")
        for section in SECTIONS:
            for name, attribute in spec.get(section, {}).items():
                kind = attribute["type"]
                if "default" not in attribute:  # no constant to declare: say what absence means
                    absent = (f"the value of {attribute['default_from']}" if "default_from" in attribute
                              else "the node is refused")
                    lines.append(f"  // {name}: {kind}, {section}; absent: {absent}")
                    continue
                lines.append(f"  static constexpr {_CPP_TYPES[kind]} {name} = {_cpp_value(kind, attribute['default'])};"
                             f"  // {section}")
        if "inputs" in spec:
            names = ", ".join(json.dumps(name) for name in spec["inputs"])
            lines.append(f"  static constexpr int kInputCount = {len(spec['inputs'])};")
            lines.append(f"  static constexpr const char* kInputNames[kInputCount] = {{{names}}};")
        lines += ["};", ""]
    lines += ["}  // namespace ortsparse::ort::schema", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="render ops/ort/op_schema.h from graph_rewrite/op_schema.json")
    parser.add_argument("--write", metavar="ROOT", nargs="?", const=".",
                        help="write the header under the repository root ROOT (default: the current folder); "
                             "without it, print the header")
    args = parser.parse_args(argv)
    if args.write is None:
        print(cpp_header(), end="")
    else:
        (Path(args.write) / HEADER).write_text(cpp_header())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
