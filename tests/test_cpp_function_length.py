"""No C++ function in ops/ is over 120 lines (issue 37 item 5): a driver reads as check, plan, run
the steps, each step a function with a name (docs/design.md). The pybind modules' register_*
functions are binding tables and exempt. Lengths run from a definition's first line (its
signature) to its closing brace; a lambda or class inside a function counts with it."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 120
NOT_CALLS = {"if", "for", "while", "switch", "catch", "return", "sizeof", "decltype", "alignof", "static_assert"}


def code_only(source: str) -> str:
    """The source with comments, string / char literals and preprocessor lines blanked (newlines
    kept, so offsets map to the same lines)."""
    blank = lambda text: re.sub(r"[^\n]", " ", text)
    pattern = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|^[ \t]*#(?:\\\n|[^\n])*',
                         re.DOTALL | re.MULTILINE)
    return pattern.sub(lambda m: blank(m.group(0)), source)


def function_lengths(source: str) -> list[tuple[str, int, int]]:
    """(name, first line, length in lines) of each function defined at namespace or class scope."""
    code = code_only(source)
    found, stack, statement = [], [], 0
    for at, char in enumerate(code):
        if char == ";":
            statement = at + 1
        elif char == "{":
            head = code[statement:at]
            kind = "block"
            if "function" not in [k for k, _ in stack]:
                before_paren = head.split("(")[0].split()
                is_scope = re.search(r"\b(namespace|class|struct|union|enum)\b[^()]*$", head) or not head.strip()
                if "(" in head and before_paren and before_paren[-1] not in NOT_CALLS and not is_scope \
                        and not head.rstrip().endswith("="):
                    first = statement + len(head) - len(head.lstrip())
                    kind = "function"
                    found.append([before_paren[-1], code.count("\n", 0, first) + 1, None])
            stack.append((kind, len(found) - 1))
            statement = at + 1
        elif char == "}":
            kind, index = stack.pop()
            if kind == "function":
                found[index][2] = code.count("\n", 0, at) + 1 - found[index][1] + 1
            statement = at + 1
    return [(name, line, length) for name, line, length in found]


def test_the_counter_measures_signature_to_closing_brace():
    body = "\n".join(f"  x += {i};  // }} {{ not braces" for i in range(5))
    source = ("namespace a {\nstruct S {\n  int f() const {\n    return 1;\n  }\n};\n"
              f"int Kernel::run(int x,\n                int y) {{\n  auto g = [&]() {{ return \"}}\"; }};\n"
              f"  if (x) {{\n{body}\n  }}\n  return x;\n}}\n}}  // namespace a\n")
    assert function_lengths(source) == [("f", 3, 3), ("Kernel::run", 7, 12)]


def test_no_function_in_ops_is_over_the_limit():
    too_long = []
    for path in sorted((ROOT / "ops").rglob("*")):
        if path.suffix not in (".cc", ".h"):
            continue
        for name, line, length in function_lengths(path.read_text()):
            binding_table = path.parent.name == "pybind" and name.startswith("register_")
            if length > MAX_LINES and not binding_table:
                too_long.append(f"{path.relative_to(ROOT)}:{line} {name}: {length} lines")
    assert not too_long, "split into named steps:\n" + "\n".join(too_long)
