"""Quality of a rewritten model against its dense original (library first, ``ortsparse quality`` on top).

- :func:`perplexity` / :func:`compare_lm`: a full-sequence LM export (inputs ``input_ids``,
  ``attention_mask`` [, ``position_ids``]; output ``logits``) on fixed token windows. Window ``i``
  is ``token_ids[offset + i*L : offset + (i+1)*L]``: consecutive, non-overlapping, from the start of
  the array unless ``offset`` says otherwise. Each window is one sequence (batch 1, mask all ones,
  positions 0..L-1); its L-1 next-token predictions are scored (the first token of a window is
  context only). ppl = exp(mean NLL over every scored token of every window). Top-1 agreement =
  fraction of scored positions where both models' argmax next token is the same.
- :func:`compare_embeddings`: sentence embeddings as sentence-transformers' all-MiniLM-L6-v2 makes
  them (mean of the last hidden state over ``attention_mask``, then L2 normalisation); cosine between
  the dense and rewritten embedding of every sentence, mean and minimum.
- :func:`compare_outputs`: every output on generated inputs (``ortsparse.verify``): max abs and
  relative L2 error against a budget (1e-4 when every gated layer is exact, else 0.5).

Models are paths, ``onnx.ModelProto`` or serialized bytes. The rewritten side's ``ortsparse.metrics()``
are reset before it runs and reported afterwards (keep ratios). See docs/measure.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

EXIT_OK, EXIT_OVER_BUDGET, EXIT_USAGE = 0, 1, 2
KINDS = ("auto", "lm", "embedding", "generic")


# --------------------------------------------------------------------------- model sources / sessions

def _proto(model: Any, load_weights: bool = False):
    import onnx

    if isinstance(model, onnx.ModelProto):
        return model
    if isinstance(model, (bytes, bytearray)):
        return onnx.load_from_string(bytes(model))
    return onnx.load(os.fspath(model), load_external_data=load_weights)


def _varint(data: Any, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def opset_domains(model: Any) -> set[str]:
    """The opset domains a model imports. For a file only the top level of the protobuf is read
    (the graph, field 7, is skipped over), so this costs microseconds on a 600 MB model."""
    import mmap

    import onnx

    if isinstance(model, (str, os.PathLike)):
        try:
            with open(os.fspath(model), "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
                domains, pos = set(), 0
                while pos < len(data):
                    key, pos = _varint(data, pos)
                    field, wire = key >> 3, key & 7
                    if wire == 0:
                        _, pos = _varint(data, pos)
                    elif wire == 1:
                        pos += 8
                    elif wire == 5:
                        pos += 4
                    elif wire == 2:
                        length, pos = _varint(data, pos)
                        if field == 8:  # ModelProto.opset_import
                            opset = onnx.OperatorSetIdProto()
                            opset.ParseFromString(data[pos:pos + length])
                            domains.add(opset.domain)
                        pos += length
                    else:
                        raise ValueError(f"wire type {wire}")
                if pos != len(data):
                    raise ValueError("truncated")
                return domains
        except (OSError, ValueError, IndexError):
            pass  # not a plain protobuf file (or empty): let onnx.load explain
    return {o.domain for o in _proto(model).opset_import}


def uses_ortsparse(model: Any) -> bool:
    from .. import DOMAIN

    return DOMAIN in opset_domains(model)


def open_session(model: Any, session_options: Any = None):
    """An onnxruntime CPU session for a path / ModelProto / bytes. ``session_options``: None, a dict
    of keywords for :func:`ortsparse.session_options` (``intra_op_num_threads``, ``allow_spinning``,
    ...) or a ready ``onnxruntime.SessionOptions`` (used as given). The op library is registered
    only when the model uses the ``ai.ortsparse`` domain, so dense models run without it."""
    import onnxruntime as ort

    if isinstance(session_options, ort.SessionOptions):
        options = session_options
    else:
        keywords = dict(session_options or {})
        if uses_ortsparse(model):
            from .. import session_options as ortsparse_options

            options = ortsparse_options(**keywords)
        else:
            options = ort.SessionOptions()
            threads = keywords.pop("intra_op_num_threads", None)
            spinning = keywords.pop("allow_spinning", None)
            if threads is not None:
                options.intra_op_num_threads = int(threads)
            if spinning is not None:
                options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
            for name, value in keywords.items():
                setattr(options, name, value)
    if hasattr(model, "SerializeToString"):
        model = model.SerializeToString()
    elif isinstance(model, os.PathLike):
        model = os.fspath(model)
    elif isinstance(model, bytearray):
        model = bytes(model)
    return ort.InferenceSession(model, sess_options=options, providers=["CPUExecutionProvider"])


def rewrite_in_memory(model: Any, config: Any = None):
    """(rewritten ModelProto, RewriteReport) of a path or ModelProto; nothing is written."""
    import onnx
    import onnx_ir as ir

    from ..graph_rewrite import load_model, rewrite_model

    if isinstance(model, (bytes, bytearray)):
        model = onnx.load_from_string(bytes(model))
    if isinstance(model, onnx.ModelProto):
        return rewrite_model(model, config)
    ir_model = load_model(model)
    ir_model, report = rewrite_model(ir_model, config)
    return ir.to_proto(ir_model), report


def gated_layers_exact(model: Any) -> bool:
    """True when every KwtaBlockMatMul of the model keeps all its inputs (k_frac >= 1 or k_abs >= K,
    threshold 0), i.e. the model must match its dense original up to float rounding."""
    from onnx import helper

    proto = _proto(model)
    dims = {init.name: tuple(init.dims) for init in proto.graph.initializer}
    for node in proto.graph.node:
        if node.op_type != "KwtaBlockMatMul":
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if float(attrs.get("threshold", 0.0)) > 0.0:
            return False
        k_abs = int(attrs.get("k_abs", 0))
        if k_abs > 0:
            shape = dims.get(node.input[1])
            if shape is None or k_abs < shape[0]:
                return False
        elif float(attrs.get("k_frac", 0.5)) < 1.0:
            return False
    return True


def metrics_summary(raw: Mapping[str, Mapping[str, Any]], model: Any = None) -> dict[str, Any]:
    """Compact view of ``ortsparse.metrics()``: per op type the overall keep ratio (blocks kept /
    blocks total, every call and token), per node its keep ratio, and — given the model — the keep
    ratio weighted by each gated layer's weight size (the fraction of gated weight bytes read)."""
    ops: dict[str, dict[str, Any]] = {}
    nodes: dict[str, float] = {}
    for name, values in raw.items():
        if name.startswith("total/"):
            op = name.split("/", 1)[1]
            total = float(values.get("blocks_total", 0) or 0)
            kept = float(values.get("blocks_kept", 0) or 0)
            ops[op] = {"keep_ratio": kept / total if total else None, "calls": values.get("calls"),
                       "blocks_total": total, "blocks_kept": kept}
        elif values.get("calls"):  # "<op type>/<node name>": the entry names its node
            total = float(values.get("blocks_total", 0) or 0)
            nodes[values.get("node", name)] = float(values.get("blocks_kept", 0) or 0) / total if total else float("nan")
    summary: dict[str, Any] = {"ops": ops, "nodes": nodes}
    if model is not None and nodes:
        proto = _proto(model)
        dims = {init.name: tuple(init.dims) for init in proto.graph.initializer}
        sizes = {}
        for node in proto.graph.node:
            if node.domain == "ai.ortsparse" and node.name in nodes and len(node.input) > 1:
                shape = dims.get(node.input[1])
                if shape and len(shape) == 2:
                    sizes[node.name] = shape[0] * shape[1]
        weight = sum(sizes.values())
        if weight:
            summary["weighted_keep_ratio"] = sum(nodes[n] * s for n, s in sizes.items()) / weight
            summary["gated_weights"] = weight
    return summary


def _snapshot_metrics(model: Any) -> dict[str, Any]:
    from .. import metrics

    return metrics_summary(metrics(), model)


def _reset_metrics() -> None:
    from .. import reset_metrics

    reset_metrics()


# --------------------------------------------------------------------------- language models

def lm_windows(token_ids: Any, windows: int = 8, window_len: int = 512, offset: int = 0) -> np.ndarray:
    """``[windows, window_len]`` int64: window i = ``token_ids[offset + i*L : offset + (i+1)*L]``."""
    tokens = np.asarray(token_ids).reshape(-1)
    if not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"token ids must be integers, got dtype {tokens.dtype}")
    if windows < 1 or window_len < 2:
        raise ValueError(f"need windows >= 1 and window_len >= 2 (got {windows} x {window_len})")
    if offset < 0:
        raise ValueError(f"offset {offset} is negative")
    needed = offset + windows * window_len
    if needed > tokens.size:
        raise ValueError(f"{windows} windows of {window_len} tokens from offset {offset} need {needed} tokens; "
                         f"the token array has {tokens.size}")
    return tokens[offset:needed].astype(np.int64).reshape(windows, window_len)


corpus_windows = lm_windows


def load_corpus_tokens(path: str | os.PathLike | None = None) -> np.ndarray:
    """The 1-D token ids of a ``.npy`` file; default: the cache's SmolLM2 britannica-11th tokens."""
    path = Path(path) if path is not None else default_corpus()
    if not path.is_file():
        raise FileNotFoundError(f"token corpus {path} not found (run `ortsparse models`, or give a .npy of token ids)")
    return np.load(path).reshape(-1)


def encoder_batches(sentences: Any = None, batch_size: int = 32) -> list[dict[str, np.ndarray]]:
    """The sentence set (default: the cache's MiniLM set) cut into batches of named arrays, each
    usable with :func:`lm_feeds`."""
    arrays = load_sentences(default_sentences() if sentences is None else sentences)
    count = arrays["input_ids"].shape[0]
    return [{k: v[start:start + batch_size] for k, v in arrays.items()} for start in range(0, count, batch_size)]


_NUMPY_INTS = {"tensor(int64)": np.int64, "tensor(int32)": np.int32}


def lm_feeds(session_or_inputs: Any, tokens: Any) -> dict[str, np.ndarray]:
    """Feeds of one full-sequence run: ``tokens`` are the ids of one window (``[L]`` or ``[1, L]``;
    mask all ones, positions 0..L-1, token types 0), or a mapping of named arrays (a sentence batch
    of :func:`encoder_batches`) fed by name. ``session_or_inputs``: a session or its ``get_inputs()``."""
    inputs = session_or_inputs.get_inputs() if hasattr(session_or_inputs, "get_inputs") else session_or_inputs
    if isinstance(tokens, Mapping):
        return _named_feeds(inputs, tokens)
    window = np.asarray(tokens).reshape(-1)
    feeds = {}
    length = window.shape[-1]
    for spec in inputs:
        dtype = _NUMPY_INTS.get(spec.type)
        name = spec.name.lower()
        if dtype is None and spec.type != "tensor(bool)":
            raise ValueError(f"input {spec.name!r} of type {spec.type}: perplexity needs a full-sequence LM export "
                             "(integer input_ids, attention_mask [, position_ids])")
        if "past" in name or "cache" in name or "present" in name:
            raise ValueError(f"input {spec.name!r} looks like a KV cache: perplexity needs a full-sequence export")
        if "mask" in name:
            feeds[spec.name] = np.ones((1, length), dtype=dtype or np.bool_)
        elif "position" in name:
            feeds[spec.name] = np.arange(length, dtype=dtype)[None, :]
        elif "type" in name:
            feeds[spec.name] = np.zeros((1, length), dtype=dtype)
        elif "ids" in name or "input" in name:
            feeds[spec.name] = window[None, :].astype(dtype)
        else:
            raise ValueError(f"do not know what to feed LM input {spec.name!r}")
    return feeds


def _named_feeds(inputs: Any, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Feeds from named arrays ([batch, S]); token types default to zeros, positions to 0..S-1."""
    mask = np.asarray(arrays.get("attention_mask", arrays.get("input_ids")))
    feeds = {}
    for spec in inputs:
        dtype = _NUMPY_INTS.get(spec.type, np.int64)
        lowered = spec.name.lower()
        if spec.name in arrays:
            feeds[spec.name] = np.asarray(arrays[spec.name]).astype(dtype)
        elif "type" in lowered:
            feeds[spec.name] = np.zeros(mask.shape, dtype=dtype)
        elif "position" in lowered:
            feeds[spec.name] = np.broadcast_to(np.arange(mask.shape[1], dtype=dtype), mask.shape).copy()
        else:
            raise ValueError(f"nothing to feed model input {spec.name!r} (have {', '.join(sorted(arrays))})")
    return feeds


def _logits_name(session: Any) -> str:
    names = [o.name for o in session.get_outputs()]
    return "logits" if "logits" in names else names[0]


def _log_softmax_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """-log softmax(logits)[target] per row, in float64."""
    rows = logits.astype(np.float64)
    peak = rows.max(axis=-1, keepdims=True)
    log_norm = peak[:, 0] + np.log(np.exp(rows - peak).sum(axis=-1))
    return log_norm - rows[np.arange(rows.shape[0]), targets]


def _check_vocabulary(model: Any, batch: np.ndarray) -> None:
    from ..verify import _embedding_sizes

    rows = _embedding_sizes(model)
    token_inputs = [n for n in rows if "ids" in n.lower() and not any(w in n.lower() for w in ("position", "type"))]
    vocab = min(rows[n] for n in token_inputs) if token_inputs else None
    if vocab is not None and int(batch.max()) >= vocab:
        raise ValueError(f"token id {int(batch.max())} is outside the model's vocabulary of {vocab}")


def perplexity(model_path_or_proto: Any, token_ids: Any, windows: int = 8, window_len: int = 512,
               session_options: Any = None, *, offset: int = 0, progress: bool = False,
               session: Any = None) -> dict[str, Any]:
    """Perplexity of a full-sequence LM export on ``windows`` consecutive windows of ``window_len``
    tokens (see :func:`lm_windows`). Returns ``ppl``, ``nll`` (mean, nats), ``tokens`` (scored),
    ``windows``, ``window_len``, ``offset`` and ``predictions`` (``[windows, window_len-1]`` argmax
    next-token ids, for agreement)."""
    from tqdm.auto import tqdm

    batch = lm_windows(token_ids, windows, window_len, offset)
    session = session or open_session(model_path_or_proto, session_options)
    output = _logits_name(session)
    inputs = session.get_inputs()
    _check_vocabulary(model_path_or_proto, batch)
    total_nll, count = 0.0, 0
    predictions = np.empty((windows, window_len - 1), dtype=np.int32)
    for i in tqdm(range(windows), desc="perplexity", unit="window", disable=not progress, leave=False):
        (logits,) = session.run([output], lm_feeds(inputs, batch[i]))
        logits = np.asarray(logits)
        if logits.ndim != 3 or logits.shape[:2] != (1, window_len):
            raise ValueError(f"output {output!r} has shape {list(logits.shape)}; expected [1, {window_len}, vocab]")
        if int(batch.max()) >= logits.shape[-1]:
            raise ValueError(f"token id {int(batch.max())} is outside the model's vocabulary of {logits.shape[-1]}")
        step = logits[0, :-1]
        nll = _log_softmax_nll(step, batch[i, 1:])
        total_nll += float(nll.sum())
        count += nll.size
        predictions[i] = step.argmax(axis=-1)
    mean = total_nll / count
    return {"ppl": math.exp(mean), "nll": mean, "tokens": count, "windows": windows, "window_len": window_len,
            "offset": offset, "predictions": predictions}


def compare_lm(dense_model: Any, rewritten_model: Any, token_ids: Any, windows: int = 8, window_len: int = 512,
               *, offset: int = 0, session_options: Any = None, progress: bool = False) -> dict[str, Any]:
    """Dense and rewritten LM on the same windows: ``ppl_dense``, ``ppl_rewritten``,
    ``dppl = ppl_rewritten / ppl_dense - 1``, ``top1_agreement`` (fraction of scored positions whose
    argmax next token agrees; also under ``agreement``) and the
    rewritten run's ``metrics`` (keep ratios; counters reset just before it)."""
    dense = perplexity(dense_model, token_ids, windows, window_len, session_options, offset=offset, progress=progress)
    if uses_ortsparse(rewritten_model):
        _reset_metrics()
    # Kept open until the metrics are read: a node's entry leaves ortsparse.metrics() with its session.
    session = open_session(rewritten_model, session_options)
    rewritten = perplexity(rewritten_model, token_ids, windows, window_len, session_options, offset=offset,
                           progress=progress, session=session)
    metrics = _snapshot_metrics(rewritten_model) if uses_ortsparse(rewritten_model) else {}
    agreement = float(np.mean(dense["predictions"] == rewritten["predictions"]))
    return {
        "kind": "lm", "windows": windows, "window_len": window_len, "offset": offset, "tokens": dense["tokens"],
        "ppl_dense": dense["ppl"], "ppl_rewritten": rewritten["ppl"],
        "nll_dense": dense["nll"], "nll_rewritten": rewritten["nll"],
        "dppl": rewritten["ppl"] / dense["ppl"] - 1.0, "top1_agreement": agreement, "agreement": agreement,
        "metrics": metrics,
    }


# --------------------------------------------------------------------------- sentence embeddings

def load_sentences(sentences: Any) -> dict[str, np.ndarray]:
    """A sentence set: a ``.npz`` path or a mapping with ``input_ids`` and ``attention_mask``
    (``[n, S]``, padded) and optionally ``token_type_ids``."""
    if isinstance(sentences, Mapping):
        arrays = {k: np.asarray(v) for k, v in sentences.items()}
    else:
        with np.load(os.fspath(sentences)) as data:
            arrays = {k: data[k] for k in data.files}
    for key in ("input_ids", "attention_mask"):
        if key not in arrays:
            raise ValueError(f"sentence set lacks {key!r} (has {', '.join(sorted(arrays))})")
        if arrays[key].ndim != 2:
            raise ValueError(f"sentence set {key!r} must be [sentences, length], got shape {list(arrays[key].shape)}")
    return arrays


def _hidden_name(session: Any) -> str:
    outputs = session.get_outputs()
    names = [o.name for o in outputs]
    if "last_hidden_state" in names:
        return "last_hidden_state"
    ranked = [o.name for o in outputs if len(o.shape) == 3]
    return ranked[0] if ranked else names[0]


def sentence_embeddings(model: Any, sentences: Any, batch_size: int = 32, session_options: Any = None, *,
                        session: Any = None) -> np.ndarray:
    """``[n, d]`` float64: mean of the last hidden state over attention_mask, L2-normalised."""
    arrays = load_sentences(sentences)
    session = session or open_session(model, session_options)
    output = _hidden_name(session)
    inputs = session.get_inputs()
    count = arrays["input_ids"].shape[0]
    result = []
    for start in range(0, count, batch_size):
        part = {k: v[start:start + batch_size] for k, v in arrays.items()}
        mask = part["attention_mask"]
        feeds = _named_feeds(inputs, part)
        (hidden,) = session.run([output], feeds)
        weights = mask.astype(np.float64)[:, :, None]
        pooled = (np.asarray(hidden, dtype=np.float64) * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1e-9)
        result.append(pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12))
    return np.concatenate(result, axis=0)


def compare_embeddings(dense_model: Any, rewritten_model: Any, sentences_npz: Any = None, batch_size: int = 32,
                       *, session_options: Any = None) -> dict[str, Any]:
    """Cosine between the dense and rewritten sentence embedding of every sentence: ``cosine_mean``,
    ``cosine_min`` (and which sentence), plus the rewritten run's ``metrics``. ``sentences_npz``:
    a path or mapping (:func:`load_sentences`); None = the cache's MiniLM sentence set."""
    arrays = load_sentences(default_sentences() if sentences_npz is None else sentences_npz)
    dense = sentence_embeddings(dense_model, arrays, batch_size, session_options)
    if uses_ortsparse(rewritten_model):
        _reset_metrics()
    # Kept open until the metrics are read: a node's entry leaves ortsparse.metrics() with its session.
    session = open_session(rewritten_model, session_options)
    rewritten = sentence_embeddings(rewritten_model, arrays, batch_size, session_options, session=session)
    metrics = _snapshot_metrics(rewritten_model) if uses_ortsparse(rewritten_model) else {}
    cosine = np.sum(dense * rewritten, axis=1)
    return {"kind": "embedding", "sentences": int(cosine.size), "cosine_mean": float(cosine.mean()),
            "cosine_min": float(cosine.min()), "cosine_min_index": int(cosine.argmin()), "metrics": metrics}


# --------------------------------------------------------------------------- any model

def compare_outputs(dense: Any, rewritten: Any, runs: int = 4, shapes: Any = None, *, budget: float | None = None,
                    seed: int = 0) -> dict[str, Any]:
    """Every output on ``runs`` generated input sets (``ortsparse.verify.verify_models``): per output
    the worst max abs and relative L2 error. ``budget`` None: 1e-4 when every gated layer is exact,
    else verify's default (0.5)."""
    from ..verify import DEFAULT_BUDGET, EXACT_BUDGET, parse_shape_overrides, verify_models

    if budget is None:
        exact = gated_layers_exact(rewritten)
        budget = EXACT_BUDGET if exact else DEFAULT_BUDGET
        reason = "every gated layer is exact" if exact else "approximate layers present"
    else:
        reason = "given"
    overrides = shapes if isinstance(shapes, Mapping) else parse_shape_overrides(shapes)
    result = verify_models(dense, rewritten, runs=runs, budget=budget, budget_reason=reason, shapes=overrides,
                           seed=seed)
    return {"kind": "generic", "runs": result.runs, "budget": result.budget, "budget_reason": result.budget_reason,
            "passed": result.passed, "input_shapes": {k: list(v) for k, v in result.input_shapes.items()},
            "outputs": [dataclasses.asdict(o) | {"shape": list(o.shape)} for o in result.outputs],
            "text": result.format()}


def detect_kind(model: Any) -> str:
    """``lm`` (a ``logits`` output and no KV-cache inputs), ``embedding`` (``last_hidden_state``
    output) or ``generic``."""
    graph = _proto(model).graph
    outputs = {o.name for o in graph.output}
    initializers = {i.name for i in graph.initializer}
    inputs = [i.name.lower() for i in graph.input if i.name not in initializers]
    if "logits" in outputs and not any("past" in n or "cache" in n for n in inputs):
        return "lm"
    if "last_hidden_state" in outputs:
        return "embedding"
    return "generic"


# --------------------------------------------------------------------------- data in the cache

def _cache_lookup(name: str, variant: str) -> Path | None:
    """``ortsparse.harness.models.model_path(name, variant)``, or None when that module, the
    name or the built file is missing."""
    try:
        from .models import model_path
    except ImportError:
        return None
    try:
        return Path(model_path(name, variant))
    except Exception:  # noqa: BLE001 - unknown or not built: the caller falls back to the layout
        return None


def real_model_path(name: str, file: str) -> Path:
    """Path of a real model in the cache, e.g. ``("smollm2", "full.torchscript.onnx")``: what
    ``ortsparse.harness.models.model_path`` says, else ``<cache>/models/<name>/<file>``. The file
    may not exist."""
    from .cache import models_dir

    return _cache_lookup(name, file.removesuffix(".onnx")) or models_dir() / name / file


def default_corpus() -> Path:
    """SmolLM2 token ids of the perplexity corpus (britannica-11th; the cache builder's fallback
    corpus when it had to use one)."""
    from .cache import models_dir

    return _cache_lookup("corpus", "smollm2.tokens") or models_dir() / "smollm2" / "corpus_britannica.npy"


def default_sentences() -> Path:
    from .cache import models_dir

    return _cache_lookup("minilm", "sentences") or models_dir() / "minilm" / "sentences.npz"


# --------------------------------------------------------------------------- CLI

def add_kwta_arguments(parser: argparse.ArgumentParser) -> None:
    """``--config`` and the ``--kwta-*`` flags of rewrite-onnx (``ortsparse.cli.add_kwta_arguments``)."""
    from ..cli import add_kwta_arguments as add

    add(parser)


def config_from_args(args: argparse.Namespace):
    from ..cli import config_from_args as config

    return config(args)


def versions() -> dict[str, str]:
    import platform

    import onnx
    import onnxruntime

    from .. import __version__

    return {"ortsparse": __version__, "onnxruntime": onnxruntime.__version__, "onnx": onnx.__version__,
            "numpy": np.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "cpus": str(os.cpu_count())}


def json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL.onnx", help="the dense model")
    parser.add_argument("--rewritten", metavar="OUT.onnx",
                        help="the rewritten model; without it MODEL is rewritten in memory with the flags below")
    parser.add_argument("--kind", choices=KINDS, default="auto",
                        help="lm: perplexity; embedding: sentence cosine; generic: output error on generated "
                             "inputs; auto (default): lm if there is a logits output and no KV cache, embedding "
                             "if last_hidden_state, else generic")
    lm = parser.add_argument_group("lm")
    lm.add_argument("--corpus", metavar="TOKENS.npy",
                    help="1-D token ids (default: the cache's smollm2/corpus_britannica.npy)")
    lm.add_argument("--windows", type=int, default=8, help="number of windows (default 8)")
    lm.add_argument("--window-len", type=int, default=512, help="tokens per window (default 512)")
    lm.add_argument("--offset", type=int, default=0, help="first token of the first window (default 0)")
    lm.add_argument("--max-dppl", type=float, metavar="FRAC", help="exit 1 when dppl exceeds this")
    emb = parser.add_argument_group("embedding")
    emb.add_argument("--sentences", metavar="FILE.npz",
                     help="input_ids/attention_mask[/token_type_ids] (default: the cache's minilm/sentences.npz)")
    emb.add_argument("--batch-size", type=int, default=32)
    emb.add_argument("--min-cosine", type=float, metavar="COS", help="exit 1 when the mean cosine is below this")
    gen = parser.add_argument_group("generic")
    gen.add_argument("--runs", type=int, default=4, help="generated input sets (default 4)")
    gen.add_argument("--shape", action="append", metavar="SPEC", help="dynamic dims: dim=INT or input=AxBxC")
    gen.add_argument("--budget", type=float, help="relative L2 budget (default 1e-4 if exact, else 0.5)")
    gen.add_argument("--seed", type=int, default=0)
    add_kwta_arguments(parser)
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (default: ORT's)")
    parser.add_argument("--json", metavar="FILE", help="write the result as JSON")
    parser.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors")


def _format(result: Mapping[str, Any]) -> str:
    kind = result["kind"]
    lines = []
    if kind == "lm":
        lines.append(f"perplexity: {result['windows']} windows x {result['window_len']} tokens from offset "
                     f"{result['offset']} ({result['tokens']} scored tokens)")
        lines.append(f"  {'model':10s} {'ppl':>10s} {'nll':>8s}")
        lines.append(f"  {'dense':10s} {result['ppl_dense']:10.4f} {result['nll_dense']:8.4f}")
        lines.append(f"  {'rewritten':10s} {result['ppl_rewritten']:10.4f} {result['nll_rewritten']:8.4f}")
        lines.append(f"  dppl {result['dppl']:+.4%}   top-1 agreement {result['top1_agreement']:.4f}")
    elif kind == "embedding":
        lines.append(f"embedding cosine over {result['sentences']} sentences: mean {result['cosine_mean']:.6f}  "
                     f"min {result['cosine_min']:.6f} (sentence {result['cosine_min_index']})")
    else:
        lines.append(result["text"])
    ops = (result.get("metrics") or {}).get("ops", {})
    for op, values in ops.items():
        ratio = values.get("keep_ratio")
        if ratio is not None:
            lines.append(f"  {op}: keep ratio {ratio:.4f} over {len(result['metrics'].get('nodes', {}))} node(s)")
    weighted = (result.get("metrics") or {}).get("weighted_keep_ratio")
    if weighted is not None:
        lines.append(f"  gated weight bytes read: {weighted:.4f} of the gated layers'")
    return "\n".join(lines)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from ..graph_rewrite.output_paths import check_outputs, write_text_files

    say = (lambda text: None) if args.quiet else print
    inputs = [args.model, args.rewritten, args.corpus, args.sentences, args.config]  # never overwritten
    check_outputs([(args.json, "JSON report")], inputs)  # before the long run
    if not Path(args.model).is_file():
        parser.error(f"model {args.model} does not exist")
    kind = detect_kind(args.model) if args.kind == "auto" else args.kind
    options = {"intra_op_num_threads": args.threads} if args.threads else None
    report = None
    if args.rewritten:
        if not Path(args.rewritten).is_file():
            parser.error(f"rewritten model {args.rewritten} does not exist")
        rewritten: Any = args.rewritten
    else:
        rewritten, report = rewrite_in_memory(args.model, config_from_args(args))
        say(report.summary())
    progress = not args.quiet and sys.stderr.isatty()
    code = EXIT_OK
    if kind == "lm":
        corpus = Path(args.corpus) if args.corpus else default_corpus()
        if not corpus.is_file():
            parser.error(f"token corpus {corpus} not found (give --corpus TOKENS.npy or run `ortsparse models`)")
        tokens = load_corpus_tokens(corpus)
        result = compare_lm(args.model, rewritten, tokens, args.windows, args.window_len, offset=args.offset,
                            session_options=options, progress=progress)
        result["corpus"] = str(corpus)
        if args.max_dppl is not None and result["dppl"] > args.max_dppl:
            code = EXIT_OVER_BUDGET
    elif kind == "embedding":
        sentences = Path(args.sentences) if args.sentences else default_sentences()
        if not sentences.is_file():
            parser.error(f"sentence set {sentences} not found (give --sentences FILE.npz or run `ortsparse models`)")
        result = compare_embeddings(args.model, rewritten, sentences, args.batch_size, session_options=options)
        result["sentences_file"] = str(sentences)
        if args.min_cosine is not None and result["cosine_mean"] < args.min_cosine:
            code = EXIT_OVER_BUDGET
    else:
        result = compare_outputs(args.model, rewritten, args.runs, args.shape, budget=args.budget, seed=args.seed)
        if not result["passed"]:
            code = EXIT_OVER_BUDGET
    say(_format(result))
    if args.json:
        document = {"command": "ortsparse quality " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["quality"] else None,
                    "model": str(args.model), "rewritten": args.rewritten or "in memory",
                    "rewrite": report.to_dict()["counts"] if report is not None else None,
                    "config": report.to_dict()["config"] if report is not None else None,
                    "versions": versions(), "result": {k: v for k, v in result.items() if k != "text"}}
        write_text_files({args.json: ("JSON report", json.dumps(document, indent=2, default=json_default) + "\n")}, inputs)
        say(f"wrote {args.json}")
    if code == EXIT_OVER_BUDGET:
        print("quality: over the given budget", file=sys.stderr)
    return code
