"""Every numeric flag of every command is range-checked by the parser (ortsparse.flag_types): a value
out of its range, NaN, infinity or garbage is one line naming the flag, exit 2, before anything runs."""
from __future__ import annotations

import argparse
import math

import pytest

from ortsparse import flag_types
from ortsparse.cli import EXIT_USAGE, build_parser, main


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    return dict(commands.choices)


SUBPARSERS = _subparsers()


def _numeric_flags():
    for command, sub in SUBPARSERS.items():
        for action in sub._actions:  # noqa: SLF001
            if action.option_strings and action.type is not None:
                yield command, sub, action


def _bad_values(number: flag_types.Number) -> list[str]:
    """Values ``number`` must refuse: garbage, non-finite, a fraction for an integer, just outside each end."""
    values = ["abc", "nan", "inf", "-inf"]
    if number.kind is int:
        values += ["1.5", "0x10"]
        if number.minimum is not None:
            values.append(str(int(number.minimum) - 1))
        if number.maximum is not None:
            values.append(str(int(number.maximum) + 1))
    else:
        if number.minimum is not None:
            values.append(repr(number.minimum) if number.min_open else repr(number.minimum - 0.5))
        if number.maximum is not None:
            values.append(repr(number.maximum) if number.max_open else repr(number.maximum + 0.5))
    return values


CASES = [pytest.param(sub, action.option_strings[-1], value, id=f"{command} {action.option_strings[-1]}={value}")
         for command, sub, action in _numeric_flags() if isinstance(action.type, flag_types.Number)
         for value in _bad_values(action.type)]


def test_every_command_is_walked():
    assert {"rewrite", "genai-config", "tune", "quality", "calibrate", "bench", "validate", "sweep"} <= set(SUBPARSERS)
    assert len(CASES) > 300


def test_every_numeric_flag_has_a_range():
    """A flag typed plain int / float accepts 0, -1, nan or inf; only a choices list may stand in for a range."""
    loose = [f"{command} {action.option_strings[-1]}" for command, _, action in _numeric_flags()
             if action.type in (int, float) and not action.choices]
    assert not loose, f"numeric flags without a flag_types range: {loose}"


@pytest.mark.parametrize("command, sub, action", [pytest.param(c, s, a, id=f"{c} {a.option_strings[-1]}")
                                                  for c, s, a in _numeric_flags()
                                                  if isinstance(a.type, flag_types.Number)])
def test_every_default_is_in_range(command, sub, action):
    """The ranges are not stricter than the defaults the commands ship with."""
    defaults = action.default if isinstance(action.default, list) else [action.default]
    for default in defaults:
        if default not in (None, argparse.SUPPRESS):
            assert action.type(str(default)) == default


@pytest.mark.parametrize("sub, flag, value", CASES)
def test_out_of_range_is_one_line_exit_2(capsys, sub, flag, value):
    with pytest.raises(SystemExit) as stop:
        sub.parse_args([f"{flag}={value}"])
    assert stop.value.code == EXIT_USAGE
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    named = lines[0].split("argument ", 1)[-1].split(":", 1)[0].split("/")  # argparse names every alias
    assert flag in named and value in lines[0], lines[0]


@pytest.mark.parametrize("argv, flag", [
    (["tune", "m.onnx", "--text", "t.txt", "-o", "out", "--context", "-5"], "--context"),  # finding 18
    (["tune", "m.onnx", "--text", "t.txt", "-o", "out", "--threads", "0"], "--threads"),
    (["tune", "m.onnx", "--text", "t.txt", "-o", "out", "--threads", "-3"], "--threads"),
    (["calibrate", "m.onnx", "-o", "o.json", "--max-dppl", "nan"], "--max-dppl"),
    (["quality", "m.onnx", "--window-len", "1"], "--window-len"),  # finding 17
    (["quality", "m.onnx", "--window-len", "-5"], "--window-len"),
    (["quality", "m.onnx", "--windows", "0"], "--windows"),
    (["calibrate", "m.onnx", "-o", "o.json", "--calib-windows", "0"], "--calib-windows"),
    (["calibrate", "m.onnx", "-o", "o.json", "--window-len", "0"], "--window-len"),
    (["rewrite", "m.onnx", "-o", "o.onnx", "--verify", "1", "--verify-seed", "-1"], "--verify-seed"),
    (["rewrite", "m.onnx", "-o", "o.onnx", "--attn=popcount", "--attn-topk", "-1"], "--attn-topk"),
])
def test_reported_flags_are_refused_before_anything_runs(tmp_path, monkeypatch, capsys, argv, flag):
    monkeypatch.chdir(tmp_path)  # nothing named exists: the parser must stop first
    assert main(argv) == EXIT_USAGE
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"argument {flag}" in lines[0], lines
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("number, good, bad", [
    (flag_types.positive_int, ["1", "12"], ["0", "-1", "1.0", "", "1e3"]),
    (flag_types.non_negative_int, ["0", "7"], ["-1", "x"]),
    (flag_types.fraction, ["1", "0.25", "1e-9"], ["0", "-0.1", "1.0001", "nan", "inf"]),
    (flag_types.finite_float(-1.0, 1.0), ["-1", "1", "0"], ["-1.01", "1e308", "nan"]),
    (flag_types.int_in(1, 64), ["1", "64"], ["0", "65"]),
])
def test_number_types(number, good, bad):
    for text in good:
        assert math.isfinite(number(text))
    for text in bad:
        with pytest.raises(argparse.ArgumentTypeError, match="is not"):
            number(text)
