"""Zoo validation (``ortsparse validate``): for every model, rewrite with the given flags, run the
ONNX checker (full check) on the written file, load it in onnxruntime with the op library, run the
original and the rewritten model on the same generated inputs (``ortsparse.verify``), time both
(alternated runs, medians), and report rewrites per layer class, output error, speed ratio and
failures with their reasons — a markdown table and JSON. Any failure makes the exit code 1.

A model fails when something raises (file unreadable, rewrite error), the rewritten file fails the
checker, onnxruntime cannot load or run it, or an output's relative L2 error is over budget: 1e-4
when every rewritten layer is exact (k_frac = 1 or k_abs >= K, threshold 0, or nothing rewritten),
else ``--budget`` (default 0.5, verify's budget).

The default zoo (``--zoo default``) is made of groups:

- ``tiny``: every ``models/tiny/*.onnx`` of the repository (torch exports of tiny GPT-2 / BERT /
  Llama, TorchScript and dynamo, SDPA, opset-23 ``Attention``, KV cache);
- ``generated``: GPT-2 / BERT / Llama-like graphs and an ORT-fused BERT built with onnx.helper
  (the rewriter tests' builders when the repository is there, else a small built-in pair);
- ``onnx-light``: the CNNs shipped in the onnx wheel (``onnx/backend/test/data/light``) that have
  Gemm/MatMul layers. Their weights are ``ConstantOfShape`` placeholders (every value 0.02), so
  weights of rank >= 2 are replaced by fixed-seed random initializers (He-scaled) first;
- ``real``: the real models of the cache when present (SmolLM2 full-sequence exports of both
  exporters and the KV-cache export, MiniLM of both exporters and after ORT's BERT optimizer).

``fast`` = ``tiny`` + ``generated`` (no cache, seconds; what CI runs).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper, numpy_helper

from .. import flag_types
from ..benchmarking import json_default, versions
from ..graph_rewrite import load_model, rewrite_model
from ..graph_rewrite.files import check_written, needs_external_data
from ..graph_rewrite.genai import generated_input_sizes
from ..graph_rewrite.output_paths import Inputs, check_outputs, write_text_files
from ..rewrite_flags import add_technique_arguments, config_from_args
from ..runtime import genai_folder, open_session
from ..verify import (DEFAULT_BUDGET, EXACT_BUDGET, OutputError, embedding_sizes, compare, make_inputs,
                      parse_shape_overrides)
from ..zoo.models import real_model_path

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
GROUPS = ("tiny", "generated", "onnx-light", "real")
ZOOS = {"default": GROUPS, "fast": ("tiny", "generated"), **{g: (g,) for g in GROUPS}}
REPO_ROOT = Path(__file__).resolve().parents[3]
# (model name in the cache, file) of the real models, in report order.
REAL_MODELS = (("smollm2", "full.torchscript.onnx"), ("smollm2", "full.dynamo.onnx"),
               ("smollm2", "kv.torchscript.onnx"), ("smollm2", "kv.dynamo.onnx"),
               ("minilm", "torchscript.onnx"), ("minilm", "dynamo.onnx"), ("minilm", "torchscript.ortopt.onnx"))


@dataclasses.dataclass
class ZooEntry:
    """One model of the zoo: a file, or a builder that writes one into a directory."""

    name: str
    group: str
    path: Path | None = None
    build: Callable[[Path], Path] | None = None
    note: str = ""

    def source(self, workdir: Path) -> Path:
        return self.build(workdir) if self.build is not None else Path(self.path)


@dataclasses.dataclass
class ModelResult:
    name: str
    group: str
    source: str
    status: str = "ok"  # "ok" | "FAIL"
    stage: str = ""  # where it failed: load, rewrite, save, check, ort-load, run, budget, time
    reason: str = ""
    linear_layers: int = 0
    rewritten_layers: int = 0
    counts: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    skip_reasons: dict[str, int] = dataclasses.field(default_factory=dict)
    exact: bool = True
    budget: float | None = None
    outputs: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    worst_rel_l2: float | None = None
    worst_max_abs: float | None = None
    input_shapes: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    dense_ms: float | None = None
    rewritten_ms: float | None = None
    speed_ratio: float | None = None  # dense time / rewritten time: > 1 = the rewritten model is faster
    seconds: float = 0.0
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def fail(self, stage: str, reason: str) -> ModelResult:
        self.status, self.stage, self.reason = "FAIL", stage, reason
        return self


# --------------------------------------------------------------------------- zoo contents

def tiny_entries() -> list[ZooEntry]:
    folder = REPO_ROOT / "models" / "tiny"
    return [ZooEntry(f"tiny/{p.stem}", "tiny", path=p) for p in sorted(folder.glob("*.onnx"))]


def _tiny_graph_builders() -> dict[str, Callable[[], Any]] | None:
    """The rewriter tests' builders (tests/graph_rewrite/tiny_graphs.py) when the repository is here."""

    path = REPO_ROOT / "tests" / "graph_rewrite" / "tiny_graphs.py"
    if not path.is_file():
        return None
    try:
        spec = importlib.util.spec_from_file_location("_ortsparse_zoo_tiny_graphs", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return {"gpt2_like": module.gpt2_like, "bert_like": lambda: module.bert_like(pooler=True),
                "llama_like": module.llama_like, "bert_fused_like": module.bert_fused_like}
    except Exception:  # noqa: BLE001 - any problem there: use the built-in graphs
        return None


def _writer(name: str, builder: Callable[[], Any]) -> Callable[[Path], Path]:
    def build(workdir: Path) -> Path:
        path = workdir / f"{name}.onnx"
        onnx.save(builder(), path)
        return path

    return build


def generated_entries() -> list[ZooEntry]:
    builders = _tiny_graph_builders()
    note = ""
    if builders is None:
        builders = {"gpt2_like": lambda: builtin_transformer(decoder=True),
                    "bert_like": lambda: builtin_transformer(decoder=False)}
        note = "built-in graph (tests/graph_rewrite/tiny_graphs.py not found)"
    return [ZooEntry(f"generated/{name}", "generated", build=_writer(name, b), note=note)
            for name, b in builders.items()]


def builtin_transformer(decoder: bool, d: int = 16, ff: int = 32, vocab: int = 40, seed: int = 0):
    """A one-layer transformer built with onnx.helper: GPT-2-like (tied head MatMul(x,
    Transpose(wte)), output ``logits``) or BERT-like (Tanh pooler, ``last_hidden_state`` and
    ``pooler_output``). Random fixed-seed weights."""

    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    counter = iter(range(10**6))

    def const(name, array):
        inits.append(numpy_helper.from_array(np.asarray(array, dtype=np.float32), name))
        return name

    def weight(name, shape):
        return const(name, rng.standard_normal(shape) / math.sqrt(shape[0]))

    def op(op_type, inputs, **attrs):
        out = f"t{next(counter)}"
        nodes.append(helper.make_node(op_type, inputs, [out], name=f"/{op_type}_{out}", **attrs))
        return out

    def linear(x, name, k, n):
        return op("Add", [op("MatMul", [x, weight(f"{name}.weight", (k, n))]), const(f"{name}.bias", np.zeros(n))])

    def norm(x, name):
        return op("LayerNormalization", [x, const(f"{name}.g", np.ones(d)), const(f"{name}.b", np.zeros(d))], axis=-1)

    wte = weight("wte", (vocab, d))
    x = op("Gather", [wte, "input_ids"], axis=0)
    h = norm(x, "ln1")
    q, k, v = (linear(h, f"attn.{p}", d, d) for p in "qkv")
    scores = op("Div", [op("MatMul", [q, op("Transpose", [k], perm=[0, 2, 1])]), const("scale", math.sqrt(d))])
    ctx = op("MatMul", [op("Softmax", [scores], axis=-1), v])
    x = op("Add", [x, linear(ctx, "attn.out", d, d)])
    up = linear(norm(x, "ln2"), "mlp.up", d, ff)
    gelu = op("Mul", [op("Mul", [up, const("half", 0.5)]),
                      op("Add", [op("Erf", [op("Div", [up, const("sqrt2", math.sqrt(2.0))])]), const("one", 1.0)])])
    x = op("Add", [x, linear(gelu, "mlp.down", ff, d)])
    out = norm(x, "ln_f")
    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"])
    if decoder:
        head_weight = op("Transpose", [wte], perm=[1, 0])
        nodes.append(helper.make_node("MatMul", [out, head_weight], ["logits"], name="/lm_head"))
        outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "sequence", vocab])]
    else:
        nodes.append(helper.make_node("Identity", [out], ["last_hidden_state"]))
        inits.append(numpy_helper.from_array(np.array(0, np.int64), "first_token"))
        first = op("Gather", [out, "first_token"], axis=1)
        nodes.append(helper.make_node("Tanh", [linear(first, "pooler", d, d)], ["pooler_output"]))
        outputs = [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, ["batch", "sequence", d]),
                   helper.make_tensor_value_info("pooler_output", TensorProto.FLOAT, ["batch", d])]
    graph = helper.make_graph(nodes, "gpt2_like" if decoder else "bert_like", [ids], outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def onnx_light_dir() -> Path:
    return Path(onnx.__file__).resolve().parent / "backend" / "test" / "data" / "light"


def _has_linear_layers(path: Path) -> bool:
    return any(n.op_type in ("Gemm", "MatMul") for n in onnx.load(path, load_external_data=False).graph.node)


def materialize_placeholder_weights(model, seed: int = 0):
    """Replace every ``ConstantOfShape`` of a constant shape (the wheel's placeholders) by an
    initializer: rank >= 2 (weights) fixed-seed random normal with std sqrt(2 / fan_in), fan_in =
    the product of all dims but the first; rank 1 (biases, batch-norm statistics) the placeholder's
    own fill value. IR version 3 files get IR version 4, where initializers need not be inputs."""

    rng = np.random.default_rng(seed)
    shapes = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    kept, added = [], []
    for node in model.graph.node:
        shape = shapes.get(node.input[0]) if node.op_type == "ConstantOfShape" and node.input else None
        if shape is None or shape.ndim != 1:
            kept.append(node)
            continue
        dims = tuple(int(s) for s in shape)
        value = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "value"), None)
        fill = numpy_helper.to_array(value).reshape(-1) if value is not None else np.zeros(1, np.float32)
        if len(dims) >= 2 and fill.dtype == np.float32:
            fan_in = max(1, int(np.prod(dims[1:])))
            array = rng.standard_normal(dims, dtype=np.float32) * np.float32(math.sqrt(2.0 / fan_in))
        else:
            array = np.full(dims, fill[0], dtype=fill.dtype)
        added.append(numpy_helper.from_array(array, node.output[0]))
    del model.graph.node[:]
    model.graph.node.extend(kept)
    model.graph.initializer.extend(added)
    used = {name for node in model.graph.node for name in node.input} | {o.name for o in model.graph.output}
    for init in [i for i in model.graph.initializer if i.name not in used]:
        model.graph.initializer.remove(init)
    # IR 3 lists every initializer among the inputs yet means them constant; IR 4 would make
    # them overridable (not constant), so they leave the inputs.
    initializers = {i.name for i in model.graph.initializer}
    for graph_input in [i for i in model.graph.input if i.name not in used or i.name in initializers]:
        model.graph.input.remove(graph_input)
    model.ir_version = max(model.ir_version, 4)
    return model


def _light_builder(path: Path) -> Callable[[Path], Path]:
    def build(workdir: Path) -> Path:
        model = materialize_placeholder_weights(onnx.load(path))
        out = workdir / path.name
        onnx.save(model, out)
        return out

    return build


def onnx_light_entries() -> list[ZooEntry]:
    folder = onnx_light_dir()
    paths = [p for p in sorted(folder.glob("*.onnx")) if _has_linear_layers(p)] if folder.is_dir() else []
    return [ZooEntry(f"onnx-light/{p.stem.removeprefix('light_')}", "onnx-light", path=p, build=_light_builder(p),
                     note="placeholder weights replaced by seeded random ones") for p in paths]


def real_entries() -> list[ZooEntry]:
    entries = []
    for name, variant in REAL_MODELS:
        path = real_model_path(name, variant)
        if path.is_file():
            entries.append(ZooEntry(f"{name}/{variant.removesuffix('.onnx')}", "real", path=path))
    return entries


def zoo_entries(groups: Iterable[str]) -> list[ZooEntry]:
    makers = {"tiny": tiny_entries, "generated": generated_entries, "onnx-light": onnx_light_entries,
              "real": real_entries}
    entries = []
    for group in groups:
        entries.extend(makers[group]())
    return entries


def path_entries(paths: Sequence[str | os.PathLike]) -> list[ZooEntry]:
    """Files as given; directories: every ``*.onnx`` below them (sorted)."""
    entries = []
    for item in paths:
        path = Path(item)
        if path.is_dir():
            entries.extend(ZooEntry(str(p), "path", path=p) for p in sorted(path.rglob("*.onnx")))
        else:
            entries.append(ZooEntry(str(path), "path", path=path))
    return entries


# --------------------------------------------------------------------------- one model

def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")


def _save(model, path: Path) -> None:
    """As rewrite-onnx writes it: weights as external data of the copy's own when the input had
    external data or they approach protobuf's 2 GiB."""
    if needs_external_data(model, 2**31 - 2**26):
        ir.save(model, path, external_data=f"{path.name}.data")
    else:
        ir.save(model, path)


def validate_model(entry: ZooEntry, config: Any = None, *, runs: int = 2, shapes: Any = None,
                   budget: float | None = None, seed: int = 0, timing_runs: int = 5, threads: int = 1) -> ModelResult:
    """Rewrite, check, load, compare and time one zoo entry; never raises for a model problem."""
    started = time.perf_counter()
    result = ModelResult(entry.name, entry.group, str(entry.path) if entry.path else "generated")
    if entry.note:
        result.notes.append(entry.note)
    with tempfile.TemporaryDirectory(prefix="ortsparse-validate-") as tmp:
        try:
            _validate(entry, result, Path(tmp), config, runs=runs, shapes=shapes, budget=budget, seed=seed,
                      timing_runs=timing_runs, threads=threads)
        except Exception as error:  # noqa: BLE001 - a failing model is a result, not a crash
            result.fail(result.stage or "unknown", _first_line(error))
    gc.collect()
    result.seconds = time.perf_counter() - started
    return result


def _validate(entry: ZooEntry, result: ModelResult, workdir: Path, config: Any, *, runs: int, shapes: Any,
              budget: float | None, seed: int, timing_runs: int, threads: int) -> None:
    result.stage = "load"
    source = entry.source(workdir)
    model = load_model(source)

    result.stage = "rewrite"
    _, report = rewrite_model(model, config)
    result.linear_layers, result.rewritten_layers = len(report.layers), len(report.rewritten)
    result.counts = report.counts()
    if report.config.attention is not None and report.attention:  # cores (PopcountAttention), when --attn is on
        result.counts["cores"] = {"layers": len(report.attention), "rewritten": sum(a.rewritten for a in report.attention),
                                  "skipped": sum(not a.rewritten for a in report.attention)}
    result.skip_reasons = dict(Counter(_generic(r.reason) for r in report.skipped).most_common())
    result.exact = report.exact
    if not report.rewritten and not any(a.rewritten for a in report.attention):
        result.notes.append("no layer matched the selection")

    result.stage = "save"
    rewritten_path = workdir / f"rewritten.{source.name}"
    _save(model, rewritten_path)
    del model

    result.stage = "check"
    try:
        check_written(rewritten_path, source, result.notes)  # held to the input's standard, as rewrite-onnx
    except RuntimeError as error:
        result.fail("check", _first_line(error))
        return

    result.stage = "ort-load"
    options = {"intra_op_num_threads": threads, "allow_spinning": False, "log_severity_level": 3}
    try:
        original = open_session(source, options)
    except Exception as error:  # noqa: BLE001
        result.fail("ort-load", f"onnxruntime cannot load the original: {_first_line(error)}")
        return
    try:
        candidate = open_session(rewritten_path, options)
    except Exception as error:  # noqa: BLE001
        result.fail("ort-load", f"onnxruntime cannot load the rewritten model: {_first_line(error)}")
        return

    result.stage = "run"
    overrides = parse_shape_overrides(shapes) if not isinstance(shapes, dict) else shapes
    if (folder := genai_folder(source)) is not None:  # a genai decoder: its K/V sizes from its config
        overrides = {**generated_input_sizes(folder), **(overrides or {})}
    names = [o.name for o in original.get_outputs()]
    missing = sorted(set(names) - {o.name for o in candidate.get_outputs()})
    if missing:
        result.fail("run", f"the rewritten model lacks output(s) {', '.join(missing)}")
        return
    worst, first_feeds = _compare_runs(original, candidate, names, embedding_sizes(source), overrides, runs, seed,
                                       result)
    result.outputs = [{"name": o.name, "shape": list(o.shape), "max_abs": o.max_abs, "rel_l2": o.rel_l2}
                      for o in (worst[n] for n in names)]
    result.worst_rel_l2 = max(o.rel_l2 for o in worst.values())
    result.worst_max_abs = max(o.max_abs for o in worst.values())
    result.budget = EXACT_BUDGET if report.exact else (DEFAULT_BUDGET if budget is None else budget)

    if timing_runs > 0:
        result.stage = "time"
        _time_pair(original, candidate, names, first_feeds, timing_runs, result)
    del original, candidate

    result.stage = ""
    over = [o for o in worst.values() if not o.rel_l2 <= result.budget]
    if over:
        o = max(over, key=lambda o: o.rel_l2 if math.isfinite(o.rel_l2) else float("inf"))
        kind = "exact rewrite" if report.exact else "approximate rewrite"
        result.fail("budget", f"output {o.name!r} relative L2 error {o.rel_l2:.3e} > budget {result.budget:g} "
                              f"({kind})")


def _compare_runs(original: Any, candidate: Any, names: list[str], vocab: Any, overrides: Any, runs: int, seed: int,
                  result: ModelResult) -> tuple[dict[str, OutputError], dict[str, np.ndarray]]:
    """Both sessions on ``runs`` sets of generated inputs: the worst error per output, and the first feeds."""
    rng = np.random.default_rng(seed)
    worst: dict[str, OutputError] = {}
    first_feeds = None
    for _ in range(max(1, runs)):
        feeds = make_inputs(original.get_inputs(), vocab, overrides, rng)
        first_feeds = first_feeds or feeds
        result.input_shapes = {k: list(v.shape) for k, v in feeds.items()}
        expected = original.run(names, feeds)
        actual = candidate.run(names, feeds)
        for name, e, a in zip(names, expected, actual):
            max_abs, rel = compare(e, a)
            if name in worst:
                max_abs, rel = max(max_abs, worst[name].max_abs), max(rel, worst[name].rel_l2)
            worst[name] = OutputError(name, tuple(np.shape(e)), max_abs, rel)
    return worst, first_feeds


def _time_pair(original: Any, candidate: Any, names: list[str], feeds: dict[str, np.ndarray], timing_runs: int,
               result: ModelResult) -> None:
    """Median run times of both sessions, alternated A B A B (both already warm from the comparison)."""
    dense, sparse = [], []
    for _ in range(timing_runs):
        for session, times in ((original, dense), (candidate, sparse)):
            start = time.perf_counter()
            session.run(names, feeds)
            times.append(time.perf_counter() - start)
    result.dense_ms = 1e3 * statistics.median(dense)
    result.rewritten_ms = 1e3 * statistics.median(sparse)
    result.speed_ratio = result.dense_ms / result.rewritten_ms if result.rewritten_ms > 0 else None


def _generic(reason: str) -> str:
    return re.sub(r"'[^']*'", "'…'", reason)


# --------------------------------------------------------------------------- many models, reports

def validate(entries: Sequence[ZooEntry], config: Any = None, *, runs: int = 2, shapes: Any = None,
             budget: float | None = None, seed: int = 0, timing_runs: int = 5, threads: int = 1,
             on_result: Callable[[int, ModelResult], None] | None = None) -> list[ModelResult]:
    results = []
    for index, entry in enumerate(entries):
        result = validate_model(entry, config, runs=runs, shapes=shapes, budget=budget, seed=seed,
                                timing_runs=timing_runs, threads=threads)
        results.append(result)
        if on_result is not None:
            on_result(index, result)
    return results


def _rewrites_cell(result: ModelResult) -> str:
    if not result.counts:
        return "-"
    return " ".join(f"{c} {v['rewritten']}/{v['layers']}" for c, v in result.counts.items())


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def markdown_table(results: Sequence[ModelResult]) -> str:
    header = ("model", "status", "rewritten / layers per class", "worst rel L2", "budget", "max abs",
              "dense ms", "rewritten ms", "speed", "failure / notes")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in results:
        why = f"{r.stage}: {r.reason}" if not r.ok else "; ".join(r.notes)
        cells = (r.name, "ok" if r.ok else "**FAIL**", _rewrites_cell(r), _num(r.worst_rel_l2, ".2e"),
                 _num(r.budget, "g"), _num(r.worst_max_abs, ".2e"), _num(r.dense_ms, ".2f"),
                 _num(r.rewritten_ms, ".2f"), _num(r.speed_ratio, ".2f"), why.replace("|", "\\|"))
        lines.append("| " + " | ".join(cells) + " |")
    failed = sum(not r.ok for r in results)
    lines.append("")
    lines.append(f"{len(results)} model(s), {len(results) - failed} ok, {failed} failed. speed = dense median / "
                 "rewritten median (> 1: rewritten faster).")
    return "\n".join(lines)


def to_json(results: Sequence[ModelResult], meta: dict[str, Any]) -> dict[str, Any]:
    models = []
    for r in results:
        data = dataclasses.asdict(r)
        data["ok"] = r.ok
        models.append(data)
    failed = sum(not r.ok for r in results)
    return {**meta, "versions": versions(), "models": models, "passed": len(results) - failed,
            "failed": failed}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("models", nargs="*", metavar="MODEL_OR_DIR",
                        help="model files or directories (every *.onnx below); default: --zoo default")
    parser.add_argument("--zoo", action="append", choices=sorted(ZOOS), metavar="NAME",
                        help=f"a named zoo, repeatable: {', '.join(sorted(ZOOS))} (default: default, unless "
                             "models are given)")
    parser.add_argument("--fast", action="store_true", help="the models that need no cache and run in seconds "
                                                            "(= --zoo fast: tiny + generated)")
    parser.add_argument("--list", action="store_true", help="list the models and exit")
    check = parser.add_argument_group("checking")
    check.add_argument("--runs", type=flag_types.positive_int, default=2,
                       help="generated input sets per model (default 2)")
    flag_types.add_input_arguments(check)
    check.add_argument("--timing-runs", type=flag_types.non_negative_int, default=5,
                       help="alternated timed runs per model and side, medians (default 5; 0: no timing)")
    check.add_argument("--threads", type=flag_types.threads, default=1,
                       help="intra-op threads, spinning off (default 1)")
    add_technique_arguments(parser)
    out = parser.add_argument_group("output")
    out.add_argument("--json", metavar="FILE", help="write the results as JSON")
    out.add_argument("--markdown", metavar="FILE", help="write the table as markdown")
    out.add_argument("-q", "--quiet", action="store_true", help="print only the failures")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    names = list(args.zoo or [])
    if args.fast:
        names.append("fast")
    if not names and not args.models:
        names = ["default"]
    groups = list(dict.fromkeys(g for n in names for g in ZOOS[n]))
    entries = zoo_entries(groups) + path_entries(args.models)
    if args.list:
        for entry in entries:
            print(f"{entry.name}  [{entry.group}]  {entry.path or '(generated)'}")
        return EXIT_OK
    if not entries:
        print("validate: no models to validate", file=sys.stderr)
        return EXIT_USAGE
    config = config_from_args(args)
    inputs = Inputs().add(args.config, "the config file")  # never overwritten
    for item in args.models:  # a folder named here is an input folder: nothing is written into it
        inputs.add_model(item, f"the input model {item}" if not Path(item).is_dir() else f"the input folder {item}")
    for entry in entries:
        inputs.add_model(entry.path, f"the input model {entry.path}")
    outputs = {args.markdown: "markdown table", args.json: "JSON results"}
    check_outputs([(args.markdown, "markdown table"), (args.json, "JSON results")], inputs)  # before the long run

    def progress(index: int, result: ModelResult) -> None:
        if args.quiet and result.ok:
            return
        what = (f"rel L2 {_num(result.worst_rel_l2, '.2e')}, speed {_num(result.speed_ratio, '.2f')}"
                if result.ok else f"{result.stage}: {result.reason}")
        print(f"[{index + 1}/{len(entries)}] {result.name}: {'ok' if result.ok else 'FAIL'} "
              f"({_rewrites_cell(result)}; {what}; {result.seconds:.1f} s)", flush=True)

    results = validate(entries, config, runs=args.runs, shapes=args.shape, budget=args.budget, seed=args.seed,
                       timing_runs=args.timing_runs, threads=args.threads, on_result=progress)
    table = markdown_table(results)
    if not args.quiet:
        print()
        print(table)
    files = {}
    if args.markdown:
        command = getattr(args, "command_line", None) or ""
        header = f"Produced by `{command.strip()}`.\n\n" if command else ""
        files[args.markdown] = (outputs[args.markdown], header + table + "\n")
    if args.json:
        meta = {"command": getattr(args, "command_line", None), "zoo": groups,
                "paths": list(args.models), "config": _config_dict(config), "runs": args.runs,
                "timing_runs": args.timing_runs, "threads": args.threads}
        files[args.json] = (outputs[args.json],
                            json.dumps(to_json(results, meta), indent=2, default=json_default) + "\n")
    write_text_files(files, inputs)
    failed = [r for r in results if not r.ok]
    if failed:
        print(f"validate: {len(failed)} of {len(results)} model(s) failed", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def _config_dict(config: Any) -> dict[str, Any]:
    data = dataclasses.asdict(config)
    data["kwta"] = config.choice("kwta").settings.attributes()
    return data
