"""Perplexity of a full-sequence LM export, and dense vs rewritten on the same windows.

The model: inputs ``input_ids``, ``attention_mask`` [, ``position_ids``], output ``logits``; a
KV-cache decoder (``past_key_values.*`` inputs: our KV exports, onnxruntime-genai graphs) is fed an
empty past, so each window is one prefill of the graph that decodes. Windows as :func:`ortsparse.harness.corpus.lm_windows` cuts them;
each window is one sequence (batch 1, mask all ones, positions 0..L-1) and its L-1 next-token
predictions are scored (the first token of a window is context only). ppl = exp(mean NLL over
every scored token of every window). Top-1 agreement = fraction of scored positions where both
models' argmax next token is the same. Models are paths, ``onnx.ModelProto`` or serialized bytes.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from .._library import reset_metrics
from ..runtime import kv_layout, lm_feeds, open_session, uses_ortsparse
from ..verify import _embedding_sizes
from .corpus import lm_windows
from .op_metrics import snapshot


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
    ``windows``, ``window_len``, ``offset``, ``predictions`` (``[windows, window_len-1]`` argmax
    next-token ids, for agreement) and ``window_nll`` (mean NLL of each window). ``session_options`` as :func:`ortsparse.runtime.open_session`."""
    batch = lm_windows(token_ids, windows, window_len, offset)
    session = session or open_session(model_path_or_proto, session_options)
    output = _logits_name(session)
    inputs = session.get_inputs()
    kv = kv_layout(session, model_path_or_proto)
    _check_vocabulary(model_path_or_proto, batch)
    total_nll, count = 0.0, 0
    predictions = np.empty((windows, window_len - 1), dtype=np.int32)
    window_nll = np.empty(windows)
    for i in tqdm(range(windows), desc="perplexity", unit="window", disable=not progress, leave=False):
        (logits,) = session.run([output], lm_feeds(inputs, batch[i], kv))
        logits = np.asarray(logits)
        if logits.ndim != 3 or logits.shape[:2] != (1, window_len):
            raise ValueError(f"output {output!r} has shape {list(logits.shape)}; expected [1, {window_len}, vocab]")
        if int(batch.max()) >= logits.shape[-1]:
            raise ValueError(f"token id {int(batch.max())} is outside the model's vocabulary of {logits.shape[-1]}")
        step = logits[0, :-1]
        nll = _log_softmax_nll(step, batch[i, 1:])
        total_nll += float(nll.sum())
        count += nll.size
        window_nll[i] = float(nll.mean())
        predictions[i] = step.argmax(axis=-1)
    mean = total_nll / count
    return {"ppl": math.exp(mean), "nll": mean, "tokens": count, "windows": windows, "window_len": window_len,
            "offset": offset, "predictions": predictions, "window_nll": window_nll}


def compare_lm(dense_model: Any, rewritten_model: Any, token_ids: Any, windows: int = 8, window_len: int = 512,
               *, offset: int = 0, session_options: Any = None, progress: bool = False) -> dict[str, Any]:
    """Dense and rewritten LM on the same windows: ``ppl_dense``, ``ppl_rewritten``,
    ``dppl = ppl_rewritten / ppl_dense - 1``, ``top1_agreement`` (fraction of scored positions whose
    argmax next token agrees; also under ``agreement``) and the
    rewritten run's ``metrics`` (keep ratios; counters reset just before it)."""
    dense = perplexity(dense_model, token_ids, windows, window_len, session_options, offset=offset, progress=progress)
    gated = uses_ortsparse(rewritten_model)
    if gated:
        reset_metrics()
    # Kept open until the metrics are read: a node's entry leaves ortsparse.metrics() with its session.
    session = open_session(rewritten_model, session_options)
    rewritten = perplexity(rewritten_model, token_ids, windows, window_len, session_options, offset=offset,
                           progress=progress, session=session)
    metrics = snapshot(rewritten_model) if gated else {}
    agreement = float(np.mean(dense["predictions"] == rewritten["predictions"]))
    return {
        "kind": "lm", "windows": windows, "window_len": window_len, "offset": offset, "tokens": dense["tokens"],
        "ppl_dense": dense["ppl"], "ppl_rewritten": rewritten["ppl"],
        "nll_dense": dense["nll"], "nll_rewritten": rewritten["nll"],
        "dppl": rewritten["ppl"] / dense["ppl"] - 1.0, "top1_agreement": agreement, "agreement": agreement,
        "metrics": metrics,
    }
