"""ProcSparseMatMul's offline builder: dense W [K, N] -> procedural hash base + per output unit the
deltas of its top-`fanout` K-blocks. The loops run in C++ (``_kernels.proc_build``);
this module chunks the units, shows progress, converts deltas to fp16 if asked and accounts memory.

Format (docs/ops.md#procsparsematmul): ``indices`` uint16 [N, F] (kept block indices, ascending),
``deltas`` float32 | float16 [N, F, block] (zero-padded short last block), attributes K, N, block,
fanout, seed, base_scale. W_hat[k, n] = base(n, k) + delta for k in a kept block of unit n, else 0.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from . import _kernels

GOLDEN = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
MASK64 = (1 << 64) - 1


def splitmix64(seed: int, n: int, k: int) -> int:
    """h(seed, n, k) in pure Python integers: output number n * 2^32 + k of splitmix64 seeded with seed."""
    z = (seed + GOLDEN * (((n << 32) | k) + 1)) & MASK64
    z = ((z ^ (z >> 30)) * MIX1) & MASK64
    z = ((z ^ (z >> 27)) * MIX2) & MASK64
    return z ^ (z >> 31)


def hash_base(seed: int, base_scale: float, n: np.ndarray | int, k: np.ndarray | int) -> np.ndarray:
    """base(n, k) = fp32(base_scale * u), u = (h >> 40) * 2^-23 - 1, vectorised in numpy uint64
    (wrapping arithmetic), independent of the C++ kernels."""
    n = np.asarray(n, dtype=np.uint64)
    k = np.asarray(k, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = np.uint64(seed) + np.uint64(GOLDEN) * (((n << np.uint64(32)) | k) + np.uint64(1))
        z = (z ^ (z >> np.uint64(30))) * np.uint64(MIX1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(MIX2)
        z = z ^ (z >> np.uint64(31))
    u = (z >> np.uint64(40)).astype(np.float32) * np.float32(2.0 ** -23) - np.float32(1.0)
    return (np.float32(base_scale) * u).astype(np.float32)


@dataclasses.dataclass
class ProcSparse:
    """A built layer: the op's packed inputs, attributes and the builder's statistics."""

    indices: np.ndarray  # uint16 [N, F]
    deltas: np.ndarray   # float32 | float16 [N, F, block]
    k: int
    n: int
    block: int
    fanout: int
    seed: int
    base_scale: float
    soft_trims: int = 0
    hard_trims: int = 0

    @property
    def packed_bytes(self) -> int:
        return self.indices.nbytes + self.deltas.nbytes

    @property
    def mem_ratio(self) -> float:
        """Packed bytes / dense fp32 bytes (what proc.mem_ratio reports)."""
        return self.packed_bytes / (self.k * self.n * 4)

    def attributes(self) -> dict[str, Any]:
        return {"K": self.k, "N": self.n, "block": self.block, "fanout": self.fanout, "seed": self.seed,
                "base_scale": float(self.base_scale)}

    def stats(self) -> dict[str, Any]:
        return {"mem_ratio": self.mem_ratio, "packed_bytes": self.packed_bytes, "soft_trims": self.soft_trims,
                "hard_trims": self.hard_trims, "fanout": self.fanout,
                "blocks": math.ceil(self.k / self.block), "delta_dtype": str(self.deltas.dtype)}


def num_blocks(k: int, block: int) -> int:
    return math.ceil(k / block)


def fanout_for(k: int, block: int, fanout: int | float) -> int:
    """An int fanout is a block count (clamped to [1, blocks]); a float in (0, 1] a fraction (ceil)."""
    nb = num_blocks(k, block)
    if isinstance(fanout, float):
        if not 0.0 < fanout <= 1.0:
            raise ValueError(f"fanout fraction {fanout} must be in (0, 1]")
        return max(1, min(nb, math.ceil(fanout * nb - 1e-9)))
    if fanout < 1:
        raise ValueError(f"fanout={fanout} must be >= 1")
    return min(int(fanout), nb)


def build_proc_sparse(w: np.ndarray, *, block: int = 32, fanout: int | float = 64, base_scale: float = 0.0,
                      seed: int = 0, shed_eps: float = 0.0, watermark: int = 0, delta_dtype: str = "float16",
                      importance: np.ndarray | None = None, progress: bool | str = False,
                      chunk_units: int = 256) -> ProcSparse:
    """Builds the packed layer for W [K, N].

    fanout: blocks kept per output unit (int) or a fraction of the blocks (float).
    importance: optional per-block weight of the selection score (score = ||W_b - base_b|| *
    importance_b), e.g. E||x_b|| from calibration activations (Wanda-style); None = the deltas' own norm.
    delta_dtype: "float16" (half the bytes; the conversion rounds to nearest) or "float32".
    progress: show a tqdm bar over units (a string is used as its label).
    """
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"W must be 2-D [K, N], got shape {w.shape}")
    k, n = w.shape
    if not 1 <= block <= k:
        raise ValueError(f"block={block} must be in [1, K={k}]")
    if not 0 <= seed < 2 ** 63:
        raise ValueError(f"seed={seed} must be in [0, 2^63) (it is stored as an int64 attribute)")
    if delta_dtype not in ("float16", "float32"):
        raise ValueError(f"delta_dtype={delta_dtype!r} must be float16 or float32")
    f = fanout_for(k, block, fanout)
    wt = np.ascontiguousarray(w.T)
    imp = None if importance is None else np.ascontiguousarray(importance, dtype=np.float32)
    indices = np.empty((n, f), dtype=np.uint16)
    deltas = np.empty((n, f, block), dtype=np.float16 if delta_dtype == "float16" else np.float32)
    soft = hard = 0
    bar = None
    if progress:
        bar = tqdm(total=n, desc=progress if isinstance(progress, str) else "proc build", unit="unit", leave=False)
    for n0 in range(0, n, chunk_units):
        n1 = min(n, n0 + chunk_units)
        idx, d, s, h = _kernels.proc_build(wt[n0:n1], n0, block, f, float(base_scale), int(seed), float(shed_eps),
                                           int(watermark), imp)
        indices[n0:n1] = idx
        deltas[n0:n1] = d  # fp16: round to nearest even, as F16C does
        soft += s
        hard += h
        if bar is not None:
            bar.update(n1 - n0)
    if bar is not None:
        bar.close()
    return ProcSparse(indices, deltas, k, n, block, f, int(seed), float(base_scale), soft, hard)


def reconstruct(p: ProcSparse) -> np.ndarray:
    """The W [K, N] the op computes with (numpy; an oracle independent of the C++ kernels)."""
    w = np.zeros((p.k, p.n), dtype=np.float32)
    rows = np.arange(p.block)
    for j in range(p.n):
        for f, b in enumerate(p.indices[j].astype(np.int64)):
            r = b * p.block + rows
            r = r[r < p.k]
            d = p.deltas[j, f, : len(r)].astype(np.float32)
            base = hash_base(p.seed, p.base_scale, j, r) if p.base_scale != 0 else np.float32(0)
            w[r, j] = base + d
    return w


def block_importance(x: np.ndarray, block: int) -> np.ndarray:
    """E||x_b|| over calibration rows x [..., K] (the activation side of the Wanda-style score)."""
    x2 = np.asarray(x, dtype=np.float64).reshape(-1, x.shape[-1])
    k = x2.shape[1]
    nb = num_blocks(k, block)
    pad = np.zeros((x2.shape[0], nb * block - k))
    sq = np.concatenate([x2 * x2, pad], axis=1).reshape(x2.shape[0], nb, block).sum(axis=2)
    return np.sqrt(sq).mean(axis=0).astype(np.float32)
