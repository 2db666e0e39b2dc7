"""Decode speed: tokens/s in the real loop (:mod:`ortsparse.measure.decode`), every model side by side
in one process, with top-1 agreement, bytes read per step and the machine's read bandwidth beside the
speed (docs/measure.md "Speed"). ``ortsparse bench`` (:mod:`ortsparse.commands.bench`) is its command;
tune, sweeps and calibration call :func:`decode_speed`.

Models are KV-cache decoder graphs run in ONNX Runtime (our exports, ORT's MatMulNBits baselines of
them) and onnxruntime-genai folders, which run twice: their graph in an ONNX Runtime session
(runner ``ort``) and the folder through ``onnxruntime_genai.Generator`` (runner ``og``, the way
apps run it), so a difference between the two is visible.

Bytes per step: the weights of every linear layer (MatMul / Gemm / MatMulNBits / KwtaBlockMatMul,
packed weights and scales included; gated layers at the keep ratio the op library counted over
the decode steps), the K/V cache read by attention at the mean position of the timed steps, and
the copy of the past into a new present the graph makes when past and present are separate buffers
(ORT runner: read + write of the cache; the Generator shares one buffer and copies nothing). The
bound is read bandwidth / those bytes.
"""
from __future__ import annotations

import argparse
import gc
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from onnx import helper

from .. import flag_types
from ..benchmarking import (NEIGHBOURS, machine_info, neighbour_line, ratio_summary, read_bandwidth_gbs, report_header,
                            threads_policy)
from ..benchmarking import neighbour as neighbour_process
from ..runtime import check_model_file, genai_decoder, load_proto
from ..zoo.models import genai_folder_path, model_path
from .decode import decode_loop, open_stepper, plan
from .op_metrics import keep_ratios

LINEAR_OPS = {"MatMul", "Gemm", "KwtaBlockMatMul", "MatMulNBits"}
RUNNERS = ("ort", "og")
DEFAULT_CONTEXTS = (128, 1024)
BASELINE_CONTEXTS = (128, 1024, 4096, 8192)

# Model names `ortsparse bench` knows from the cache (`ortsparse models`): a KV export, or a genai
# folder. ours-int8 / ours-int4: ORT's MatMulNBits of our TorchScript KV export at accuracy level 4.
CACHE_MODELS: dict[str, tuple[str, str]] = {
    "ours": ("kv", "kv.torchscript"),
    "ours-dynamo": ("kv", "kv.dynamo"),
    "ours-int8": ("kv", "kv.torchscript.int8.acc4"),
    "ours-int4": ("kv", "kv.torchscript.int4.acc4"),
    "genai-fp32": ("genai", "fp32"),
    "genai-int8": ("genai", "int8"),
    "genai-int4": ("genai", "int4"),
}


@dataclass
class Candidate:
    """One model under test. ``source``: a KV graph (path or ModelProto) or a genai folder;
    ``runners``: how it runs (``ort`` and, for a genai folder, ``og``)."""

    name: str
    source: Any
    runners: tuple[str, ...] = ("ort",)

    @property
    def is_genai(self) -> bool:
        return isinstance(self.source, (str, Path)) and Path(self.source).is_dir()

    @property
    def graph(self) -> Any:
        """The decoder graph (for byte accounting): the KV graph, or the genai folder's decoder."""
        return genai_decoder(self.source).model_file if self.is_genai else self.source

    def keys(self) -> list[tuple[str, str]]:
        return [(self.name, runner) for runner in self.runners]


def key_label(key: tuple[str, str]) -> str:
    return f"{key[0]} [{key[1]}]"


def resolve_model(spec: str, runners: Sequence[str] = RUNNERS) -> Candidate:
    """A command-line model: a cache name (:data:`CACHE_MODELS`) or ``NAME=PATH`` (a KV-cache .onnx,
    or an onnxruntime-genai folder / its decoder file)."""
    if "=" in spec:
        name, _, path_text = spec.partition("=")
        path = Path(path_text)
        if not name or not path.exists():
            raise FileNotFoundError(f"model {spec!r}: give NAME=PATH with an existing PATH")
        # A bad folder or a damaged model fails here, with its reason (one line), before any session.
        check_model_file(genai_decoder(path).model_file if path.is_dir() else path)
        if path.is_dir():
            return Candidate(name, path, tuple(runners))
        return Candidate(name, path, ("ort",))  # a file (also a genai decoder file) runs as a graph
    if spec not in CACHE_MODELS:
        raise KeyError(f"unknown model {spec!r}: use one of {', '.join(CACHE_MODELS)} or NAME=PATH")
    kind, variant = CACHE_MODELS[spec]
    if kind == "genai":
        return Candidate(spec, genai_folder_path(variant), tuple(runners))
    return Candidate(spec, model_path("smollm2", variant), ("ort",))


@dataclass(frozen=True)
class WeightTable:
    """Per linear node of a graph: its first weight's bytes (the one a gate skips rows of) and the
    bytes of its other constant inputs (scales, bias, packed extras). Kept instead of the graph, so
    a benchmark does not hold every model's weights twice."""

    rows: tuple[tuple[str, str, float, float], ...]  # (node name, op type, gateable bytes, other bytes)
    nodes: int

    def bytes(self, keep_ratio_by_node: Mapping[str, float] | None = None) -> float:
        total = 0.0
        for name, op_type, gateable, other in self.rows:
            keep = (keep_ratio_by_node or {}).get(name, 1.0) if op_type == "KwtaBlockMatMul" else 1.0
            total += gateable * keep + other
        return total

    @property
    def gated(self) -> list[str]:
        return [name for name, op_type, _, _ in self.rows if op_type == "KwtaBlockMatMul"]


def weight_table(source) -> WeightTable:
    """The :class:`WeightTable` of a graph (path, ModelProto or bytes; external data not loaded)."""
    proto = load_proto(source)
    sizes = {}
    for init in proto.graph.initializer:
        count = int(np.prod(init.dims)) if len(init.dims) else 1
        itemsize = np.dtype(helper.tensor_dtype_to_np_dtype(init.data_type)).itemsize
        sizes[init.name] = count * itemsize
    rows = []
    for node in proto.graph.node:
        if node.op_type not in LINEAR_OPS:
            continue
        names = list(dict.fromkeys(n for n in node.input[1:] if n in sizes))
        gateable = float(sizes[node.input[1]]) if len(node.input) > 1 and node.input[1] in sizes else 0.0
        other = float(sum(sizes[n] for n in names if n != node.input[1]))
        rows.append((node.name, node.op_type, gateable, other))
    return WeightTable(tuple(rows), len(proto.graph.node))


def weight_bytes_per_token(source, keep_ratio_by_node: dict[str, float] | None = None) -> float:
    """Bytes of linear-layer weights one decode step reads: every constant weight of a MatMul /
    Gemm / KwtaBlockMatMul / MatMulNBits (scales and packed int4/int8 included), the gated ones
    times their measured keep ratio. ``source``: a graph or its :class:`WeightTable`."""
    table = source if isinstance(source, WeightTable) else weight_table(source)
    return table.bytes(keep_ratio_by_node)


def bench(candidates: Sequence[Candidate], tokens: np.ndarray, *, contexts: Sequence[int] = DEFAULT_CONTEXTS,
          threads: Sequence[int] = (1, 2), steps: int = 64, warmup: int = 4, prefill_chunk: int = 512,
          offset: int = 0, rounds: int = 3, reference: str | None = None, neighbour: str | None = None,
          spinning: bool = False, log: Callable[[str], None] = print) -> dict:
    """The real decode loop over every candidate (and runner) at every thread count and context,
    repeated in ``rounds`` rounds spread over the run (round 1 visits every setting, then round 2 ...;
    inside a loop the models alternate step by step), so that each ratio is measured at several
    moments of the machine's mood: the report gives its minimum (the claim) and median.
    ``reference``: the model the others are compared with (default the first). ``neighbour``:
    ``"stream"`` runs :class:`ortsparse.benchmarking.StreamNeighbour` beside the whole benchmark.
    ``spinning``: above one thread, ORT's default spinning pool instead of allow_spinning=0; the
    models then run their loops in turn (a spinning pool's idle threads would slow the step of the
    model alternated with it), in the opposite order every other round.
    Returns the report payload (rows, ratios, stability, bandwidth, machine, neighbour)."""
    if not candidates:
        raise ValueError("no model to benchmark")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1 (got {rounds})")
    names = [c.name for c in candidates]
    if len(set(names)) != len(names):
        raise ValueError(f"model names must be unique: {', '.join(names)}")
    reference = reference or names[0]
    if reference not in names:
        raise ValueError(f"reference {reference!r} is not one of the models ({', '.join(names)})")
    reference_key = candidates[names.index(reference)].keys()[0]
    bandwidth = read_bandwidth_gbs()
    tables = {c.name: weight_table(c.graph) for c in candidates}
    rows: list[dict] = []
    sessions: dict[int, dict] = {}
    for n_threads in threads:
        log(f"threads {n_threads}: opening {sum(len(c.runners) for c in candidates)} sessions ...")
        sessions[n_threads] = {key: open_stepper(c.source, key[1], n_threads, spinning=spinning)
                               for c in candidates for key in c.keys()}
    with neighbour_process(neighbour) as beside:
        for round_index in range(rounds):
            for n_threads in threads:
                steppers = sessions[n_threads]
                limits = [s.max_positions for s in steppers.values() if s.max_positions]
                labelled = {key_label(k): s for k, s in steppers.items()}
                if spinning and round_index % 2:
                    labelled = dict(reversed(labelled.items()))
                for context in contexts:
                    loop = plan(context, steps, warmup, offset=offset, max_positions=min(limits) if limits else None)
                    log(f"round {round_index + 1}/{rounds}, threads {n_threads}, context {context} "
                        f"(positions {loop.first_position}-{loop.last_position})")
                    result = decode_loop(labelled, tokens, loop, prefill_chunk=prefill_chunk,
                                         reference=key_label(reference_key), log=log,
                                         interleave=not (spinning and n_threads > 1))
                    rows += _loop_rows(result, candidates, tables, steppers, loop, bandwidth, reference_key,
                                       context=context, threads=n_threads, round_index=round_index, log=log)
    neighbour_info = beside.result if beside is not None else None
    del sessions
    gc.collect()
    return dict(machine=machine_info(), bandwidth=bandwidth, reference=reference, rows=rows,
                ratios=ratio_rows(rows), stability=stability(rows), neighbour=neighbour_info or {"kind": "none"},
                loop=dict(steps=steps, warmup=warmup, prefill_chunk=prefill_chunk, offset=offset, rounds=rounds,
                          spinning=spinning))


def _loop_rows(result: dict, candidates: Sequence[Candidate], tables: Mapping[str, WeightTable],
               steppers: Mapping, loop, bandwidth: Mapping[str, float], reference_key: tuple[str, str], *,
               context: int, threads: int, round_index: int, log: Callable[[str], None]) -> list[dict]:
    """The report rows of one decode loop: speed, agreement and bytes per step of every model."""
    ratios = keep_ratios(result.pop("_metrics"))
    base = result[key_label(reference_key)]["tokens_per_s"]
    base_prefill = result[key_label(reference_key)]["prefill_tokens_per_s"]
    mean_position = loop.prompt + loop.warmup + (loop.steps + 1) / 2
    rows = []
    for candidate in candidates:
        weights = tables[candidate.name].bytes(ratios)
        gated = [ratios[n] for n in tables[candidate.name].gated if n in ratios]
        for key in candidate.keys():
            r = result[key_label(key)]
            kv = steppers[key].kv_bytes_per_position * mean_position
            copy = 2 * kv if steppers[key].copies_cache else 0.0
            total = weights + kv + copy
            bound = bandwidth["numpy_matvec_gbs"] * 1e9 / total
            rows.append(dict(
                context=context, prompt=loop.prompt, positions=[loop.first_position, loop.last_position],
                threads=threads, run=round_index, model=key[0], runner=key[1],
                tokens_per_s=r["tokens_per_s"], median_ms=1e3 * r["median_s"],
                p10_ms=1e3 * r["p10_s"], p90_ms=1e3 * r["p90_s"], speedup=r["tokens_per_s"] / base,
                top1_agreement=r["top1_agreement"], next_token_accuracy=r["next_token_accuracy"],
                prefill_tokens_per_s=r["prefill_tokens_per_s"],
                prefill_speedup=r["prefill_tokens_per_s"] / base_prefill,
                weight_mb=weights / 1e6, kv_mb=kv / 1e6, kv_copy_mb=copy / 1e6, bytes_mb=total / 1e6,
                bound_tokens_per_s=bound, achieved_over_bound=r["tokens_per_s"] / bound,
                nodes=tables[candidate.name].nodes, steps=loop.steps, warmup=loop.warmup,
                keep_ratio=float(np.mean(gated)) if gated else None))
            log(f"  {key_label(key)}: {r['tokens_per_s']:.1f} tok/s (x{r['tokens_per_s'] / base:.2f}), "
                f"top-1 {r['top1_agreement']:.3f}, {total / 1e6:.0f} MB/step")
    return rows


def ratio_rows(rows: Sequence[Mapping]) -> list[dict]:
    """Per (threads, context, model, runner): the speedup over the rounds as minimum / median /
    maximum (:func:`ortsparse.benchmarking.ratio_summary`), and tokens/s minimum and median."""
    groups: dict[tuple, list[Mapping]] = {}
    for r in rows:
        groups.setdefault((r["threads"], r["context"], r["model"], r["runner"]), []).append(r)
    out = []
    for (t, c, m, k), group in groups.items():
        speed = ratio_summary([r["tokens_per_s"] for r in group])
        out.append(dict(threads=t, context=c, model=m, runner=k, speedup=ratio_summary([r["speedup"] for r in group]),
                        tokens_per_s=dict(min=speed["min"], median=speed["median"]),
                        prefill_speedup=ratio_summary([r["prefill_speedup"] for r in group])))
    return out


def stability(rows: Sequence[Mapping]) -> list[dict]:
    """Per (threads, context, model, runner) with more than one round: the spread of the rounds'
    median step times, max / min - 1."""
    groups: dict[tuple, list[float]] = {}
    for r in rows:
        groups.setdefault((r["threads"], r["context"], r["model"], r["runner"]), []).append(r["median_ms"])
    return [dict(threads=t, context=c, model=m, runner=k, medians_ms=v, spread=max(v) / min(v) - 1.0)
            for (t, c, m, k), v in groups.items() if len(v) > 1]


def median_rows(rows: Sequence[Mapping]) -> list[dict]:
    """One row per (threads, context, model, runner): the round with the median tokens/s."""
    groups: dict[tuple, list[Mapping]] = {}
    for r in rows:
        groups.setdefault((r["threads"], r["context"], r["model"], r["runner"]), []).append(r)
    out = []
    for group in groups.values():
        ordered = sorted(group, key=lambda r: r["tokens_per_s"])
        out.append(dict(ordered[(len(ordered) - 1) // 2]))
    return out


def markdown(payload: dict, command: str, title: str) -> str:
    lines = report_header(title, command, payload["machine"], payload["bandwidth"],
                          matvec_note="numpy matvec; used for the bound")
    return "\n".join(lines + markdown_body(payload)) + "\n"


def markdown_body(payload: dict) -> list[str]:
    """The report's text and tables (without the header: title, command, machine)."""
    loop = payload["loop"]
    rounds = loop.get("rounds", loop.get("runs", 1))
    lines = [f"Real decode loop: corpus prompt from token {loop['offset']}, chunked prefill ({loop['prefill_chunk']}), "
             f"then {loop['warmup']} warm-up + {loop['steps']} timed teacher-forced steps, the KV cache growing; "
             "models advanced round-robin in one process; median step time. Runner `ort`: the graph in an ONNX "
             "Runtime session (present K/V bound as the next past); `og`: onnxruntime_genai.Generator "
             f"(shared KV buffer). {threads_policy(loop.get('spinning', False))} Speedup and top-1 agreement vs "
             f"`{payload['reference']}`; next-token accuracy vs the corpus. {rounds} round(s) spread over the run "
             "(every setting once per round); the speedup is given as its **minimum** over the rounds (the claim) "
             "and median, the other columns are from the round with the median tok/s. MB/step = linear weights "
             "(gated at their measured keep ratio) + K/V read by attention + the past-to-present copy of separate "
             "buffers. Bound = read bandwidth / MB per step. K/V counts the whole cache for every model (what "
             "exact attention reads): a model whose attention selects keys reads less, so its achieved/bound can "
             "exceed 1.", "", neighbour_line(payload.get("neighbour")), "",
             "| threads | context | model | runner | tok/s (min-median) | ms/step (p10-p90) | speedup min / median | "
             "top-1 agr. | next-tok acc. | MB/step (weights + KV + copy) | bound tok/s | achieved/bound | "
             "prefill tok/s | prefill speedup min / median |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    summaries = {(r["threads"], r["context"], r["model"], r["runner"]): r
                 for r in payload.get("ratios") or ratio_rows(payload["rows"])}
    for r in sorted(median_rows(payload["rows"]), key=lambda r: (r["threads"], r["context"])):
        summary = summaries[(r["threads"], r["context"], r["model"], r["runner"])]
        speed, ratio, prefill = summary["tokens_per_s"], summary["speedup"], summary["prefill_speedup"]
        lines.append(
            f"| {r['threads']} | {r['context']} | {r['model']} | {r['runner']} | {speed['min']:.1f}-{speed['median']:.1f} | "
            f"{r['median_ms']:.1f} ({r['p10_ms']:.1f}-{r['p90_ms']:.1f}) | **{ratio['min']:.2f}** / {ratio['median']:.2f} | "
            f"{r['top1_agreement']:.3f} | {r['next_token_accuracy']:.3f} | {r['bytes_mb']:.0f} ({r['weight_mb']:.0f} + "
            f"{r['kv_mb']:.0f} + {r['kv_copy_mb']:.0f}) | {r['bound_tokens_per_s']:.0f} | "
            f"{r['achieved_over_bound']:.2f} | {r['prefill_tokens_per_s']:.0f} | "
            f"{prefill['min']:.2f} / {prefill['median']:.2f} |")
    if payload["stability"]:
        lines += ["", "Stability (median step time of each round, max/min - 1):", "",
                  "| threads | context | model | runner | medians (ms) | spread |", "|---|---|---|---|---|---|"]
        for s in payload["stability"]:
            lines.append(f"| {s['threads']} | {s['context']} | {s['model']} | {s['runner']} | "
                         f"{' / '.join(f'{m:.2f}' for m in s['medians_ms'])} | {s['spread']:.1%} |")
    return lines


def add_loop_arguments(parser: argparse.ArgumentParser, contexts: Sequence[int] = DEFAULT_CONTEXTS) -> None:
    """The decode loop's flags (``ortsparse bench``, bench/baselines.py)."""
    loop = parser.add_argument_group("decode loop")
    loop.add_argument("--contexts", type=flag_types.positive_int, nargs="+", default=list(contexts),
                      help=f"prompt lengths before the decode steps (default {' '.join(map(str, contexts))}; "
                           "shortened to fit the models' longest sequence)")
    loop.add_argument("--threads", type=flag_types.threads, nargs="+", default=[1, 2],
                      help="intra-op threads (default 1 2; above 1 with allow_spinning=0 unless --spinning)")
    loop.add_argument("--spinning", action="store_true",
                      help="above 1 thread, ORT's default spinning pool (what an app gets when it sets nothing); "
                           "the models then run their loops in turn instead of alternating step by step")
    loop.add_argument("--steps", type=flag_types.positive_int, default=64,
                      help="timed decode steps per context (default 64)")
    loop.add_argument("--warmup", type=flag_types.non_negative_int, default=4,
                      help="untimed decode steps first (default 4)")
    loop.add_argument("--prefill-chunk", type=flag_types.positive_int, default=512,
                      help="prefill chunk in tokens (default 512)")
    loop.add_argument("--rounds", "--runs", dest="rounds", type=flag_types.positive_int, default=3,
                      help="rounds spread over the run, every setting once per round; ratios are reported as "
                           "their minimum and median over the rounds (default 3; --runs is the old name)")
    loop.add_argument("--neighbour", "--neighbor", choices=NEIGHBOURS, default="none",
                      help="what runs beside the benchmark: none, or stream (a process on another core summing a "
                           "buffer larger than the L3, as a user's other programs would; default none)")
    loop.add_argument("--corpus", metavar="TOKENS.npy", help="token ids (default: the cache's britannica corpus)")
    loop.add_argument("--offset", type=flag_types.non_negative_int, default=0,
                      help="first corpus token of the prompt (default 0)")


def decode_speed(models: Mapping[str, Any], tokens: np.ndarray, *, context: int = 128, steps: int = 32,
                 warmup: int = 4, threads: int = 1, rounds: int = 3, neighbour: str | None = None,
                 log: Callable[[str], None] | None = None) -> dict:
    """Tokens/s of a few KV graphs or genai folders in the real loop at one context and thread count
    (tune, sweeps and calibration use it), teacher-forced on ``tokens`` (ids of the models'
    vocabulary: the caller's text; at least context + warmup + steps + 1 of them), over ``rounds``
    rounds: name -> ``tokens_per_s`` (median
    over the rounds), ``speedup`` (vs the first model: the **minimum** over the rounds, the claim),
    ``speedup_median``, ``top1_agreement`` (vs the first), ``weight_mb``, ``keep_ratio`` (mean over
    gated nodes, when any). A genai folder runs through onnxruntime_genai's Generator, as apps run
    it; a graph in an ORT session."""
    candidates = [Candidate(n, s) for n, s in models.items()]
    for candidate in candidates:
        if candidate.is_genai:
            candidate.runners = ("og",)
    payload = bench(candidates, tokens, contexts=(context,), threads=(threads,), steps=steps, warmup=warmup,
                    rounds=rounds, neighbour=neighbour, log=log or (lambda text: None))
    summaries = {r["model"]: r for r in payload["ratios"]}
    out = {}
    for row in median_rows(payload["rows"]):
        summary = summaries[row["model"]]
        out[row["model"]] = {**{key: row[key] for key in ("top1_agreement", "weight_mb", "keep_ratio")},
                             "tokens_per_s": summary["tokens_per_s"]["median"],
                             "speedup": summary["speedup"]["min"], "speedup_median": summary["speedup"]["median"],
                             "rounds": rounds}
    return out
