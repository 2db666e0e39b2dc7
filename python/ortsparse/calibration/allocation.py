"""Per-layer sparsity allocation for calibrated KWTA gating: (model, calibration data, budget) ->
per-layer thresholds, in one pass of cheap measurements and a short verified search.

Everything runs on the ONNX model in onnxruntime, on a *probe graph*: a copy of the model in
which the input X of every gated linear layer is masked by plain ONNX nodes,
``X * (score(X) >= t_l)``, with ``t_l`` a graph input. One session then evaluates any set of
per-layer thresholds (all zero = the dense model) without rebuilding anything; the masking is the
op's threshold rule at block 1 (``KwtaBlockMatMul`` with ``threshold``, ``k_frac`` 1), so what the
probe graph measures is what the rewritten graph computes.

1. **Capture** (one forward pass per calibration batch): a row sample of every gated layer's X.
   Per layer and for each sparsity of a grid: the score threshold that drops that fraction of the
   inputs, and the relative output error ``||(X ⊙ dropped) W||² / ||X W||²`` it causes.
2. **Probe** (one forward pass per allocation unit, on a short probe set): gate one unit alone
   at the sparsity where its output error reaches a fixed level and measure the loss (KL
   divergence of the next-token distribution for an LM, 1 - cosine for an encoder). A unit's loss
   curve is its output-error curve scaled to pass through the probe: ``loss_u(s) = a_u e_u(s)``.
   Units are the layers that read the same X (q/k/v, gate/up) — one decision per input.
3. **Allocate** (Lagrangian): for a price ``mu``, every unit takes the sparsity that minimises
   ``loss_u(s) - mu * bytes_u * s``; a larger mu skips more bytes.
4. **Verify** jointly: bisect on mu with the real loss of all units gated together on the
   calibration windows (dppl for an LM, 1 - mean cosine for an encoder) against margin x budget.

The scores are the op's: ``l2`` (|x| at block 1, TEAL) or ``l2_weighted`` (|x_k|·||W_k,:||, WINA).
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..graph_rewrite.config import NodePlan
from ..graph_rewrite.layer_settings import rewritten_with, selected_layers
from ..graph_rewrite.layers import LinearLayer
from ..graph_rewrite.rules import FloatWeight
from ..measure.corpus import (
    default_sentences,
    first_scored,
    lm_windows,
    load_corpus_tokens,
    load_sentences,
    sentence_batches,
    text_per_window,
    vocabulary_of,
)
from ..measure.embeddings import compare_embeddings, mean_pool
from ..measure.perplexity import compare_lm, log_softmax_blocks, perplexity, score_logits
from ..measure.source import ModelSource
from ..runtime import kv_layout, lm_feeds, load_proto, open_session, with_outputs
from ..zoo.models import model_path
from .head_placement import DENSE_ON_OURS

THRESHOLD_PREFIX = "ortsparse_probe_threshold/"
SCORES = ("l2", "l2_weighted")
# Sparsity grid of the cost curves (fraction of a layer's inputs dropped per token).
GRID = tuple(round(0.025 * i, 3) for i in range(0, 37))  # 0 .. 0.9


@dataclasses.dataclass
class GatedLayer:
    """One linear layer the allocation may gate."""

    name: str  # node name (the override file's match)
    role: str  # q/k/v/out/up/down/head
    layer_class: str  # attn/mlp/head
    block_index: int | None  # transformer layer index parsed from the name (None: not found)
    input_name: str  # the graph value X it reads
    weight: np.ndarray  # [K, N] float32
    weight_bytes: int

    @property
    def row_norms(self) -> np.ndarray:
        """||W_k,:|| per input feature (the l2_weighted score's factor at block 1)."""
        return np.linalg.norm(self.weight.astype(np.float64), axis=1)

    def score_scale(self, score: str) -> np.ndarray | None:
        return self.row_norms.astype(np.float32) if score == "l2_weighted" else None


@dataclasses.dataclass
class Unit:
    """Layers that read one X: one sparsity decision for all of them."""

    input_name: str
    layers: list[GatedLayer]
    grid: tuple[float, ...] = GRID
    thresholds: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)  # layer -> threshold per grid s
    error: np.ndarray | None = None  # relative output error per grid s (summed over the unit's layers)
    scale: float = 0.0  # loss per unit of output error (from the probe)
    probe: dict[str, float] = dataclasses.field(default_factory=dict)
    # How the loss grows with the output error, loss ~ error^exponent through the probe (1: linear;
    # fitted through a second probe by :func:`probe_units`).
    exponent: float = 1.0
    second_probe: dict[str, float] = dataclasses.field(default_factory=dict)
    # Time saved per decode row at each grid sparsity, measured (ortsparse.tuning.layer_speed); None:
    # not measured, the allocation values skipped bytes.
    saving: np.ndarray | None = None

    @property
    def name(self) -> str:
        return self.layers[0].name if len(self.layers) == 1 else "+".join(layer.name for layer in self.layers)

    @property
    def weight_bytes(self) -> int:
        return sum(layer.weight_bytes for layer in self.layers)

    def loss(self) -> np.ndarray:
        """Predicted loss per grid sparsity: through the probe, ``scale * e_probe * (e / e_probe)^exponent``
        (``scale * e`` when the exponent is 1)."""
        if self.exponent == 1.0 or not self.probe:
            return self.scale * self.error
        at = max(self.probe["error"], 1e-12)
        return self.scale * at * (np.maximum(self.error, 0.0) / at) ** self.exponent


_BLOCK_RE = re.compile(r"(?:layers?|blocks?|h|layer)[./_](\d+)[./]")


def _block_index(name: str) -> int | None:
    match = _BLOCK_RE.search(name)
    return int(match.group(1)) if match else None


def _weight(model: onnx.ModelProto, layer: LinearLayer) -> tuple[np.ndarray, int]:
    """The [K, N] float weight the survey matched for ``layer`` (MatMulNBits dequantized as the op
    computes with it: the rewriter passes those tensors through untouched, so the gate sees the same
    numbers) and the bytes its stored form takes (B + scales + zero points as stored)."""
    weight = layer.operands.weight
    if isinstance(weight, FloatWeight):
        array = weight.value.const_value.numpy().astype(np.float32)
        array = array.T if weight.transposed else array  # a view, as the layer's [K, N]
        return array, 4 * array.size
    stored = {init.name: init for init in model.graph.initializer}
    return weight.matrix(), sum(stored[source.name].ByteSize() for source in weight.sources)


def gated_layers(model: onnx.ModelProto | ModelSource, target: str = "both") -> list[GatedLayer]:
    """The linear layers KWTA's ``target`` selects (``both`` = attention + MLP, ``all`` = also the
    head and other linears): the rewriter's own layer records, with their weights (a ModelSource's
    survey, made once, is shared)."""
    surveyed = None
    if isinstance(model, ModelSource):
        model, surveyed = model.weights, model.linear_layers
    layers = []
    for layer in selected_layers(model, "kwta", target, surveyed):
        weight, stored_bytes = _weight(model, layer)
        layers.append(GatedLayer(layer.name, layer.role, layer.layer_class, _block_index(layer.name),
                                 layer.node.inputs[0].name, weight, stored_bytes))
    return layers


def units_of(layers: Sequence[GatedLayer], grid: Sequence[float] = GRID) -> list[Unit]:
    """Layers grouped by the X they read, in graph order."""
    by_input: dict[str, list[GatedLayer]] = {}
    for layer in layers:
        by_input.setdefault(layer.input_name, []).append(layer)
    return [Unit(name, members, tuple(grid)) for name, members in by_input.items()]


# --------------------------------------------------------------------------- the probe graph


def threshold_input(index: int) -> str:
    return f"{THRESHOLD_PREFIX}{index}"


def probe_model(model: onnx.ModelProto, layers: Sequence[GatedLayer], score: str = "l2",
                rotations: Mapping[str, np.ndarray] | None = None) -> onnx.ModelProto:
    """A copy of ``model`` where gated layer i reads ``X * (score(X) >= t_i)`` with ``t_i`` the
    float scalar graph input ``threshold_input(i)``; ``score(X)`` = |X| (``l2``) or
    |X| * ||W_k,:|| (``l2_weighted``). ``rotations[input name] = Q`` (orthogonal [K, K]) gates
    ``X Q`` instead and multiplies the kept part by Q^T: what gating after a rotation computes
    (for simulation: a real graph would fold Q into the weights around it)."""
    if score not in SCORES:
        raise ValueError(f"score {score!r}: expected one of {', '.join(SCORES)}")
    rotations = rotations or {}
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    graph = probe.graph
    index = {layer.name: i for i, layer in enumerate(layers)}
    new_nodes: list[onnx.NodeProto] = []
    rotated: dict[str, str] = {}
    zero = "ortsparse_probe/zero"
    graph.initializer.append(numpy_helper.from_array(np.zeros((), np.float32), zero))
    for node in graph.node:
        i = index.get(node.name)
        if i is None:
            new_nodes.append(node)
            continue
        layer = layers[i]
        tag = f"ortsparse_probe/{i}"
        x = node.input[0]
        if x in rotations:
            if x not in rotated:
                q = f"ortsparse_probe/rot/{len(rotated)}"
                graph.initializer.append(numpy_helper.from_array(rotations[x].astype(np.float32), q + "/Q"))
                graph.initializer.append(numpy_helper.from_array(rotations[x].T.copy().astype(np.float32), q + "/QT"))
                new_nodes.append(helper.make_node("MatMul", [x, q + "/Q"], [q + "/xq"], name=q + "/rotate"))
                rotated[x] = q
            source = rotated[x] + "/xq"
        else:
            source = x
        graph.input.append(helper.make_tensor_value_info(threshold_input(i), TensorProto.FLOAT, []))
        new_nodes.append(helper.make_node("Abs", [source], [tag + "/abs"], name=tag + "/abs"))
        scored = tag + "/abs"
        scale = layer.score_scale(score)
        if scale is not None:
            graph.initializer.append(numpy_helper.from_array(scale, tag + "/norms"))
            new_nodes.append(helper.make_node("Mul", [scored, tag + "/norms"], [tag + "/score"], name=tag + "/score"))
            scored = tag + "/score"
        new_nodes.append(helper.make_node("GreaterOrEqual", [scored, threshold_input(i)], [tag + "/keep"],
                                          name=tag + "/keep"))
        new_nodes.append(helper.make_node("Where", [tag + "/keep", source, zero], [tag + "/x"], name=tag + "/gate"))
        gated = tag + "/x"
        if x in rotations:
            new_nodes.append(helper.make_node("MatMul", [gated, rotated[x] + "/QT"], [tag + "/xr"], name=tag + "/unrotate"))
            gated = tag + "/xr"
        node.input[0] = gated
        new_nodes.append(node)
    del graph.node[:]
    graph.node.extend(new_nodes)
    return probe


# --------------------------------------------------------------------------- capture and curves


def _with_empty_past(feeds: Callable[[Any, Any], Mapping[str, np.ndarray]], session: Any,
                     model: onnx.ModelProto) -> Callable[[Any, Any], Mapping[str, np.ndarray]]:
    """``lm_feeds`` of a KV-cache decoder (an onnxruntime-genai graph) with an empty past: every
    window is one prefill of the graph that decodes. Other feeds and full-sequence graphs as given."""
    if feeds is not lm_feeds:
        return feeds
    kv = kv_layout(session, model)
    return feeds if kv is None else (lambda inputs, batch: lm_feeds(inputs, batch, kv))


def capture_inputs(model: onnx.ModelProto, units: Sequence[Unit], batches: Iterable[Any], max_rows: int = 2048,
                   seed: int = 0, feeds: Callable[[Any, Any], Mapping[str, np.ndarray]] = lm_feeds,
                   progress: Callable[[int], None] | None = None) -> dict[str, np.ndarray]:
    """{X name: [rows, K] float32 sample} of every unit's input over ``batches`` (one dense pass).
    Rows of encoder batches under a zero attention mask (padding) are left out."""
    wanted = [unit.input_name for unit in units]
    session = open_session(with_outputs(model, wanted), {"intra_op_num_threads": 1})
    feeds = _with_empty_past(feeds, session, model)
    rng = np.random.default_rng(seed)
    batches = list(batches)
    per_batch = max(1, -(-max_rows // max(1, len(batches))))
    parts: dict[str, list[np.ndarray]] = {name: [] for name in wanted}
    for i, batch in enumerate(batches):
        values = session.run(wanted, feeds(session, batch))
        mask = None
        if isinstance(batch, Mapping) and "attention_mask" in batch:
            mask = np.asarray(batch["attention_mask"]).reshape(-1) > 0
        for name, value in zip(wanted, values):
            rows = value.reshape(-1, value.shape[-1])
            if mask is not None and rows.shape[0] == mask.size:
                rows = rows[mask]
            take = rng.choice(rows.shape[0], min(per_batch, rows.shape[0]), replace=False)
            parts[name].append(rows[np.sort(take)].astype(np.float32))
        if progress:
            progress(i)
    return {name: np.concatenate(chunks) for name, chunks in parts.items()}


def measure_curves(units: Sequence[Unit], inputs: Mapping[str, np.ndarray], score: str = "l2",
                   flops_per_point: float = 2e7, error_stride: int = 2, seed: int = 0) -> None:
    """Fills every unit's ``thresholds`` (per layer: the score quantile of each grid sparsity) and
    ``error`` (relative output error ||(X ⊙ dropped) W||² / ||X W||² per grid sparsity, summed over
    the unit's layers) from the captured rows. The error is computed exactly on a row subsample
    (at most ``flops_per_point`` multiply-adds per layer and point, so the head's 49k columns cost
    no more than a small layer) at every ``error_stride``-th grid point, interpolated between."""
    rng = np.random.default_rng(seed)
    for unit in units:
        rows = inputs[unit.input_name]
        grid = np.asarray(unit.grid)
        measured = np.unique(np.r_[np.arange(0, len(grid), error_stride), len(grid) - 1])
        error = np.zeros(len(measured))
        for layer in unit.layers:
            scale = layer.score_scale(score)
            scores = np.abs(rows) if scale is None else np.abs(rows) * scale
            thresholds = np.quantile(scores.reshape(-1), grid).astype(np.float32)
            thresholds[grid <= 0.0] = 0.0
            unit.thresholds[layer.name] = thresholds
            k, n = layer.weight.shape
            count = int(min(rows.shape[0], max(16, flops_per_point // (k * n))))
            pick = np.sort(rng.choice(rows.shape[0], count, replace=False))
            x, s = rows[pick], scores[pick]
            dense = float(np.sum((x @ layer.weight).astype(np.float64) ** 2))
            for i, j in enumerate(measured):
                if thresholds[j] > 0.0:
                    dropped = np.where(s >= thresholds[j], np.float32(0.0), x)
                    error[i] += float(np.sum((dropped @ layer.weight).astype(np.float64) ** 2)) / max(dense, 1e-30)
        unit.error = np.interp(grid, grid[measured], error)


# --------------------------------------------------------------------------- losses on the probe graph


class ProbeSession:
    """One onnxruntime session of the probe graph; ``run(thresholds, batch)`` feeds the thresholds
    (layer index -> value; the others 0 = dense) with a batch."""

    def __init__(self, model: onnx.ModelProto, layers: Sequence[GatedLayer], score: str = "l2",
                 rotations: Mapping[str, np.ndarray] | None = None, threads: int = 1,
                 feeds: Callable[[Any, Any], Mapping[str, np.ndarray]] = lm_feeds) -> None:
        self.layers = list(layers)
        self.session = open_session(probe_model(model, layers, score, rotations), {"intra_op_num_threads": threads})
        self.model_inputs = [i for i in self.session.get_inputs() if not i.name.startswith(THRESHOLD_PREFIX)]
        outputs = [o.name for o in self.session.get_outputs()]
        self.output = "logits" if "logits" in outputs else outputs[0]
        self.feeds = _with_empty_past(feeds, self.session, model)
        self.runs = 0

    def run(self, thresholds: Mapping[int, float], batch: Any) -> np.ndarray:
        feed = dict(self.feeds(self.model_inputs, batch))
        for i in range(len(self.layers)):
            feed[threshold_input(i)] = np.array(thresholds.get(i, 0.0), np.float32)
        self.runs += 1
        return self.session.run([self.output], feed)[0]


class LmLoss:
    """Losses of a decoder on fixed windows, against its dense run: ``kl`` (mean KL(dense || gated)
    of the next-token distribution, nats; for probes) and ``dppl`` (ppl ratio - 1; the budget).
    Scored are the predictions from position ``first`` on (1 after a BOS: corpus.first_scored). The
    log softmax is taken a block of rows at a time (perplexity.log_softmax_blocks); the dense run's
    log-probabilities kept for ``kl`` are float32, the size of one window's logits."""

    kind = "lm"

    def __init__(self, probe: ProbeSession, windows: np.ndarray, keep_logprobs: bool,
                 baseline_nll: float | np.ndarray | None = None, first: int = 0) -> None:
        self.probe = probe
        self.windows = np.asarray(windows)
        self.first = first
        self.dense_logprobs: list[np.ndarray] = []
        window_nll = []
        for window in self.windows:
            logits = self._logits({}, window)
            window_nll.append(float(score_logits(logits, window[first + 1:])[0].mean()))
            if keep_logprobs:
                logp = np.empty(logits.shape, dtype=np.float32)
                for start, stop, block in log_softmax_blocks(logits):
                    logp[start:stop] = block
                self.dense_logprobs.append(logp)
        self.dense_window_nll = np.asarray(window_nll)
        self.scored = self.windows.shape[0] * (self.windows.shape[1] - 1 - first)
        # dppl is against the dense model itself, or against a reference (e.g. the fp32 model of a
        # quantized one: the budget then covers quantization and gating together): its mean NLL,
        # or its NLL per window (``baseline_window_nll``, for per-window losses).
        baseline = self.dense_window_nll if baseline_nll is None else np.asarray(baseline_nll, dtype=np.float64)
        self.baseline_window_nll = baseline if baseline.ndim == 1 else None
        self.dense_nll = float(np.mean(baseline))

    def _logits(self, thresholds: Mapping[int, float], window: np.ndarray) -> np.ndarray:
        return self.probe.run(thresholds, window)[0, self.first:-1]

    def window_nll(self, thresholds: Mapping[int, float]) -> np.ndarray:
        """Mean NLL (nats) of each window's scored tokens with ``thresholds`` applied."""
        return np.asarray([float(score_logits(self._logits(thresholds, window), window[self.first + 1:])[0].mean())
                           for window in self.windows])

    def window_loss(self, thresholds: Mapping[int, float]) -> np.ndarray:
        """Per window: NLL with ``thresholds`` minus the baseline's NLL on that window (log ppl ratio;
        needs a per-window baseline: the dense run's, or a reference's given per window)."""
        if self.baseline_window_nll is None:
            raise ValueError("window_loss needs the baseline's NLL per window")
        return self.window_nll(thresholds) - self.baseline_window_nll

    def nll(self, thresholds: Mapping[int, float]) -> float:
        return float(np.mean(self.window_nll(thresholds)))

    def dppl(self, thresholds: Mapping[int, float]) -> float:
        return math.exp(self.nll(thresholds) - self.dense_nll) - 1.0

    def kl(self, thresholds: Mapping[int, float]) -> float:
        total = 0.0
        for window, dense in zip(self.windows, self.dense_logprobs):
            for start, stop, logp in log_softmax_blocks(self._logits(thresholds, window)):
                block = dense[start:stop].astype(np.float64)
                total += float(np.sum(np.exp(block) * (block - logp)))
        return total / self.scored

    budget_loss = dppl
    probe_loss = kl


class EncoderLoss:
    """1 - mean cosine between dense and gated sentence embeddings (mean pooling over the mask)."""

    kind = "encoder"

    def __init__(self, probe: ProbeSession, batches: Sequence[Mapping[str, np.ndarray]]) -> None:
        self.probe = probe
        self.batches = list(batches)
        self.dense = [self._embed({}, batch) for batch in self.batches]

    def _embed(self, thresholds: Mapping[int, float], batch: Mapping[str, np.ndarray]) -> np.ndarray:
        return mean_pool(self.probe.run(thresholds, batch), np.asarray(batch["attention_mask"]))

    def cosines(self, thresholds: Mapping[int, float]) -> np.ndarray:
        return np.concatenate([np.sum(d * self._embed(thresholds, b), axis=1) for d, b in zip(self.dense, self.batches)])

    def loss(self, thresholds: Mapping[int, float]) -> float:
        return 1.0 - float(self.cosines(thresholds).mean())

    budget_loss = loss
    probe_loss = loss


# --------------------------------------------------------------------------- allocation


def thresholds_for(units: Sequence[Unit], layers: Sequence[GatedLayer], choice: Mapping[str, int]) -> dict[int, float]:
    """{layer index: threshold} for ``choice`` (unit input name -> grid index; absent = dense)."""
    position = {layer.name: i for i, layer in enumerate(layers)}
    result = {}
    for unit in units:
        j = choice.get(unit.input_name, 0)
        for layer in unit.layers:
            result[position[layer.name]] = float(unit.thresholds[layer.name][j])
    return result


def skipped_fraction(units: Sequence[Unit], choice: Mapping[str, int]) -> float:
    """Gated weight bytes skipped (planned: grid sparsity x bytes) / bytes of all units."""
    total = sum(unit.weight_bytes for unit in units)
    skipped = sum(unit.weight_bytes * unit.grid[choice.get(unit.input_name, 0)] for unit in units)
    return skipped / total if total else 0.0


# The exponents a two-probe fit is trusted with: Gemma-3-270M's body units measured 0.12-0.76, and
# the predictions that matched the measured losses (docs/results.md) used them clipped at 0.5.
EXPONENT_RANGE = (0.5, 3.0)


def _first_reaching(unit: Unit, level: float, lowest: float, highest: float, after: int = -1) -> int:
    """The grid index (past ``after``) where the unit's error first reaches ``level``, within
    [lowest, highest] (the last allowed index when it never does)."""
    grid = np.asarray(unit.grid)
    allowed = [j for j in np.flatnonzero((grid >= lowest) & (grid <= highest)) if j > after]
    reaching = [j for j in allowed if unit.error[j] >= level]
    return int(reaching[0] if reaching else allowed[-1] if allowed else len(grid) - 1)


def probe_units(units: Sequence[Unit], layers: Sequence[GatedLayer], probe_loss: Callable[[Mapping[int, float]], float],
                level: float = 0.02, lowest: float = 0.1, highest: float = 0.7, second_level: float | None = None,
                progress: Callable[[int], None] | None = None) -> None:
    """Sets each unit's ``scale`` (loss per unit of relative output error): gate the unit alone at
    the grid sparsity where its error first reaches ``level`` (clipped to [lowest, highest]) and
    measure ``probe_loss``. With ``second_level``, a second probe where the error reaches that
    (below the first, or further along up to 0.9) sets the unit's ``exponent``: loss ~ error^p
    through both probes (clipped to :data:`EXPONENT_RANGE`). Measured on Gemma-3-270M int8
    (docs/results.md), attention and MLP units' KL grows like error^0.1-0.8 between 0.4% and 2%
    output error while the head's is linear: a line through the 2% probe puts the small errors an
    allocation actually chooses at a half to a third of their loss, and undervalues the head
    against them."""
    for i, unit in enumerate(units):
        grid = np.asarray(unit.grid)
        j = _first_reaching(unit, level, lowest, highest)
        loss = probe_loss(thresholds_for(units, layers, {unit.input_name: j}))
        unit.probe = {"sparsity": float(grid[j]), "error": float(unit.error[j]), "loss": float(loss)}
        unit.scale = max(loss, 0.0) / max(float(unit.error[j]), 1e-12)
        if second_level is not None:
            k = (_first_reaching(unit, second_level, lowest, 0.9, after=j) if second_level > level
                 else _last_below(unit, second_level, j))
            second = probe_loss(thresholds_for(units, layers, {unit.input_name: k}))
            unit.second_probe = {"sparsity": float(grid[k]), "error": float(unit.error[k]), "loss": float(second)}
            unit.exponent = loss_exponent(*sorted((unit.probe, unit.second_probe), key=lambda probe: probe["error"]))
        if progress:
            progress(i)


def _last_below(unit: Unit, level: float, before: int) -> int:
    """The grid index (below ``before``, from 1) where the unit's error first reaches ``level``; four
    steps below ``before`` when none does (the error rises too steeply to meet it between points)."""
    reaching = [j for j in range(1, before) if unit.error[j] >= level]
    return int(reaching[0]) if reaching else max(1, before - 4)


def loss_exponent(near: Mapping[str, float], far: Mapping[str, float]) -> float:
    """p of loss ~ error^p through two probes ({"error", "loss"} each); 1 where they cannot tell
    (the errors too close, a loss not positive)."""
    if far["error"] <= 1.05 * near["error"] or near["loss"] <= 0.0 or far["loss"] <= 0.0:
        return 1.0
    p = math.log(far["loss"] / near["loss"]) / math.log(far["error"] / near["error"])
    return float(min(max(p, EXPONENT_RANGE[0]), EXPONENT_RANGE[1]))


def allocate(units: Sequence[Unit], mu: float, cap: float = 1.0, floor: float = 0.0) -> dict[str, int]:
    """The Lagrangian choice for price ``mu``: per unit the grid index minimising
    ``loss_u(s) - mu * value_u(s)``. When every unit has a measured ``saving`` the value is the time
    it saves (0 at sparsity 0: the layer stays as the input has it; scaled by the units' largest
    savings summed, so the price keeps the byte model's range), and sparsities that save none are
    not allowed; otherwise it is the bytes skipped, ``bytes_u / total_bytes * s``, and sparsities between
    0 and ``floor`` are not allowed (a layer gated that little skips too few bytes to pay for its
    gate). Sparsities above ``cap`` are never allowed."""
    timed = bool(units) and all(unit.saving is not None for unit in units)
    total = sum(unit.weight_bytes for unit in units)
    scale = _saving_scale(units) if timed else 1.0
    choice = {}
    for unit in units:
        grid = np.asarray(unit.grid)
        if timed:
            value = np.where(grid > 0.0, unit.saving, 0.0) / scale
            objective = unit.loss() - mu * value
            objective[(grid > 0.0) & (unit.saving <= 0.0)] = np.inf
        else:
            objective = unit.loss() - mu * unit.weight_bytes / total * grid
            objective[(grid > 0.0) & (grid < floor)] = np.inf
        objective[grid > cap] = np.inf
        choice[unit.input_name] = int(np.argmin(objective))
    return choice


def _saving_scale(units: Sequence[Unit]) -> float:
    """The units' largest savings summed (a positive normaliser: prices stay in the byte model's range)."""
    return max(sum(max(float(np.max(unit.saving)), 0.0) for unit in units if unit.saving is not None), 1e-12)


def predicted_loss(units: Sequence[Unit], choice: Mapping[str, int]) -> float:
    return float(sum(unit.loss()[choice.get(unit.input_name, 0)] for unit in units))


def uniform_choice(units: Sequence[Unit], sparsity: float) -> dict[str, int]:
    return {unit.input_name: int(np.argmin(np.abs(np.asarray(unit.grid) - sparsity))) for unit in units}


def bisect_price(units: Sequence[Unit], layers: Sequence[GatedLayer], budget_loss: Callable[[Mapping[int, float]], float],
                 budget: float, steps: int = 8, cap: float = 1.0, log: Callable[[str], None] = print
                 ) -> tuple[dict[str, int], list[dict[str, Any]]]:
    """The largest price mu (bisection in log space over ``steps`` joint measurements) whose
    allocation keeps ``budget_loss`` <= ``budget``; returns that allocation and the history."""
    guess = price_for(units, budget, cap)  # bracket mu by the predicted loss
    low, high = guess / 16.0, guess * 16.0
    best: dict[str, int] = {unit.input_name: 0 for unit in units}
    history: list[dict[str, Any]] = []
    mu = guess
    for _ in range(steps):
        choice = allocate(units, mu, cap)
        loss = budget_loss(thresholds_for(units, layers, choice))
        record = {"mu": mu, "loss": loss, "predicted": predicted_loss(units, choice),
                  "skipped": skipped_fraction(units, choice)}
        history.append(record)
        log(f"allocation: mu {mu:.3g}: loss {loss:+.4f} (predicted {record['predicted']:.4f}), "
            f"skipped {record['skipped']:.1%} of gated bytes")
        if loss <= budget:
            if skipped_fraction(units, choice) >= skipped_fraction(units, best):
                best = choice
            low = mu
        else:
            high = mu
        mu = math.sqrt(low * high)
    return best, history


# --------------------------------------------------------------------------- the library function


@dataclasses.dataclass
class Allocation:
    """The result: per-layer thresholds (``plan()``: what the rewriter takes), the planned
    sparsity per layer, the calibration loss it was verified at and how it was found."""

    score: str
    layers: list[GatedLayer]
    units: list[Unit]
    choice: dict[str, int]
    budget: float  # the calibration loss the choice had to meet (margin x budget)
    calibration_loss: float
    history: list[dict[str, Any]]
    seconds: dict[str, float]
    dense_on_ours: list[str] = dataclasses.field(default_factory=list)  # see dense_quantized_heads()

    def sparsity(self) -> dict[str, float]:
        return {layer.name: float(unit.grid[self.choice.get(unit.input_name, 0)])
                for unit in self.units for layer in unit.layers}

    def thresholds(self) -> dict[str, float]:
        return {layer.name: float(unit.thresholds[layer.name][self.choice.get(unit.input_name, 0)])
                for unit in self.units for layer in unit.layers}

    def skipped_fraction(self) -> float:
        """Planned fraction of the gated layers' weight bytes skipped (grid sparsity x bytes)."""
        return skipped_fraction(self.units, self.choice)

    def plan(self) -> NodePlan:
        """The decision as the rewriter takes it: every layer off, the ``dense_on_ours`` layers dense
        on our kernel, then each gated layer with its threshold (block 1, k_frac 1). Its
        ``entries()`` are the override file ``calibrate -o`` writes."""
        nodes: dict[str, dict[str, Any]] = {name: dict(DENSE_ON_OURS) for name in self.dense_on_ours}
        sparsity = self.sparsity()
        for name, threshold in self.thresholds().items():
            if sparsity[name] <= 0.0:
                continue
            gate: dict[str, Any] = {"threshold": threshold, "k_frac": 1.0, "block": 1}
            if self.score != "l2":
                gate["score"] = self.score
            nodes[name] = gate
        return NodePlan("kwta", nodes)

    def report(self) -> dict[str, Any]:
        return {
            "score": self.score, "budget": self.budget, "calibration_loss": self.calibration_loss,
            "planned_skipped_fraction_of_gated": self.skipped_fraction(),
            "gated_weight_bytes": sum(unit.weight_bytes for unit in self.units),
            "seconds": self.seconds, "history": self.history, "dense_on_ours": self.dense_on_ours,
            "units": [{"layers": [layer.name for layer in unit.layers], "weight_bytes": unit.weight_bytes,
                       "sparsity": float(unit.grid[self.choice.get(unit.input_name, 0)]),
                       "probe": unit.probe, "loss_per_error": unit.scale, "second_probe": unit.second_probe,
                       "loss_exponent": unit.exponent} for unit in self.units],
        }


def dense_quantized_heads(model: onnx.ModelProto, gated: Sequence[str] = (),
                          surveyed: Sequence[LinearLayer] | None = None) -> list[str]:
    """The LM heads stored as MatMulNBits that are not gated: candidates for running dense on our
    quantized kernel. At one token the head is the widest layer (576 x 49152 in SmolLM2, a fifth of a
    decode step's weight bytes); whether our kernel streams it faster than MatMulNBits depends on the
    shape and the machine (faster on SmolLM2's head, reports/quant_kernel.md; slower on Gemma-3's
    640 x 262144), so ``calibrate.gating_search`` keeps only the ones a measurement finds faster
    (:func:`ortsparse.calibration.head_placement.place_heads`). They keep the MatMulNBits node's
    accuracy_level (its numerics), which the held-out check then measures.
    Other ungated MatMulNBits layers stay as they are: at narrow shapes dense ours is not always
    faster (bench/bench_quant_op.py, 1536x576). ``surveyed``: the survey's layers of ``model``, when
    the caller has them."""
    return [layer.name for layer in selected_layers(model, "kwta", "all", surveyed)
            if layer.op_type.endswith("MatMulNBits") and layer.layer_class == "head" and layer.name not in set(gated)]


@dataclasses.dataclass
class Prepared:
    """Steps 1-2 done: every unit's cost curve and probe, and the probe session that evaluates any
    set of thresholds (step 3-4 run on it: :func:`bisect_price`, or a caller's own search)."""

    model: onnx.ModelProto
    score: str
    layers: list[GatedLayer]
    units: list[Unit]
    session: ProbeSession
    seconds: dict[str, float]
    surveyed: Sequence[LinearLayer] | None = None  # the rewriter's survey of ``model``, when it was made

    def allocation(self, choice: Mapping[str, int], budget: float, calibration_loss: float,
                   history: list[dict[str, Any]]) -> Allocation:
        """The :class:`Allocation` of ``choice`` (unit input name -> grid index). A candidate head the
        choice leaves ungated may still run dense on our kernel (:func:`dense_quantized_heads`)."""
        gated = [layer.name for unit in self.units if choice.get(unit.input_name, 0) > 0 for layer in unit.layers]
        return Allocation(self.score, list(self.layers), self.units, dict(choice), budget, calibration_loss, history,
                          self.seconds, dense_quantized_heads(self.model, gated, self.surveyed))


def prepare(model: onnx.ModelProto, layers: list[GatedLayer], score: str, capture_batches: Sequence[Any],
            probe_loss_of: Callable[[ProbeSession], Callable[[Mapping[int, float]], float]], *,
            level: float, max_rows: int, log: Callable[[str], None],
            surveyed: Sequence[LinearLayer] | None = None, second_level: float | None = None) -> Prepared:
    """Capture and curves (step 1) on ``capture_batches``, then one probe per unit (step 2; two with
    ``second_level``: :func:`probe_units`)."""
    if not layers:
        raise ValueError("no linear layer to gate (the target selects none)")
    seconds: dict[str, float] = {}
    clock = time.perf_counter()
    units = units_of(layers)
    log(f"allocation: {len(layers)} layers in {len(units)} units; capturing inputs on {len(capture_batches)} batches")
    inputs = capture_inputs(model, units, capture_batches, max_rows=max_rows)
    measure_curves(units, inputs, score)
    del inputs
    seconds["curves"] = time.perf_counter() - clock
    clock = time.perf_counter()
    session = ProbeSession(model, layers, score)
    probe_loss = probe_loss_of(session)
    log(f"allocation: probing {len(units)} units one at a time" + ("" if second_level is None else ", twice each"))
    probe_units(units, layers, probe_loss, level=level, second_level=second_level,
                progress=lambda i: log(f"allocation: probed {i + 1}/{len(units)}") if (i + 1) % 20 == 0 else None)
    seconds["probes"] = time.perf_counter() - clock
    return Prepared(model, score, list(layers), units, session, seconds, surveyed)


def _allocate(model: onnx.ModelProto, layers: list[GatedLayer], score: str, capture_batches: Sequence[Any],
              probe_loss_of: Callable[[ProbeSession], Callable[[Mapping[int, float]], float]],
              budget_loss_of: Callable[[ProbeSession], Callable[[Mapping[int, float]], float]],
              budget: float, *, level: float, steps: int, max_rows: int, log: Callable[[str], None]) -> Allocation:
    prepared = prepare(model, layers, score, capture_batches, probe_loss_of, level=level, max_rows=max_rows, log=log)
    units = prepared.units
    clock = time.perf_counter()
    budget_loss = budget_loss_of(prepared.session)
    choice, history = bisect_price(units, layers, budget_loss, budget, steps=steps, log=log)
    prepared.seconds["search"] = time.perf_counter() - clock
    verified = [h["loss"] for h in history if h["skipped"] == skipped_fraction(units, choice) and h["loss"] <= budget]
    return prepared.allocation(choice, budget, verified[0] if verified else 0.0, history)


def prepare_lm(model: Any, calibration_windows: np.ndarray, probe_window: np.ndarray, *, target: str = "both",
               score: str = "l2", level: float = 0.02, max_rows: int = 2048, second_level: float | None = None,
               log: Callable[[str], None] = print) -> Prepared:
    """Steps 1-2 for an LM: curves captured on ``calibration_windows`` (``[n, L]`` token ids), each
    unit probed (KL vs dense) on ``probe_window`` (``[1, L]``; a second time at ``second_level``:
    :func:`probe_units`). ``model``: a path, a proto, or a ModelSource (its weighted graph and
    survey are used, not read again)."""
    if isinstance(model, ModelSource):
        layers, surveyed, model = gated_layers(model, target), model.linear_layers, model.weights
    else:
        model = load_proto(model, load_weights=True)
        layers, surveyed = gated_layers(model, target), None
    return prepare(model, layers, score, list(np.asarray(calibration_windows)),
                   lambda session: LmLoss(session, probe_window, keep_logprobs=True).kl,
                   level=level, max_rows=max_rows, log=log, surveyed=surveyed, second_level=second_level)


def price_for(units: Sequence[Unit], predicted: float, cap: float = 1.0, floor: float = 0.0) -> float:
    """The price mu whose allocation's predicted loss is ``predicted`` (bisection in log space)."""
    low, high = 1e-8, 1e3
    for _ in range(60):
        mid = math.sqrt(low * high)
        if predicted_loss(units, allocate(units, mid, cap, floor)) > predicted:
            high = mid
        else:
            low = mid
    return math.sqrt(low * high)


def allocate_lm(model: Any, calibration_tokens: Any, max_dppl: float = 0.02, *, target: str = "both",
                score: str = "l2", margin: float = 0.75, windows: int = 8, window_len: int = 512,
                level: float = 0.02, steps: int = 8, max_rows: int = 2048, reference: Any = None,
                bos: int | None = None, log: Callable[[str], None] = print) -> Allocation:
    """Per-layer thresholds for a full-sequence LM export whose dppl on the calibration windows
    (``windows`` x ``window_len`` positions from the start of ``calibration_tokens``, each starting
    with ``bos`` when given: corpus.lm_windows) stays within ``margin * max_dppl``. Probes use the
    window after them (the first one when there is none). ``reference``: measure the dppl against
    this model (same windows) instead of ``model``."""
    model = load_proto(model, load_weights=True)
    tokens = np.asarray(calibration_tokens).reshape(-1)
    verify = lm_windows(tokens, windows, window_len, bos=bos)
    text = text_per_window(window_len, bos)
    spare = tokens.size >= (windows + 1) * text
    probe = lm_windows(tokens, 1, window_len, offset=windows * text if spare else 0, bos=bos)
    layers = gated_layers(model, target)
    baseline = None
    if reference is not None:
        baseline = perplexity(reference, tokens, windows, window_len, bos=bos)["nll"]
    first = first_scored(bos)
    return _allocate(model, layers, score, list(verify),
                     lambda session: LmLoss(session, probe, keep_logprobs=True, first=first).kl,
                     lambda session: LmLoss(session, verify, keep_logprobs=False, baseline_nll=baseline,
                                            first=first).dppl,
                     margin * max_dppl, level=level, steps=steps, max_rows=max_rows, log=log)


def allocate_encoder(model: Any, batches: Sequence[Mapping[str, np.ndarray]], min_cosine: float = 0.99, *,
                     target: str = "both", score: str = "l2", margin: float = 0.75, level: float = 0.02,
                     steps: int = 8, max_rows: int = 2048, log: Callable[[str], None] = print) -> Allocation:
    """Per-layer thresholds for an encoder whose mean embedding cosine on ``batches`` stays above
    ``1 - margin * (1 - min_cosine)``."""
    model = load_proto(model, load_weights=True)
    layers = gated_layers(model, target)

    def loss_of(session: ProbeSession) -> Callable[[Mapping[int, float]], float]:
        return EncoderLoss(session, batches).loss

    return _allocate(model, layers, score, list(batches), loss_of, loss_of, margin * (1.0 - min_cosine),
                     level=level, steps=steps, max_rows=max_rows, log=log)


# --------------------------------------------------------------------------- `ortsparse calibrate --method allocated`


def bytes_summary(model: onnx.ModelProto, measured: Mapping[str, Any], dense: Sequence[str] = ()) -> dict[str, Any]:
    """Gated weight bytes skipped as the op measured them (``1 - weighted_keep_ratio`` of
    :func:`ortsparse.measure.op_metrics.snapshot`) and that skip as a fraction of every linear
    layer's weight bytes (head included: what one decode step reads, the embedding row aside).
    ``dense``: layers on our op that keep every row (not counted as gated)."""
    nodes = measured.get("nodes", {})
    every = gated_layers(model, "all")
    total = sum(layer.weight_bytes for layer in every)
    gated = [layer for layer in every if layer.name in nodes and layer.name not in set(dense)]
    gated_bytes = sum(layer.weight_bytes for layer in gated)
    skipped = sum((1.0 - nodes[layer.name]) * layer.weight_bytes for layer in gated)
    return {"gated_layers": len(gated), "gated_weight_bytes": gated_bytes, "all_linear_weight_bytes": total,
            "skipped_fraction_of_gated": skipped / gated_bytes if gated_bytes else 0.0,
            "skipped_fraction_of_all": skipped / total if total else 0.0}


def run(args: Any, target: str, write: Callable[[str, str, str], None], report_path: str,
        log: Callable[[str], None] = print) -> int:
    """``ortsparse calibrate --method allocated``: the allocation on the calibration half, the
    override file, and the held-out check on the evaluation half (exit 1 when it misses)."""
    encoder = args.min_cosine is not None
    model_file = args.model or str(model_path("minilm" if encoder else "smollm2",
                                              "torchscript" if encoder else "full.torchscript"))
    model = load_proto(model_file, load_weights=True)  # external data under ONNX Runtime's rule
    if encoder:
        arrays = load_sentences(default_sentences() if getattr(args, "sentences", None) is None else args.sentences)
        half = arrays["input_ids"].shape[0] // 2
        held = {k: v[:half] for k, v in arrays.items()}
        calib = {k: v[half:] for k, v in arrays.items()}
        result = allocate_encoder(model, sentence_batches(calib), args.min_cosine, target=target, score=args.score,
                                  margin=args.margin, log=log)
        final = compare_embeddings(model, rewritten_with(model, result.plan()), held)
        passed, summary = final["cosine_mean"] >= args.min_cosine, f"held-out cosine mean {final['cosine_mean']:.4f}"
    else:
        tokens = load_corpus_tokens(args.tokens, vocabulary_of(model))
        eval_tokens, calib_tokens = np.split(tokens, [len(tokens) // 2])
        result = allocate_lm(model, calib_tokens, args.max_dppl, target=target, score=args.score, margin=args.margin,
                             windows=args.calib_windows, window_len=args.window_len, log=log)
        final = compare_lm(model, rewritten_with(model, result.plan()), eval_tokens, windows=args.eval_windows,
                           window_len=args.window_len)
        passed = final["dppl"] <= args.max_dppl
        summary = f"held-out dppl {final['dppl']:+.4f}, top-1 agreement {final['top1_agreement']:.3f}"
    write(args.output, "override file", json.dumps({"layers": result.plan().entries()}, indent=1) + "\n")
    measured = bytes_summary(model, final.get("metrics", {}), result.dense_on_ours)
    report = {"command": getattr(args, "command_line", None), "model": model_file, "method": "allocated",
              "target": target, "margin": args.margin, "allocation": result.report(), "sparsity": result.sparsity(),
              "held_out": {k: v for k, v in final.items() if not isinstance(v, np.ndarray)}, "bytes": measured}
    write(report_path, "report", json.dumps(report, indent=1, default=float) + "\n")
    log(f"calibrate: wrote {args.output}; {summary}; skipped {measured['skipped_fraction_of_gated']:.1%} of gated "
        f"weight bytes ({measured['skipped_fraction_of_all']:.1%} of all linear weight bytes); report {report_path}")
    return 0 if passed else 1
