"""argparse types of every command's numeric flags: the parser checks range and finiteness, so a
bad value is one line naming the flag (``argument --windows: 0 is not an integer >= 1``), exit 2,
before anything is read or run.

Each type is a :class:`Number` that carries its range, so tests can derive the values a flag must
refuse (tests/cli/test_flag_ranges.py feeds them to every flag of every command). The library
checks its own arguments too (settings dataclasses, ``lm_windows``...): these types only make the
command line say it first and name the flag.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any


@dataclasses.dataclass(frozen=True)
class Number:
    """An argparse type: an ``int`` or a finite ``float`` within [minimum, maximum] (an end is
    excluded when ``*_open``; None: unbounded)."""

    kind: type = float
    minimum: float | None = None
    maximum: float | None = None
    min_open: bool = False
    max_open: bool = False

    @property
    def __name__(self) -> str:  # argparse names the type in some messages
        return self.describe()

    def describe(self) -> str:
        what = "an integer" if self.kind is int else "a finite number"
        low, high = self.minimum, self.maximum
        if low is not None and high is not None:
            return f"{what} in {'(' if self.min_open else '['}{low:g}, {high:g}{')' if self.max_open else ']'}"
        if low is not None:
            return f"{what} {'>' if self.min_open else '>='} {low:g}"
        if high is not None:
            return f"{what} {'<' if self.max_open else '<='} {high:g}"
        return what

    def accepts(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.minimum is not None and (value <= self.minimum if self.min_open else value < self.minimum):
            return False
        return not (self.maximum is not None and (value >= self.maximum if self.max_open else value > self.maximum))

    def __call__(self, text: str) -> int | float:
        try:
            value = int(text, 10) if self.kind is int else float(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"{text!r} is not {self.describe()}") from None
        if not self.accepts(value):
            raise argparse.ArgumentTypeError(f"{text} is not {self.describe()}")
        return value


def int_in(minimum: int | None = None, maximum: int | None = None) -> Number:
    """An integer in [minimum, maximum]."""
    return Number(int, minimum, maximum)


def finite_float(minimum: float | None = None, maximum: float | None = None, *, min_open: bool = False,
                 max_open: bool = False) -> Number:
    """A finite float in the range (NaN and +-inf refused)."""
    return Number(float, minimum, maximum, min_open, max_open)


positive_int = int_in(1)
non_negative_int = int_in(0)
any_finite = finite_float()
non_negative_float = finite_float(0.0)
positive_float = finite_float(0.0, min_open=True)
fraction = finite_float(0.0, 1.0, min_open=True)  # (0, 1]: a share that cannot be nothing
unit_interval = finite_float(0.0, 1.0)  # [0, 1]
seed = int_in(0, 2**32 - 1)  # numpy's legacy generators take seeds below 2^32
threads = int_in(1, 1024)
window_len = int_in(2, 1 << 20)  # a window scores window_len - 1 next-token predictions


def add_input_arguments(group: Any, prefix: str = "") -> None:
    """The generated inputs' flags (``--{prefix}shape``, ``--{prefix}budget``, ``--{prefix}seed``), one
    spelling for ``rewrite-onnx --verify-*`` and ``ortsparse validate``."""
    group.add_argument(f"--{prefix}shape", action="append", metavar="SPEC",
                       help="sizes for dynamic dims: dim=INT or input=AxBxC, comma separated, repeatable")
    group.add_argument(f"--{prefix}budget", type=non_negative_float, default=None, metavar="REL",
                       help="relative L2 error allowed when some layer is approximate (default 0.5); "
                            "exact rewrites always use 1e-4")
    group.add_argument(f"--{prefix}seed", type=seed, default=0, metavar="SEED",
                       help="seed of the generated inputs")
