"""What every ortsparse benchmark (bench/*.py, ``ortsparse bench``) shares: sessions with the
benchmark thread policy, A/B alternation in one process and medians, machine facts and the
machine's read bandwidth (the M = 1 physical limit), the kernel benchmarks' flags, and the report
writers (JSON + markdown, their common header, JSON of numpy values, package versions)."""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime

from . import __version__, _kernels, flag_types
from .graph_rewrite.output_paths import check_outputs, write_text_files
from .runtime import open_session, thread_options


def alternate(candidates: dict[str, Callable[[], object]], repeats: int, warmup: int = 2,
              min_seconds: float = 0.0, before: Callable[[], object] | None = None) -> dict[str, list[float]]:
    """Runs the callables round-robin (A B A B ...) and returns each one's wall times in seconds.

    Alternating spreads machine noise (other tenants, frequency changes) over all candidates
    alike, so the ratio of medians is fair even when absolute times drift. ``before``: called,
    untimed, before each timed call (e.g. a cache flush).
    """
    for _ in range(warmup):
        for fn in candidates.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in candidates}
    start = time.perf_counter()
    rounds = 0
    while rounds < repeats or time.perf_counter() - start < min_seconds:
        for name, fn in candidates.items():
            if before is not None:
                before()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
        rounds += 1
    return times


def sign_test(wins: int, pairs: int) -> float:
    """P(at least ``wins`` of ``pairs`` fair coin flips): the one-sided sign test on paired runs."""
    # Integer numerator and denominator: a float 2.0 ** pairs overflows past 1023 pairs.
    return sum(math.comb(pairs, j) for j in range(wins, pairs + 1)) / 2 ** pairs


def median(values: list[float]) -> float:
    return statistics.median(values)


def session(model: Any, threads: int):
    """A CPU session for a benchmark candidate: ``threads`` intra-op threads, spinning off above one
    (:func:`ortsparse.runtime.thread_options`); the op library when the model uses it."""
    return open_session(model, thread_options(threads))


def time_sessions(sessions: Mapping[str, Any], feeds: Mapping[str, Any], repeats: int, warmup: int = 2,
                  min_seconds: float = 0.0, per_session: bool = False,
                  before: Callable[[], object] | None = None) -> dict[str, list[float]]:
    """:func:`alternate` over ``session.run(None, feeds)`` of every session. ``feeds``: one feed dict
    for all, or (``per_session``) a feed dict per session name."""
    runners = {name: (lambda s=s, f=(feeds[name] if per_session else feeds): s.run(None, f))
               for name, s in sessions.items()}
    return alternate(runners, repeats=repeats, warmup=warmup, min_seconds=min_seconds, before=before)


def read_bandwidth_gbs(megabytes: int = 512, repeats: int = 5) -> dict[str, float]:
    """Read bandwidth from DRAM two ways (a reduction and a matrix-vector product), best of N."""
    n = megabytes * 1024 * 1024 // 4
    a = np.ones(n, dtype=np.float32)
    matrix = a.reshape(-1, 4096)
    vec = np.ones(4096, dtype=np.float32)
    best_sum = best_dot = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a.sum()
        best_sum = min(best_sum, time.perf_counter() - t0)
        t0 = time.perf_counter()
        matrix @ vec
        best_dot = min(best_dot, time.perf_counter() - t0)
    return {"numpy_sum_gbs": a.nbytes / best_sum / 1e9, "numpy_matvec_gbs": a.nbytes / best_dot / 1e9}


def machine_info() -> dict[str, object]:
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "isa": _kernels.active_isa(),
        "python": platform.python_version(),
        "onnxruntime": onnxruntime.__version__,
        "numpy": np.__version__,
        "ortsparse": __version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def command_line(prefix: str, argv: Sequence[str] | None = None) -> str:
    """The command a report quotes: ``prefix`` and the arguments (``argv``, else the process's)."""
    return (prefix + " " + " ".join(argv if argv is not None else sys.argv[1:])).strip()


def report_header(title: str, command: str, info: Mapping[str, Any], bandwidth: Mapping[str, float] | None = None,
                  matvec_note: str = "numpy matvec") -> list[str]:
    """The first lines of a benchmark's markdown: title, command, machine (:func:`machine_info`) and,
    when measured, the read bandwidth (:func:`read_bandwidth_gbs`), then a blank line."""
    lines = [f"# {title}", "", f"Command: `{command}`  ",
             f"Machine: {info['cpu']}, {info['cores']} cores, ISA {info['isa']}, onnxruntime "
             f"{info['onnxruntime']}, {info['date']}  "]
    if bandwidth is not None:
        lines.append(f"Read bandwidth: {bandwidth['numpy_sum_gbs']:.1f} GB/s (numpy sum), "
                     f"{bandwidth['numpy_matvec_gbs']:.1f} GB/s ({matvec_note})")
    return lines + [""]


def report_outputs(path_stem: str, *extra: str) -> dict[str, str]:
    """{<stem>.json, <stem>.md, <stem><extra>...: what} of a report stem."""
    return {path_stem + ".json": "JSON report", path_stem + ".md": "markdown report",
            **{path_stem + suffix: f"{suffix} report" for suffix in extra}}


def check_report(path_stem: str, protected=(), *extra: str) -> None:
    """Before a long run: the report files may be written (graph_rewrite/output_paths.py rules:
    never over an input in ``protected``, a device, a FIFO or each other)."""
    check_outputs(report_outputs(path_stem, *extra), protected, create_dirs=True)


def write_report(path_stem: str, payload: dict, markdown: str, protected=()) -> tuple[str, str]:
    """Writes <stem>.json and <stem>.md together (making the folder; graph_rewrite/output_paths.py
    rules, ``protected``: the inputs); returns both paths."""
    json_path, md_path = report_outputs(path_stem)
    write_text_files({json_path: ("JSON report", json.dumps(payload, indent=1)), md_path: ("markdown report", markdown)},
                     protected, create_dirs=True)
    return json_path, md_path


def kernel_bench_parser(description: str, default_output: str, quick_help: str):
    """The flags every kernel-level benchmark (bench/bench_*.py) takes: --quick, --threads, --ms,
    --shapes KxN..., --repeats, -o. Returns the parser; :func:`kernel_bench_shapes` reads --shapes."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--threads", type=flag_types.threads, nargs="+", default=[1, 2])
    parser.add_argument("--ms", type=flag_types.positive_int, nargs="+", default=[1, 128])
    parser.add_argument("--shapes", nargs="+", default=None, help="KxN entries, e.g. 576x1536")
    parser.add_argument("--repeats", type=flag_types.positive_int, default=None)
    parser.add_argument("-o", "--output", default=default_output)
    return parser


def kernel_bench_repeats(args, k: int, n: int, m: int, quick: int = 3) -> int:
    """--repeats, else per case: ``quick`` with --quick, 7 for big cases (more work than a 576 x 1536
    layer at M = 128), 25 for M > 1, 60 for M = 1 (fast, noisy calls need more samples)."""
    if args.repeats:
        return args.repeats
    if args.quick:
        return quick
    return 7 if k * n * m > 576 * 1536 * 128 else 25 if m > 1 else 60


def kernel_bench_shapes(args, default: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """--shapes as (K, N) tuples, or ``default``."""
    if not args.shapes:
        return list(default)
    return [tuple(int(v) for v in s.split("x")) for s in args.shapes]


def plot_skipped() -> str | None:
    """None when matplotlib can draw a report's PNG (its file backend chosen), else the note a
    command prints and reports instead: the plot is optional (the ``plot`` extra), the reports are not."""
    try:
        import matplotlib
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install 'ortsparse[plot]')"
    matplotlib.use("Agg")
    return None


def versions() -> dict[str, str]:
    """Versions a report records (quality, validate)."""
    return {"ortsparse": __version__, "onnxruntime": onnxruntime.__version__, "onnx": onnx.__version__,
            "numpy": np.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "cpus": str(os.cpu_count())}


def json_default(value: Any) -> Any:
    """``json.dumps(..., default=json_default)``: numpy scalars and arrays, paths."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


# --------------------------------------------------------------------------------------------
# A standard neighbour (docs/measure.md "The machine has moods"): a second program on the machine
# that streams a buffer larger than the last-level cache, as a user's other programs do.

# The start of every child Python process the package runs (python_command): its import path set
# from argv, then the -c code, -m module or script run as `python ...` would run it.
_CHILD_START = r"""
import os, runpy, sys
_, path, what, target, *arguments = sys.argv
sys.path[:0] = [entry for entry in path.split(os.pathsep) if entry]
if what == "-c":
    sys.argv = ["-c", *arguments]
    exec(compile(target, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
elif what == "-m":
    sys.argv = [target, *arguments]
    runpy.run_module(target, run_name="__main__", alter_sys=True)
else:
    sys.argv = [target, *arguments]
    sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
    runpy.run_path(target, run_name="__main__")
"""


def python_command(*arguments: str | os.PathLike, path: Sequence[str | os.PathLike] = ()) -> list[str]:
    """The command line of a child Python process running ``arguments`` as ``python ARGUMENTS`` would
    (``-c CODE ...``, ``-m MODULE ...`` or ``SCRIPT ...``), isolated from the caller's folder: ``-I``
    keeps the current directory off its ``sys.path`` (``python -c``/``-m`` put it first, so a
    ``numpy.py`` or an ``ortsparse/`` where the user stands would be imported instead of the installed
    ones) and ignores PYTHON* variables and the user site. The child gets this process's import path
    instead, the current directory left out, so it imports the same ortsparse and dependencies (an
    editable install, a PYTHONPATH or a user-site install too); ``path``: folders put before it (a
    script's own modules)."""
    here = os.path.realpath(os.getcwd())
    package_root = str(Path(__file__).resolve().parent.parent)  # where this ortsparse was imported from
    inherited = [entry for entry in sys.path if entry and os.path.realpath(entry) != here]
    if package_root not in inherited:  # it was imported from the current directory itself
        inherited.insert(0, package_root)
    search = os.pathsep.join([*map(os.fspath, path), *inherited])
    first, *rest = map(os.fspath, arguments)
    if first in ("-c", "-m"):
        what, target, rest = first, rest[0], rest[1:]
    else:
        what, target = "script", first
    return [sys.executable, "-I", "-c", _CHILD_START, search, what, target, *rest]


def shown_command(command: Sequence[str | os.PathLike]) -> str:
    """A command line for a log: a :func:`python_command` as ``python -I ARGUMENTS`` (its start code
    and import path left out)."""
    words = list(map(os.fspath, command))
    if words[1:4] == ["-I", "-c", _CHILD_START]:
        what, rest = words[5], words[6:]
        words = ["python", "-I", *([] if what == "script" else [what]), *rest]
    return " ".join(words)


NEIGHBOURS = ("none", "stream")

_STREAM_NEIGHBOUR = r"""
import os, sys, time
import numpy as np
size, seconds, parent = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
buffer = np.ones(size // 4, dtype=np.float32)
print("ready", flush=True)
start = time.perf_counter(); passes = 0
# Bounded: stops when told (stdin closes), when the parent is gone, or after `seconds`.
import select
while time.perf_counter() - start < seconds and os.getppid() == parent:
    buffer.sum(); passes += 1
    if select.select([sys.stdin], [], [], 0)[0]:
        break
elapsed = time.perf_counter() - start
print(f"{passes * buffer.nbytes / max(elapsed, 1e-9) / 1e9:.2f} {elapsed:.1f}", flush=True)
"""


def last_level_cache_bytes(default: int = 32 << 20) -> int:
    """The largest CPU cache's size from sysfs (``default`` when the kernel does not say)."""
    best = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip().upper()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            best = max(best, int(digits) * scale)
    return best or default


def cache_flush_bytes() -> int:
    """Twice the last-level cache sysfs reports, at least 64 MiB; a report over 64 MiB (virtual
    machines overstate it: 480 MiB on a 32 MiB-L3 machine here) counts as 64 MiB, so a flush stays
    ~10 ms."""
    llc = last_level_cache_bytes()
    return 2 * min(max(llc, 32 << 20), 64 << 20)


def cache_flusher() -> Callable[[], object]:
    """A call that reads :func:`cache_flush_bytes` of memory: afterwards a layer's weights come from
    memory, as in a decode step, where every other layer's weights pass between two uses of one
    layer's (timing a layer over and over without it measures weights the L3 keeps)."""
    buffer = np.ones(cache_flush_bytes() // 8, dtype=np.float64)
    return buffer.sum


def time_from_memory(runners: dict[Any, Callable[[], object]], *, rotation_bytes: int = 0, flush: bool | None = None,
                     repeats: int = 5, warmup: int = 1, min_seconds: float = 0.0) -> dict[Any, list[float]]:
    """The one protocol for timing layers as a decode step runs them — weights from memory, code and
    ONNX Runtime's own state warm — used by tune's layer speed and by head placement: the
    ``runners`` (sessions of single layers or classes of layers, :mod:`ortsparse.graph_rewrite.node_models`)
    run in **one rotation** (:func:`alternate`: A B C ... A B C, ``warmup`` untimed rounds first,
    then at least ``repeats`` rounds and ``min_seconds``); the i-th runs of two runners are a pair
    (the same load on both). ``rotation_bytes``: the weights one round reads (every runner's).

    No flush by default: between two runs of a session the other sessions' weights pass through the
    caches, as in a decode step every other layer's weights pass between two uses of a layer's.
    Flushing before every run made everything cold, code included: SmolLM2's int8 q/k/v unit took
    90.4 us flushed, 59.2 in the rotation and 59.3 in the decode step's own profile; per class the
    rotation was within 0-7% of the profile in two runs (11-16% under in a third, during another
    experiment), the flush 21-68% slower (reports/layer_speed_regimes_2026-11-28.md and
    ..._rerun.md). On int4, whose 84 MiB rotation keeps part of itself in the 32 MiB L3, the rotation
    was 6-18% under the profile and the flush 28-71% over it (an earlier run: rotation 28-38% under).
    A spacer read between runs overshot instead, +20-34%: not kept.

    A flush before each timed run (:func:`cache_flusher`) when the rotation would keep its weights
    in the cache: ``rotation_bytes`` under the last-level cache (half :func:`cache_flush_bytes`:
    sysfs's size capped at 64 MiB, as virtual machines overstate it), or ``flush=True``. Head
    placement asks for it: its rotation is two forms of one head, and timed without a flush
    SmolLM2's 28 MiB int8 head sat in the 32 MiB L3 and the answer flipped — MatMulNBits 1.02-1.08x
    faster warm, ours 1.17x faster flushed (2442-2522 vs 2901-2915 us), and in the decode step's own
    profile the head took MatMulNBits 2554 us. ``flush=False`` forces the rotation alone."""
    if flush is None:
        flush = rotation_bytes < cache_flush_bytes() // 2
    return alternate(runners, repeats=repeats, warmup=warmup, min_seconds=min_seconds,
                     before=cache_flusher() if flush else None)


class StreamNeighbour:
    """A child process on the machine's last CPU that sums a 256 MiB buffer (8x this machine kind's
    32 MiB L3; at least 4x the last-level cache sysfs reports, which virtual machines may overstate)
    in a loop while the ``with`` block runs (at most ``max_seconds``). ``result`` after the block: the
    neighbour's CPU, buffer size and the read bandwidth it achieved — a report says what ran beside
    the benchmark."""

    def __init__(self, max_seconds: float = 4 * 3600.0):
        self.max_seconds = max_seconds
        self.process = None
        self.result: dict[str, Any] = {}

    def __enter__(self) -> "StreamNeighbour":
        import subprocess

        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        llc = last_level_cache_bytes()
        size = max(256 << 20, 4 * llc) if llc <= (64 << 20) else 256 << 20
        self.process = subprocess.Popen(
            python_command("-c", _STREAM_NEIGHBOUR, str(size), str(self.max_seconds), str(os.getpid())),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env={**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"})
        if cpus and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(self.process.pid, {cpus[-1]})
        ready = self.process.stdout.readline().strip()
        if ready != "ready":
            self.process.kill()
            raise RuntimeError("the stream neighbour did not start")
        self.result = {"kind": "stream", "cpu": cpus[-1] if cpus else None, "buffer_mb": size / 1e6,
                       "reported_llc_mb": llc / 1e6}
        return self

    def __exit__(self, *exc) -> None:
        if self.process is None:
            return
        try:
            out, _ = self.process.communicate(input="stop\n", timeout=30)
            fields = out.split()
            if len(fields) >= 2:
                self.result.update(read_gbs=float(fields[0]), seconds=float(fields[1]))
        except Exception:  # noqa: BLE001 (never let the neighbour outlive or fail the benchmark)
            self.process.kill()
            self.process.wait()


def neighbour(kind: str | None):
    """The context manager that runs ``kind`` beside a benchmark: :class:`StreamNeighbour` for
    ``"stream"``, nothing for ``"none"``/None."""
    import contextlib

    if kind in (None, "none"):
        return contextlib.nullcontext(None)
    if kind == "stream":
        return StreamNeighbour()
    raise ValueError(f"unknown neighbour {kind!r} (one of {', '.join(NEIGHBOURS)})")


def ratio_summary(values: Sequence[float]) -> dict[str, float]:
    """A ratio measured in several rounds: its minimum (the claim), median and maximum."""
    ordered = sorted(float(v) for v in values)
    return {"min": ordered[0], "median": float(statistics.median(ordered)), "max": ordered[-1], "rounds": len(ordered)}


# With ORT's spinning pool, the pause between one model's run and the next model's: the idle pool
# threads spin on a core for milliseconds after a Run and would slow the next model.
SPINNING_SETTLE_S = 0.2


def threads_policy(spinning: bool) -> str:
    """A report's sentence on how its runs above one thread were set up."""
    if spinning:
        return ("Above 1 thread: ORT's default spinning pool (what an app gets when it sets nothing); the models ran "
                f"one after another, {SPINNING_SETTLE_S} s apart, never alternated step by step (an idle spinning "
                "pool keeps a core busy for milliseconds).")
    return "Above 1 thread: session.intra_op.allow_spinning=0."


def neighbour_line(info: Mapping[str, Any] | None) -> str:
    """What ran beside the benchmark, in one sentence."""
    if not info or info.get("kind", "none") == "none":
        return "Neighbour: none (nothing of ours ran beside the benchmark; other programs on the machine may have)."
    text = (f"Neighbour: `--neighbour stream` — a process on CPU {info.get('cpu')} summing a "
            f"{info.get('buffer_mb', 0):.0f} MB buffer in a loop for the whole run")
    if "read_gbs" in info:
        text += f" ({info['read_gbs']:.1f} GB/s over {info.get('seconds', 0):.0f} s)"
    return text + "."


def op_attributes(text: str) -> dict[str, Any]:
    """A benchmark's op settings from the command line: ``'select=pages,topk=256'`` ->
    ``{'select': 'pages', 'topk': 256}`` (each value an int, else a float, else the string).
    Raises ValueError on an entry that is not name=value."""
    out: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        if "=" not in item:
            raise ValueError(f"{text!r}: {item!r} is not name=value")
        name, value = item.split("=", 1)
        for cast in (int, float, str):
            try:
                out[name] = cast(value)
                break
            except ValueError:
                pass
    return out
