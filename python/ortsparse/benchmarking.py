"""Timing helpers every ortsparse benchmark uses: A/B alternation in one process, medians,
machine facts and the machine's read bandwidth (the M = 1 physical limit)."""
from __future__ import annotations

import json
import os
import platform
import statistics
import time
from typing import Callable

import numpy as np


def alternate(candidates: dict[str, Callable[[], object]], repeats: int, warmup: int = 2,
              min_seconds: float = 0.0) -> dict[str, list[float]]:
    """Runs the callables round-robin (A B A B ...) and returns each one's wall times in seconds.

    Alternating spreads machine noise (other tenants, frequency changes) over all candidates
    alike, so the ratio of medians is fair even when absolute times drift.
    """
    for _ in range(warmup):
        for fn in candidates.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in candidates}
    start = time.perf_counter()
    rounds = 0
    while rounds < repeats or time.perf_counter() - start < min_seconds:
        for name, fn in candidates.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
        rounds += 1
    return times


def median(values: list[float]) -> float:
    return statistics.median(values)


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
    import onnxruntime

    from . import __version__, _kernels

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


def report_outputs(path_stem: str, *extra: str) -> dict[str, str]:
    """{<stem>.json, <stem>.md, <stem><extra>...: what} of a report stem."""
    return {path_stem + ".json": "JSON report", path_stem + ".md": "markdown report",
            **{path_stem + suffix: f"{suffix} report" for suffix in extra}}


def check_report(path_stem: str, protected=(), *extra: str) -> None:
    """Before a long run: the report files may be written (graph_rewrite/output_paths.py rules:
    never over an input in ``protected``, a device, a FIFO or each other)."""
    from .graph_rewrite.output_paths import check_outputs

    check_outputs(report_outputs(path_stem, *extra), protected, create_dirs=True)


def write_report(path_stem: str, payload: dict, markdown: str, protected=()) -> tuple[str, str]:
    """Writes <stem>.json and <stem>.md together (making the folder; graph_rewrite/output_paths.py
    rules, ``protected``: the inputs); returns both paths."""
    from .graph_rewrite.output_paths import write_text_files

    json_path, md_path = report_outputs(path_stem)
    write_text_files({json_path: ("JSON report", json.dumps(payload, indent=1)), md_path: ("markdown report", markdown)},
                     protected, create_dirs=True)
    return json_path, md_path


def kernel_bench_parser(description: str, default_output: str, quick_help: str):
    """The flags every kernel-level benchmark (bench/bench_*.py) takes: --quick, --threads, --ms,
    --shapes KxN..., --repeats, -o. Returns the parser; :func:`kernel_bench_shapes` reads --shapes."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--ms", type=int, nargs="+", default=[1, 128])
    parser.add_argument("--shapes", nargs="+", default=None, help="KxN entries, e.g. 576x1536")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("-o", "--output", default=default_output)
    return parser


def kernel_bench_shapes(args, default: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """--shapes as (K, N) tuples, or ``default``."""
    if not args.shapes:
        return list(default)
    return [tuple(int(v) for v in s.split("x")) for s in args.shapes]
