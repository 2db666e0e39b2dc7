"""Where an ungated quantized LM head runs, decided by a measurement on this machine: as stored
(``MatMulNBits``) or on our kernel keeping every row (``KwtaBlockMatMul`` with :data:`DENSE_ON_OURS`).

At one decode token the head is the widest layer. Which kernel is faster depends on the head and
the machine: on Gemma-3's 640 x 262144 head ours was slower (issue 29). So each candidate head is
timed: a single-node graph holding the head's real weights, as MatMulNBits and as its rewrite, fed
one decode row ``[1, 1, K]``, both sessions in this process with the same threads, alternating for a
second or two (session set-up included, 4-12 s for a 640 x 262144 int8 head on this 2-core machine
under load, ~4 s for SmolLM2's), by :func:`ortsparse.benchmarking.time_from_memory` with a flush
before each run (in a decode step the whole model's weights pass between two uses of the head; a
rotation of two forms of one head would keep it in the cache: the protocol states what that did).
Each alternation is a pair of runs back to back (the same load on both).
Ours is kept only when it is faster in more pairs than chance explains (one-sided sign test, p <
:data:`SIGNIFICANCE`): under load the two medians of the same 640 x 262144 head came out 1.08x one
way and 0.92x the other in two runs, so a plain "faster median" flipped. Otherwise — slower, a tie,
or within the noise — MatMulNBits stays (the graph as it was). A head our rewrite does not take, or
whose inputs are not constant, stays as it is.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper

from .. import flag_types
from ..benchmarking import python_command, sign_test, time_from_memory
from ..graph_rewrite.config import NodePlan
from ..graph_rewrite.layer_settings import rewritten_with
from ..graph_rewrite.node_models import layers_alone
from ..runtime import open_session, thread_options

# KwtaBlockMatMul settings that keep every row: the layer runs dense on our kernel.
DENSE_ON_OURS = {"k_frac": 1.0, "block": 1}
OURS_OP = "KwtaBlockMatMul"
SIGNIFICANCE = 0.05  # of the sign test that ours wins more pairs than chance


@dataclasses.dataclass
class HeadTiming:
    """One head's measurement: microseconds per decode-row call (medians over ``runs`` alternations),
    the median of the paired ratios ours / MatMulNBits, and the sign test on the pairs that decides."""

    name: str
    k: int
    n: int
    matmulnbits_us: float | None
    ours_us: float | None
    runs: int
    on_ours: bool
    note: str
    ratio: float | None = None
    ours_wins: int | None = None  # pairs in which ours was faster
    p_value: float | None = None  # one-sided sign test: ours faster in this many pairs by chance

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        if self.matmulnbits_us is None or self.ours_us is None:
            return f"{self.name}: stays MatMulNBits ({self.note})"
        where = "dense on our kernel" if self.on_ours else "stays MatMulNBits"
        return (f"{self.name} ({self.k} x {self.n}): MatMulNBits {self.matmulnbits_us:.0f} us, ours dense "
                f"{self.ours_us:.0f} us per decode row, paired ratio {self.ratio:.3f}, ours faster in "
                f"{self.ours_wins}/{self.runs} pairs (sign test p {self.p_value:.2g}; alternating, this machine): "
                f"{where}")


def single_node_model(model: onnx.ModelProto, name: str) -> tuple[onnx.ModelProto, int, int]:
    """(the node ``name`` alone with its weights, reading its input [1, 1, K]
    (:func:`~ortsparse.graph_rewrite.node_models.layers_alone`), K, N)."""
    node = next((n for n in model.graph.node if n.name == name), None)
    if node is None:
        raise ValueError(f"no node {name!r} in the model")
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    k, n = int(attributes["K"]), int(attributes["N"])
    return layers_alone(model, [name], {node.input[0]: [1, 1, k]}), k, n


def time_head(model: onnx.ModelProto, name: str, *, threads: int = 1, seconds: float = 1.5,
              fresh_process: bool = True) -> HeadTiming:
    """MatMulNBits vs our dense form of the head ``name`` of ``model`` (weights loaded), alternating
    for about ``seconds`` (at least 5 runs each, after one warm-up run each), the caches flushed
    before each timed run. ``fresh_process``: timed in a new Python process holding only the head,
    as an app that loads the model holds it. Inside tune's process, after calibration, SmolLM2's int4
    head took MatMulNBits 1703 us and ours 1701 (it stayed on MatMulNBits); alone, 1994-2017 and
    1673-1752 (ours 0.83-0.87x). In the decode loop the tuned model ran 1.19x its input with the head
    on ours and 1.13x without (reports/bench_tune_int4_head_2026-11-28.md). The cause inside tune's
    process was not found; a process of its own measures what the app will see."""
    try:
        nbits, k, n = single_node_model(model, name)
    except (ValueError, KeyError) as error:
        return HeadTiming(name, 0, 0, None, None, 0, False, f"not measured: {error}")
    ours = rewritten_with(nbits, NodePlan("kwta", {name: DENSE_ON_OURS}, rest=None))
    if not any(node.op_type == OURS_OP for node in ours.graph.node):
        return HeadTiming(name, k, n, None, None, 0, False, "our rewrite does not take this head")
    graphs = (nbits.SerializeToString(), ours.SerializeToString())
    if fresh_process:
        # A child interpreter running this module (not multiprocessing: its spawn re-runs the
        # caller's script, which an unguarded user script cannot survive).
        with tempfile.TemporaryDirectory(prefix="ortsparse-head-") as tmp:
            paths = [Path(tmp) / "matmulnbits.onnx", Path(tmp) / "ours.onnx"]
            for path, graph in zip(paths, graphs):
                path.write_bytes(graph)
            done = subprocess.run(python_command("-m", __name__, *map(str, paths), str(k), str(threads), str(seconds)),
                                  capture_output=True, text=True, check=False)
        if done.returncode != 0:
            detail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            return HeadTiming(name, k, n, None, None, 0, False, f"not measured: the timing process failed ({detail})")
        times = json.loads(done.stdout.strip().splitlines()[-1])
    else:
        times = _time_pair(*graphs, k, threads, seconds)
    return _timing(name, k, n, times)


def _time_pair(nbits: bytes | str, ours: bytes | str, k: int, threads: int, seconds: float) -> dict[str, list[float]]:
    """Both single-node graphs' run times, paired (the i-th runs back to back), caches flushed before each."""
    options = thread_options(threads)
    sessions = {"matmulnbits": open_session(nbits, options), "ours": open_session(ours, options)}
    row = np.random.default_rng(0).standard_normal((1, 1, k)).astype(np.float32)
    feeds = {key: {session.get_inputs()[0].name: row} for key, session in sessions.items()}
    runners = {key: (lambda s=session, f=feeds[key]: s.run(None, f)) for key, session in sessions.items()}
    # Warm-up: first-run allocations and packing.
    return time_from_memory(runners, flush=True, repeats=5, warmup=1, min_seconds=seconds)


def _timing(name: str, k: int, n: int, times: dict[str, list[float]]) -> HeadTiming:
    nbits_us, ours_us = (1e6 * float(np.median(times[key])) for key in ("matmulnbits", "ours"))
    ratio = float(np.median(np.divide(times["ours"], times["matmulnbits"])))
    pairs = len(times["ours"])
    wins = int(np.sum(np.less(times["ours"], times["matmulnbits"])))
    p_value = sign_test(wins, pairs)
    on_ours = p_value < SIGNIFICANCE
    verdict = "faster on ours" if on_ours else "not shown faster on ours"
    return HeadTiming(name, k, n, nbits_us, ours_us, pairs, on_ours,
                      f"ours/MatMulNBits time {ratio:.3f} (median of paired runs), ours faster in {wins}/{pairs} "
                      f"pairs: {verdict}", ratio, wins, p_value)


def place_heads(model: onnx.ModelProto, candidates: Sequence[str], *, threads: int = 1, seconds: float = 1.5,
                log: Callable[[str], None] = print) -> tuple[list[str], list[dict[str, Any]]]:
    """(the ``candidates`` — ungated MatMulNBits heads — that are faster dense on our kernel, one
    measurement record per candidate)."""
    timings = [time_head(model, name, threads=threads, seconds=seconds) for name in candidates]
    for timing in timings:
        log(f"head placement: {timing.describe()}")
    return [t.name for t in timings if t.on_ours], [t.to_dict() for t in timings]


class _OneLineParser(argparse.ArgumentParser):
    """Usage errors as one line, exit 2 (as the ortsparse commands give them)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def main(argv: Sequence[str] | None = None) -> int:
    """:func:`time_head`'s child process: prints the paired run times of the two single-node graphs
    as one JSON line."""
    parser = _OneLineParser(prog=f"python -m {__spec__.name}", description=main.__doc__)
    parser.add_argument("nbits", metavar="NBITS.onnx", help="the head as MatMulNBits")
    parser.add_argument("ours", metavar="OURS.onnx", help="the head on our kernel")
    parser.add_argument("k", metavar="K", type=flag_types.positive_int, help="the head's input width")
    parser.add_argument("threads", metavar="THREADS", type=flag_types.threads)
    parser.add_argument("seconds", metavar="SECONDS", type=flag_types.non_negative_float,
                        help="alternate for at least this long")
    args = parser.parse_args(argv)
    for path in (args.nbits, args.ours):
        if not Path(path).is_file():
            parser.error(f"{path} is not a file")
    try:
        times = _time_pair(args.nbits, args.ours, args.k, args.threads, args.seconds)
    except Exception as error:  # not ONNX (ValueError), not a head's single-node graph, or a K it does not take
        if not isinstance(error, ValueError) and not type(error).__module__.startswith("onnxruntime"):
            raise
        parser.error(f"cannot time {args.nbits} and {args.ours} at K={args.k}: "
                     f"{(str(error).splitlines() or [type(error).__name__])[0]}")
    print(json.dumps(times))
    return 0


if __name__ == "__main__":
    sys.exit(main())
