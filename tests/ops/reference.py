"""Independent numpy references for the ops (test oracles; nothing here is used by the library)."""
from __future__ import annotations

import math

import numpy as np


def kwta_block_scores(x: np.ndarray, block: int, score: str, w: np.ndarray | None = None) -> np.ndarray:
    k = x.shape[-1]
    nb = math.ceil(k / block)
    out = np.empty(nb, dtype=np.float64)
    for b in range(nb):
        xb = x[b * block : min(k, (b + 1) * block)].astype(np.float64)
        if score == "mean_abs":
            out[b] = np.mean(np.abs(xb))
        else:
            out[b] = np.sqrt(np.sum(xb * xb))
            if score == "l2_weighted":
                out[b] *= np.linalg.norm(w[b * block : min(k, (b + 1) * block)].astype(np.float64))
    return out


def kwta_keep_count(k: int, block: int, k_frac: float, k_abs: int) -> int:
    nb = math.ceil(k / block)
    count = math.ceil(k_abs / block) if k_abs > 0 else math.ceil(k_frac * nb * (1 - 1e-6))
    return max(1, min(count, nb))


def kwta_kept_blocks(scores: np.ndarray, keep: int, threshold: float = 0.0) -> np.ndarray:
    """Indices (ascending) of kept blocks: top `keep` by score, ties to the lower index; with a
    threshold, the blocks scoring >= threshold unless there are more of them than `keep`."""
    if threshold > 0:
        above = np.flatnonzero(scores >= threshold)
        if len(above) <= keep:
            return above
    order = np.lexsort((np.arange(len(scores)), -scores))
    return np.sort(order[:keep])


def kwta_matmul(x, w, bias=None, *, block=1, k_frac=0.5, k_abs=0, score="l2", threshold=0.0, renorm=False):
    """Y for a gated step (duty schedule not modelled: every row gated)."""
    x2 = x.reshape(-1, x.shape[-1])
    k = x2.shape[1]
    keep = kwta_keep_count(k, block, k_frac, k_abs)
    nb = math.ceil(k / block)
    y = np.zeros((x2.shape[0], w.shape[1]), dtype=np.float64)
    kept_rows = []
    for t, row in enumerate(x2):
        blocks = kwta_kept_blocks(kwta_block_scores(row, block, score, w), keep, threshold)
        mask = np.zeros(k, dtype=bool)
        for b in blocks:
            mask[b * block : min(k, (b + 1) * block)] = True
        kept_rows.append(np.flatnonzero(mask))
        y[t] = (row * mask).astype(np.float64) @ w.astype(np.float64)
        if renorm and len(blocks):
            y[t] *= nb / len(blocks)
    if bias is not None:
        y += bias
    return y.reshape(*x.shape[:-1], w.shape[1]), kept_rows


def separated_input(rng, m: int, k: int, block: int) -> np.ndarray:
    """Rows whose block scores are far apart (no near-ties), so top-K sets are unambiguous."""
    nb = math.ceil(k / block)
    x = np.empty((m, k), dtype=np.float32)
    for t in range(m):
        levels = 1.0 + 0.25 * rng.permutation(nb)
        signs = rng.choice([-1.0, 1.0], size=k)
        x[t] = signs * np.repeat(levels, block)[:k] * (1 + 1e-3 * rng.standard_normal(k))
    return x
