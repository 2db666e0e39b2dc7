"""Sentence embeddings as sentence-transformers' all-MiniLM-L6-v2 makes them (mean of the last
hidden state over ``attention_mask``, then L2 normalisation), and the cosine between the dense and
the rewritten embedding of every sentence (mean and minimum)."""
from __future__ import annotations

from typing import Any

import numpy as np

from .._library import reset_metrics
from ..runtime import named_feeds, open_session, uses_ortsparse
from .corpus import default_sentences, load_sentences, sentence_batches
from .op_metrics import snapshot


def mean_pool(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """``[n, d]`` float64: the mean of ``hidden`` [n, S, d] over the positions where ``mask`` [n, S]
    is set, L2-normalised."""
    weights = mask.astype(np.float64)[:, :, None]
    pooled = (np.asarray(hidden, dtype=np.float64) * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1e-9)
    return pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)


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
    session = session or open_session(model, session_options)
    output = _hidden_name(session)
    inputs = session.get_inputs()
    result = []
    for part in sentence_batches(load_sentences(sentences), batch_size):
        (hidden,) = session.run([output], named_feeds(inputs, part))
        result.append(mean_pool(hidden, part["attention_mask"]))
    return np.concatenate(result, axis=0)


def compare_embeddings(dense_model: Any, rewritten_model: Any, sentences_npz: Any = None, batch_size: int = 32,
                       *, session_options: Any = None) -> dict[str, Any]:
    """Cosine between the dense and rewritten sentence embedding of every sentence: ``cosine_mean``,
    ``cosine_min`` (and which sentence), plus the rewritten run's ``metrics``. ``sentences_npz``:
    a path or mapping (:func:`ortsparse.measure.corpus.load_sentences`); None = the cache's MiniLM
    sentence set."""
    arrays = load_sentences(default_sentences() if sentences_npz is None else sentences_npz)
    dense = sentence_embeddings(dense_model, arrays, batch_size, session_options)
    gated = uses_ortsparse(rewritten_model)
    if gated:
        reset_metrics()
    # Kept open until the metrics are read: a node's entry leaves ortsparse.metrics() with its session.
    session = open_session(rewritten_model, session_options)
    rewritten = sentence_embeddings(rewritten_model, arrays, batch_size, session_options, session=session)
    metrics = snapshot(rewritten_model) if gated else {}
    cosine = np.sum(dense * rewritten, axis=1)
    return {"kind": "embedding", "sentences": int(cosine.size), "cosine_mean": float(cosine.mean()),
            "cosine_min": float(cosine.min()), "cosine_min_index": int(cosine.argmin()), "metrics": metrics}
