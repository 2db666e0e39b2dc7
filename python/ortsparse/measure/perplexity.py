"""Perplexity of a full-sequence LM export, and dense vs rewritten on the same windows.

The model: inputs ``input_ids``, ``attention_mask`` [, ``position_ids``], output ``logits``; a
KV-cache decoder (``past_key_values.*`` inputs: our KV exports, onnxruntime-genai graphs) is fed an
empty past, so each window is one prefill of the graph that decodes. Windows as
:func:`ortsparse.measure.corpus.lm_windows` cuts them, with the model's BOS first when its tokenizer
adds one (``bos``); each window is one sequence (batch 1, mask all ones, positions 0..L-1). Scored
are the predictions of each window's text tokens but the first (context only); with a BOS, the BOS
position's prediction is not scored (:func:`ortsparse.measure.corpus.first_scored`). ppl = exp(mean
NLL over every scored token of every window). Top-1 agreement = fraction of scored positions where
both models' argmax next token is the same. Models are paths, ``onnx.ModelProto``, serialized bytes or
a :class:`~ortsparse.measure.source.ModelSource` (opened once: its graph is not read again).

Memory: the loss is computed a block of rows at a time (:func:`score_logits`), so the float64 work
stays at ``CHUNK_BYTES`` whatever the vocabulary; only the model's own float32 logits output
(``L x vocab``) is whole. The window-to-window spread of dppl (standard error of the per-window log
ratio, over windows) comes with every comparison (:func:`compare_lm`).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from .._library import reset_metrics
from ..runtime import kv_layout, lm_feeds, open_session, uses_ortsparse
from .corpus import first_scored, lm_windows, text_per_window
from .op_metrics import snapshot
from .source import ModelSource, token_vocabulary
from .text import BosChoice, as_bos

# Float64 work per block of logits rows (a 262,144-token vocabulary: 16 rows a block).
CHUNK_BYTES = 32 << 20


def _logits_name(session: Any) -> str:
    names = [o.name for o in session.get_outputs()]
    return "logits" if "logits" in names else names[0]


def row_blocks(rows: int, vocab: int, chunk_bytes: int = CHUNK_BYTES):
    """(start, stop) of row blocks whose float64 copy of ``vocab`` columns fits ``chunk_bytes``."""
    step = max(1, chunk_bytes // (8 * max(1, vocab)))
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


def log_softmax_blocks(logits: np.ndarray, chunk_bytes: int = CHUNK_BYTES):
    """(start, stop, float64 log softmax of ``logits[start:stop]``) over row blocks of [rows, vocab]
    logits: the whole log softmax never exists at once (a block and its exp: 2 x ``chunk_bytes``)."""
    for start, stop in row_blocks(logits.shape[0], logits.shape[-1], chunk_bytes):
        block = logits[start:stop].astype(np.float64)
        block -= block.max(axis=-1, keepdims=True)
        block -= np.log(np.exp(block).sum(axis=-1, keepdims=True))
        yield start, stop, block


def score_logits(logits: np.ndarray, targets: np.ndarray,
                 chunk_bytes: int = CHUNK_BYTES) -> tuple[np.ndarray, np.ndarray]:
    """(-log softmax(logits)[target] in float64, argmax) per row of [rows, vocab] logits, a block of
    rows at a time (float64 temporaries of at most ~``chunk_bytes``)."""
    rows = logits.shape[0]
    nll = np.empty(rows, dtype=np.float64)
    top = np.empty(rows, dtype=np.int64)
    targets = np.asarray(targets)
    for start, stop in row_blocks(rows, logits.shape[-1], chunk_bytes):
        block = logits[start:stop].astype(np.float64)
        peak = block.max(axis=-1)
        block -= peak[:, None]
        np.exp(block, out=block)
        log_norm = peak + np.log(block.sum(axis=-1))
        target = logits[np.arange(start, stop), targets[start:stop]].astype(np.float64)
        nll[start:stop] = log_norm - target
        top[start:stop] = logits[start:stop].argmax(axis=-1)
        del block  # before the next block is made: one block at a time
    return nll, top


def _check_vocabulary(model: Any, batch: np.ndarray) -> None:
    vocab = model.token_vocabulary if isinstance(model, ModelSource) else token_vocabulary(model)
    if vocab is not None and int(batch.max()) >= vocab:
        raise ValueError(f"token id {int(batch.max())} is outside the model's vocabulary of {vocab}")


def perplexity(model_path_or_proto: Any, token_ids: Any, windows: int = 8, window_len: int = 512,
               session_options: Any = None, *, offset: int = 0, progress: bool = False,
               session: Any = None, bos: BosChoice | int | None = None) -> dict[str, Any]:
    """Perplexity of a full-sequence LM export on ``windows`` consecutive windows of ``window_len``
    positions (see :func:`lm_windows`; ``bos``: the token each window starts with, a
    :class:`~ortsparse.measure.text.BosChoice` or an id; None: none). Returns ``ppl``, ``nll`` (mean,
    nats), ``window_nll`` (mean per window), ``tokens`` (scored), ``windows``, ``window_len``,
    ``offset``, ``bos`` (id, token, what said so) and ``predictions`` (``[windows, scored per window]``
    argmax next-token ids, for agreement). ``session_options`` as :func:`ortsparse.runtime.open_session`."""
    bos = as_bos(bos)
    batch = lm_windows(token_ids, windows, window_len, offset, bos=bos.id)
    first = first_scored(bos.id)
    source = model_path_or_proto if isinstance(model_path_or_proto, ModelSource) else None
    session = session or open_session(source.decoder if source else model_path_or_proto, session_options)
    output = _logits_name(session)
    inputs = session.get_inputs()
    kv = source.kv_layout(session) if source else kv_layout(session, model_path_or_proto)
    _check_vocabulary(model_path_or_proto, batch)
    window_nll = np.empty(windows, dtype=np.float64)
    predictions = np.empty((windows, window_len - 1 - first), dtype=np.int32)
    for i in tqdm(range(windows), desc="perplexity", unit="window", disable=not progress, leave=False):
        (logits,) = session.run([output], lm_feeds(inputs, batch[i], kv))
        logits = np.asarray(logits)
        if logits.ndim != 3 or logits.shape[:2] != (1, window_len):
            raise ValueError(f"output {output!r} has shape {list(logits.shape)}; expected [1, {window_len}, vocab]")
        if int(batch.max()) >= logits.shape[-1]:
            raise ValueError(f"token id {int(batch.max())} is outside the model's vocabulary of {logits.shape[-1]}")
        nll, predictions[i] = score_logits(logits[0, first:-1], batch[i, first + 1:])
        window_nll[i] = float(nll.mean())
        del logits
    mean = float(window_nll.mean())  # every window scores as many tokens
    return {"ppl": math.exp(mean), "nll": mean, "window_nll": window_nll, "tokens": predictions.size,
            "windows": windows, "window_len": window_len, "offset": offset, "bos": bos.to_dict(),
            "text_per_window": text_per_window(window_len, bos.id), "predictions": predictions}


def dppl_spread(nll_dense: Any, nll_rewritten: Any) -> dict[str, Any]:
    """Window-to-window spread of dppl from per-window mean NLLs (equal token counts): ``dppl_windows``
    (each window's own ppl ratio - 1) and ``dppl_stderr``, the standard error of dppl over windows
    (the log ratio's standard error over windows times 1 + dppl; None with one window)."""
    diff = np.asarray(nll_rewritten, dtype=np.float64) - np.asarray(nll_dense, dtype=np.float64)
    stderr = None
    if diff.size > 1:
        stderr = float(math.exp(diff.mean()) * diff.std(ddof=1) / math.sqrt(diff.size))
    return {"dppl_windows": np.expm1(diff).tolist(), "dppl_stderr": stderr}


def describe_windows(result: Mapping[str, Any]) -> str:
    """One line on how the windows of a :func:`perplexity` / :func:`compare_lm` result were built."""
    bos = result.get("bos") or {}
    windows, length = result["windows"], result["window_len"]
    text = result.get("text_per_window", length)
    if bos.get("id") is not None:
        first = f"{bos['token']} (id {bos['id']})" if bos.get("token") else f"id {bos['id']}"
        start = f"BOS {first} + {text} text tokens each"
    else:
        start = "text tokens only, no BOS"
    return (f"{windows} windows x {length} positions ({start}; {bos.get('source', 'no BOS given')}), text from "
            f"token {result.get('offset', 0)}; {result['tokens']} predictions scored (not each window's first "
            f"text token{', nor the BOS position' if bos.get('id') is not None else ''})")


def describe_spread(result: Mapping[str, Any]) -> str:
    """dppl with its window-to-window spread, for reports."""
    stderr, per_window = result.get("dppl_stderr"), result.get("dppl_windows") or []
    if stderr is None:
        return f"dppl {result['dppl']:+.2%} (one window: no window-to-window spread)"
    return (f"dppl {result['dppl']:+.2%} +/- {stderr:.2%} (std error over {len(per_window)} windows; per window "
            f"{min(per_window):+.2%} .. {max(per_window):+.2%})")


def compare_lm(dense_model: Any, rewritten_model: Any, token_ids: Any, windows: int = 8, window_len: int = 512,
               *, offset: int = 0, session_options: Any = None, progress: bool = False,
               bos: BosChoice | int | None = None) -> dict[str, Any]:
    """Dense and rewritten LM on the same windows (``bos`` as :func:`perplexity`): ``ppl_dense``,
    ``ppl_rewritten``, ``dppl = ppl_rewritten / ppl_dense - 1`` with its window-to-window spread
    (:func:`dppl_spread`), ``top1_agreement`` (fraction of scored positions whose argmax next token
    agrees; also under ``agreement``), the window construction (``bos``, ``text_per_window``,
    ``window_construction``) and the rewritten run's ``metrics`` (keep ratios; counters reset just
    before it)."""
    bos = as_bos(bos)
    dense = perplexity(dense_model, token_ids, windows, window_len, session_options, offset=offset, progress=progress,
                       bos=bos)
    gated = uses_ortsparse(rewritten_model)
    if gated:
        reset_metrics()
    # Kept open until the metrics are read: a node's entry leaves ortsparse.metrics() with its session.
    session = open_session(rewritten_model, session_options)
    rewritten = perplexity(rewritten_model, token_ids, windows, window_len, session_options, offset=offset,
                           progress=progress, session=session, bos=bos)
    metrics = snapshot(rewritten_model) if gated else {}
    agreement = float(np.mean(dense["predictions"] == rewritten["predictions"]))
    result = {
        "kind": "lm", "windows": windows, "window_len": window_len, "offset": offset, "tokens": dense["tokens"],
        "bos": dense["bos"], "text_per_window": dense["text_per_window"],
        "ppl_dense": dense["ppl"], "ppl_rewritten": rewritten["ppl"],
        "nll_dense": dense["nll"], "nll_rewritten": rewritten["nll"],
        "dppl": rewritten["ppl"] / dense["ppl"] - 1.0,
        **dppl_spread(dense["window_nll"], rewritten["window_nll"]),
        "top1_agreement": agreement, "agreement": agreement,
        "metrics": metrics,
    }
    result["window_construction"] = describe_windows(result)
    return result
