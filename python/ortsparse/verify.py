"""Check a rewritten model against its original: run both in ONNX Runtime on the same generated
inputs and compare every output (max abs error and relative L2 error against a stated budget).

Generated inputs: token ids (int inputs named like ``input_ids``) uniform in the vocabulary found
from the embedding Gather they feed; ``*mask*`` inputs all ones; ``*position*`` inputs 0..S-1;
``token_type_ids`` zeros; float inputs standard normal. Dynamic dims resolve to small sizes
(batch 1, past lengths 4, anything else 8), overridable per dim name (``sequence=16``) or per
input (``input_ids=1x16``).

Window-sized KV buffers (a sliding-window layer's GroupQueryAttention with ``sliding_window_cache=1``,
onnxruntime-genai's builder default, e.g. Gemma-3) get the rows onnxruntime-genai's Generator gives
them (the window plus its slack: a shorter buffer cannot run); of their present outputs only the rows
the call leaves resident are compared (onnxruntime leaves the rest of the buffer uninitialised).
"""
from __future__ import annotations

import ast
import dataclasses
import math
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .runtime import load_proto, open_session, window_capacities

DEFAULT_BUDGET = 0.5  # relative L2 error allowed when layers are approximate
EXACT_BUDGET = 1e-4  # relative L2 error allowed when every rewritten layer is exact

_ORT_NUMPY_TYPES = {
    "tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
    "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8, "tensor(bool)": np.bool_,
}


class VerifyInputError(ValueError):
    """Inputs cannot be generated for the model (unsupported type, bad shape override)."""


@dataclasses.dataclass
class OutputError:
    name: str
    shape: tuple[int, ...]
    max_abs: float
    rel_l2: float
    top1: float | None = None  # logits outputs: share of positions whose argmax token agrees


def top1_agreement(expected: np.ndarray, actual: np.ndarray) -> float | None:
    """Share of positions (all axes but the last) whose argmax over the last axis agrees; None for
    an output that is not [..., vocab] logits or whose shapes differ."""
    expected, actual = np.asarray(expected), np.asarray(actual)
    if expected.shape != actual.shape or expected.ndim < 2 or expected.shape[-1] < 2 or expected.size == 0:
        return None
    return float(np.mean(np.argmax(expected, axis=-1) == np.argmax(actual, axis=-1)))


@dataclasses.dataclass
class VerifyResult:
    outputs: list[OutputError]
    budget: float
    budget_reason: str
    runs: int
    input_shapes: dict[str, tuple[int, ...]]

    @property
    def passed(self) -> bool:
        return all(o.rel_l2 <= self.budget for o in self.outputs)

    def format(self) -> str:
        shapes = ", ".join(f"{k} {list(v)}" for k, v in self.input_shapes.items())
        lines = [f"verify: {self.runs} generated input set(s) ({shapes})",
                 f"verify: budget relative L2 <= {self.budget:g} ({self.budget_reason})"]
        width = max([len("output"), *(len(o.name) for o in self.outputs)])
        lines.append(f"  {'output'.ljust(width)}  {'max_abs':>10}  {'rel_l2':>10}  status")
        for o in self.outputs:
            status = "ok" if o.rel_l2 <= self.budget else "OVER BUDGET"
            top1 = f"  (top-1 agreement {o.top1:.3f})" if o.top1 is not None else ""
            lines.append(f"  {o.name.ljust(width)}  {o.max_abs:10.3e}  {o.rel_l2:10.3e}  {status}{top1}")
        lines.append("verify: PASSED" if self.passed else "verify: FAILED (relative L2 error over budget)")
        return "\n".join(lines)


def parse_shape_overrides(specs: str | Sequence[str] | None) -> dict[str, int | tuple[int, ...]]:
    """``"sequence=16,batch=2"`` (dim names -> size) and ``"input_ids=1x16"`` (input -> shape)."""
    if not specs:
        return {}
    if isinstance(specs, str):
        specs = [specs]
    result: dict[str, int | tuple[int, ...]] = {}
    for spec in specs:
        for item in filter(None, (part.strip() for part in spec.split(","))):
            name, sep, value = item.partition("=")
            try:
                if not sep or not name:
                    raise ValueError
                sizes = tuple(int(v) for v in value.lower().split("x"))
                if any(s < 0 for s in sizes):
                    raise ValueError
            except ValueError:
                raise VerifyInputError(f"bad --verify-shape item {item!r}: use name=INT or input=AxBxC") from None
            result[name.strip()] = sizes[0] if "x" not in value.lower() else sizes
    return result


def _default_dim(name: str) -> int:
    lowered = name.lower()
    if "batch" in lowered:
        return 1
    if "past" in lowered or "cache" in lowered:
        return 4
    return 8


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}


def _eval_dim(expression: str, sizes: Mapping[str, int]) -> int | None:
    """Value of a symbolic dim such as ``past_sequence_length + 1`` from the sizes known so far."""
    def evaluate(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return evaluate(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name) and node.id in sizes:
            return sizes[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            return _BINARY[type(node.op)](evaluate(node.left), evaluate(node.right))
        raise ValueError(expression)

    try:
        return int(evaluate(ast.parse(expression, mode="eval")))
    except (ValueError, SyntaxError, KeyError):
        return None


def _is_expression(symbol: str) -> bool:
    return any(c in symbol for c in "+-*/ ")


def resolve_dims(input_specs: Sequence[Any], overrides: Mapping[str, Any],
                 window_sizes: Mapping[str, int] | None = None) -> dict[str, int]:
    """A size for every symbolic dim: overrides first, then defaults; ``total*`` dims are
    past + sequence (KV-cache masks); expressions (``past_seq + 1``) are evaluated last.
    ``window_sizes``: the lengths of window-sized KV buffers -> their rows (unless overridden); never
    the past a total counts (the positions seen are the growing buffers' past)."""
    windowed = dict(window_sizes or {})
    overrides = {**windowed, **overrides}
    symbols = []
    for spec in input_specs:
        symbols.extend(d for d in spec.shape if isinstance(d, str) and d not in symbols)
    sizes: dict[str, int] = {}
    for spec in input_specs:  # a whole-input override also fixes the dims it names
        shape = overrides.get(spec.name)
        if isinstance(shape, tuple) and len(shape) == len(spec.shape):
            for dim, size in zip(spec.shape, shape):
                if isinstance(dim, str) and not isinstance(overrides.get(dim), int):
                    sizes.setdefault(dim, size)
    for symbol in symbols:
        if symbol in sizes:
            continue
        if isinstance(overrides.get(symbol), int):
            sizes[symbol] = overrides[symbol]
        elif not _is_expression(symbol) and "total" not in symbol.lower():
            sizes[symbol] = _default_dim(symbol)
    past = next((v for k, v in sizes.items() if "past" in k.lower() and k not in windowed), None)
    sequence = next((v for k, v in sizes.items() if "seq" in k.lower() and "past" not in k.lower()), None)
    for symbol in symbols:
        if symbol in sizes:
            continue
        if _is_expression(symbol):
            value = _eval_dim(symbol, sizes)
        elif past is not None and sequence is not None:
            value = past + sequence
        else:
            value = None
        sizes[symbol] = value if value is not None and value >= 0 else _default_dim(symbol)
    return sizes


def _resolve_shape(name: str, dims: Sequence[Any], overrides: Mapping[str, Any], sizes: Mapping[str, int]) -> tuple[int, ...]:
    if isinstance(overrides.get(name), tuple):
        shape = overrides[name]
        if len(shape) != len(dims):
            raise VerifyInputError(f"--verify-shape {name}: rank {len(shape)} given, the input has rank {len(dims)}")
        return shape
    shape = []
    for axis, dim in enumerate(dims):
        if isinstance(dim, int) and dim >= 0:
            shape.append(dim)
        elif isinstance(dim, str):
            shape.append(sizes[dim])
        else:  # an unnamed dynamic dim
            shape.append(1 if axis == 0 and len(dims) > 1 else 8)
    return tuple(shape)


def embedding_sizes(model_source: Any) -> dict[str, int]:
    """Rows of the embedding table each integer graph input indexes (through Cast/Reshape...)."""
    proto = load_proto(model_source)
    graph = proto.graph
    rows = {init.name: int(init.dims[0]) for init in graph.initializer if len(init.dims) >= 1}
    consumers: dict[str, list] = {}
    for node in graph.node:
        for position, name in enumerate(node.input):
            consumers.setdefault(name, []).append((node, position))
    passthrough = {"Cast", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity"}
    found: dict[str, int] = {}
    for graph_input in graph.input:
        frontier, seen = [graph_input.name], set()
        while frontier:
            value = frontier.pop()
            if value in seen:
                continue
            seen.add(value)
            for node, position in consumers.get(value, []):
                table = None
                if node.op_type == "Gather" and position == 1:
                    table = node.input[0]
                elif node.op_type == "EmbedLayerNormalization" and position in (0, 1):
                    table = node.input[2 if position == 0 else 3]
                if table in rows:
                    found[graph_input.name] = min(found.get(graph_input.name, rows[table]), rows[table])
                elif node.op_type in passthrough and position == 0:
                    frontier.extend(node.output)
    return found


def make_inputs(input_specs: Sequence[Any], vocab: Mapping[str, int], overrides: Mapping[str, Any],
                rng: np.random.Generator, window_sizes: Mapping[str, int] | None = None) -> dict[str, np.ndarray]:
    """One set of inputs for ``session.get_inputs()``-like specs (name, type, shape);
    ``window_sizes`` as :func:`resolve_dims`."""
    sizes = resolve_dims(input_specs, overrides, window_sizes)
    feeds = {}
    for spec in input_specs:
        dtype = _ORT_NUMPY_TYPES.get(spec.type)
        if dtype is None:
            raise VerifyInputError(f"cannot generate input {spec.name!r} of type {spec.type}")
        shape = _resolve_shape(spec.name, spec.shape, overrides, sizes)
        lowered = spec.name.lower()
        if dtype == np.bool_:
            feeds[spec.name] = np.ones(shape, dtype=np.bool_)
        elif np.issubdtype(dtype, np.floating):
            feeds[spec.name] = rng.standard_normal(shape).astype(dtype)
        elif "mask" in lowered:
            feeds[spec.name] = np.ones(shape, dtype=dtype)
        elif "position" in lowered:
            last = shape[-1] if shape else 1
            feeds[spec.name] = np.broadcast_to(np.arange(last, dtype=dtype), shape).copy()
        elif "ids" in lowered and "type" not in lowered:
            feeds[spec.name] = rng.integers(0, max(vocab.get(spec.name, 2), 1), size=shape).astype(dtype)
        else:
            feeds[spec.name] = np.zeros(shape, dtype=dtype)
    return feeds


@dataclasses.dataclass(frozen=True)
class WindowBuffer:
    """A window-sized KV buffer: the past input a present output continues, the layer's window, and
    the rows to generate for the past (the window plus the Generator's slack)."""

    past: str
    window: int
    capacity: int


def window_buffers(model_source: Any) -> dict[str, WindowBuffer]:
    """Present outputs of window-sized KV buffers (GroupQueryAttention with ``sliding_window_cache=1``)
    -> their :class:`WindowBuffer`; rows as :func:`ortsparse.runtime.window_capacities` gives them."""
    capacities = window_capacities(model_source)
    buffers = {}
    for node in load_proto(model_source).graph.node:
        if node.op_type not in ("GroupQueryAttention", "PopcountGroupQueryAttention"):
            continue
        window = next((a.i for a in node.attribute if a.name == "local_window_size"), -1)
        for past, present in zip(node.input[3:5], node.output[1:3]):
            if past in capacities and present:
                buffers[present] = WindowBuffer(past, window, capacities[past])
    return buffers


def window_lengths(input_specs: Sequence[Any], buffers: Mapping[str, WindowBuffer]) -> dict[str, int]:
    """The symbolic lengths of the window-sized past inputs -> their rows (for :func:`make_inputs`)."""
    rows = {buffer.past: buffer.capacity for buffer in buffers.values()}
    return {spec.shape[2]: rows[spec.name] for spec in input_specs
            if spec.name in rows and len(spec.shape) == 4 and isinstance(spec.shape[2], str)}


def resident_rows(positions: int, capacity: int, window: int) -> int:
    """Rows of a window-sized buffer of ``capacity`` rows that hold positions after ``positions`` of
    them were seen: all up to the capacity, then the buffer drops ``capacity - window + 1`` rows at
    once (onnxruntime's layout; ops/attention/gqa_window.cc ``window_resident_rows``)."""
    if positions <= capacity:
        return positions
    evict_block = capacity - window + 1
    return positions - evict_block * math.ceil((positions - capacity) / evict_block)


def resident_part(name: str, value: np.ndarray, buffers: Mapping[str, WindowBuffer],
                  feeds: Mapping[str, np.ndarray]) -> np.ndarray:
    """``value`` of output ``name`` as far as it is defined: a window-sized present only up to the
    rows the call leaves resident (positions seen: the mask's length; generated masks are all ones);
    any other output whole."""
    buffer = buffers.get(name)
    mask = next((v for k, v in feeds.items() if "mask" in k.lower() and np.ndim(v) == 2), None)
    if buffer is None or mask is None or np.ndim(value) != 4:
        return value
    rows = resident_rows(int(mask.shape[-1]), value.shape[2], buffer.window)
    return value[:, :, :rows]


def compare(expected: np.ndarray, actual: np.ndarray) -> tuple[float, float]:
    """(max abs error, relative L2 error); inf when NaN/Inf appear in one output only."""
    expected = np.asarray(expected, dtype=np.float64)
    actual = np.asarray(actual, dtype=np.float64)
    if expected.shape != actual.shape:
        return float("inf"), float("inf")
    finite_e, finite_a = np.isfinite(expected), np.isfinite(actual)
    if not np.array_equal(finite_e, finite_a):
        return float("inf"), float("inf")
    diff = np.where(finite_e, expected - actual, 0.0)
    if diff.size == 0:
        return 0.0, 0.0
    norm = float(np.linalg.norm(np.where(finite_e, expected, 0.0)))
    error = float(np.linalg.norm(diff))
    return float(np.abs(diff).max()), (error / norm if norm > 0 else error)


def verify_models(
    original: Any,
    rewritten: Any,
    *,
    runs: int = 1,
    budget: float = DEFAULT_BUDGET,
    budget_reason: str = "--verify-budget",
    shapes: Mapping[str, Any] | None = None,
    seed: int = 0,
    progress: bool = False,
) -> VerifyResult:
    """Run both models (paths, bytes or ``ModelProto``) on ``runs`` generated input sets and
    compare every output of the original with the same-named output of the rewritten model.
    Errors are the worst over the runs."""
    from tqdm.auto import tqdm

    if runs < 1:
        raise VerifyInputError("verify needs at least one input set")
    reference = open_session(original)  # the op library registered when the model uses it
    candidate = open_session(rewritten)
    overrides = dict(shapes or {})
    vocab = embedding_sizes(original)
    buffers = window_buffers(original)
    window_sizes = window_lengths(reference.get_inputs(), buffers)
    output_names = [o.name for o in reference.get_outputs()]
    missing = sorted(set(output_names) - {o.name for o in candidate.get_outputs()})
    if missing:
        raise VerifyInputError(f"the rewritten model lacks output(s) {', '.join(missing)}")
    rng = np.random.default_rng(seed)
    worst: dict[str, OutputError] = {}
    input_shapes: dict[str, tuple[int, ...]] = {}
    for _ in tqdm(range(runs), desc="verify", unit="run", disable=not progress, leave=False):
        feeds = make_inputs(reference.get_inputs(), vocab, overrides, rng, window_sizes)
        input_shapes = {k: tuple(v.shape) for k, v in feeds.items()}
        expected = reference.run(output_names, feeds)
        actual = candidate.run(output_names, feeds)
        for name, e, a in zip(output_names, expected, actual):
            e, a = (resident_part(name, value, buffers, feeds) for value in (e, a))
            max_abs, rel = compare(e, a)
            top1 = top1_agreement(e, a) if "logits" in name else None
            previous = worst.get(name)
            if previous is not None:
                max_abs, rel = max(max_abs, previous.max_abs), max(rel, previous.rel_l2)
                top1 = None if top1 is None or previous.top1 is None else min(top1, previous.top1)
            worst[name] = OutputError(name, tuple(np.shape(e)), max_abs, rel, top1)
    return VerifyResult(outputs=[worst[n] for n in output_names], budget=budget, budget_reason=budget_reason,
                        runs=runs, input_shapes=input_shapes)
