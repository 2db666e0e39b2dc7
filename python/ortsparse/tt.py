"""Tensor-train (TT-matrix) factorisation of linear-layer weights for ``TTMatMul`` (offline builder).

W [K, N] is written as a TT-matrix with K = prod k_t, N = prod n_t and cores G_t [r_{t-1}, k_t, n_t, r_t]
(r_0 = r_d = 1):  W[(i_1..i_d), (j_1..j_d)] = G_1[:, i_1, j_1, :] ... G_d[:, i_d, j_d, :], multi-indices
row-major (i_1 most significant). Equivalently, the "reshuffled" tensor T[(i_1 j_1), ..., (i_d j_d)]
has TT ranks r_t. d = 2 with in_modes [K, 1], out_modes [1, N] is the plain low-rank product W = U V
(the ``lowrank`` layout); d >= 3 splits K and N into balanced modes (``choose_modes``).

Builders (float64 numpy/scipy; no Python on the inference path):

- :func:`tt_svd`: TT-SVD (sequential truncated SVDs of the reshuffled tensor), by max rank or by a
  relative Frobenius tolerance.
- :func:`tt_cross_maxvol`: TT-cross (alternating left/right sweeps of fibre QR + maxvol row choice)
  with ``rank + maxvol_k`` fibres per interface, then TT-rounding to ``rank``. It reads
  O(d (rank + maxvol_k)^2 max k_t n_t) entries per sweep instead of the whole matrix: for large W.
- :func:`lowrank_whitened`: activation-aware low-rank (SVD-LLM): SVD of L^T W with C = X^T X = L L^T,
  so the truncation minimises ||X (W - W_r)||_F on the calibration inputs instead of ||W - W_r||_F.

:func:`gap` is the activation-aware error the autotuner budgets: ||X W - X W_tt||_F / ||X W + b||_F on
calibration inputs X. :func:`autotune` finds per layer the smallest rank whose gap <= tolerance among
the ranks that still have a speed benefit (FLOP ratio >= ``min_flop_ratio``); otherwise the layer
stays dense and the result says why.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from tqdm import tqdm

from .runtime import captured_values, lm_feeds

LAYOUTS = ("lowrank", "balanced")
METHODS = ("svd", "svd-whitened", "cross")
# The TT kernel's target is >= 0.7 x the FLOP ratio (bench/bench_tt.py); below ~1.5x fewer FLOPs a
# layer would not get faster, so ranks above that bound are not "a speed benefit".
DEFAULT_MIN_FLOP_RATIO = 1.5


# --------------------------------------------------------------------------------------- modes


def factorize(value: int, d: int) -> list[int]:
    """``value`` as a product of ``d`` factors as equal as the primes allow (descending; 1s pad)."""
    if value < 1 or d < 1:
        raise ValueError(f"cannot split {value} into {d} modes")
    primes, v, p = [], value, 2
    while p * p <= v:
        while v % p == 0:
            primes.append(p)
            v //= p
        p += 1
    if v > 1:
        primes.append(v)
    buckets = [1] * d
    for prime in sorted(primes, reverse=True):  # largest first into the smallest bucket (LPT)
        buckets[int(np.argmin(buckets))] *= prime
    return sorted(buckets, reverse=True)


def choose_modes(k: int, n: int, d: int = 2, layout: str = "lowrank") -> tuple[list[int], list[int]]:
    """Mode factorisation of K and N for a d-core TT-matrix.

    ``lowrank`` (d = 2 only): in_modes [K, 1], out_modes [1, N] -- the plain low-rank split W = U V,
    the most accurate per parameter on trained weights (their row space carries no Kronecker
    structure for balanced modes to exploit). ``balanced``: K and N each split into d near-equal
    factors (descending), paired in order, so every core has a similar k_t n_t and the middle ranks
    stay affordable; a prime K or N gets modes of 1, which the cores handle.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} must be one of {LAYOUTS}")
    if layout == "lowrank":
        if d != 2:
            raise ValueError("the lowrank layout has d = 2")
        return [k, 1], [1, n]
    return factorize(k, d), factorize(n, d)


def _check_modes(w_shape: tuple[int, int], in_modes: Sequence[int], out_modes: Sequence[int]) -> None:
    if len(in_modes) != len(out_modes) or not in_modes:
        raise ValueError(f"in_modes {list(in_modes)} and out_modes {list(out_modes)} need the same length >= 1")
    if math.prod(in_modes) != w_shape[0] or math.prod(out_modes) != w_shape[1]:
        raise ValueError(f"modes {list(in_modes)} x {list(out_modes)} do not multiply to W's shape {w_shape}")


# --------------------------------------------------------------------------------------- TT algebra


def reshuffle(w: np.ndarray, in_modes: Sequence[int], out_modes: Sequence[int]) -> np.ndarray:
    """W [K, N] -> T [k_1 n_1, ..., k_d n_d] (the tensor whose TT ranks are the TT-matrix ranks)."""
    _check_modes(w.shape, in_modes, out_modes)
    d = len(in_modes)
    t = w.reshape(*in_modes, *out_modes)
    order = [axis for pair in zip(range(d), range(d, 2 * d)) for axis in pair]
    return t.transpose(order).reshape([a * b for a, b in zip(in_modes, out_modes)])


def tt_full(cores: Sequence[np.ndarray]) -> np.ndarray:
    """The dense W [K, N] of TT-matrix cores G_t [r_{t-1}, k_t, n_t, r_t] (an independent oracle:
    it does not share the op's contraction order or layouts)."""
    res = np.ones((1, 1, 1), dtype=np.float64)  # [K so far, N so far, r]
    for g in cores:
        g = np.asarray(g, dtype=np.float64)
        kp, np_, _ = res.shape
        res = np.einsum("xyr,rkns->xkyns", res, g).reshape(kp * g.shape[1], np_ * g.shape[2], g.shape[3])
    return res[:, :, 0]


def tt_ranks(cores: Sequence[np.ndarray]) -> list[int]:
    return [int(cores[0].shape[0])] + [int(g.shape[3]) for g in cores]


def tt_modes(cores: Sequence[np.ndarray]) -> tuple[list[int], list[int]]:
    return [int(g.shape[1]) for g in cores], [int(g.shape[2]) for g in cores]


def concat_cores(cores: Sequence[np.ndarray]) -> np.ndarray:
    """The ``cores`` input of TTMatMul: every core row-major [r_{t-1}, k_t, n_t, r_t], concatenated."""
    return np.concatenate([np.ascontiguousarray(g, dtype=np.float32).reshape(-1) for g in cores])


def split_cores(concatenated: np.ndarray, in_modes: Sequence[int], out_modes: Sequence[int],
                ranks: Sequence[int]) -> list[np.ndarray]:
    """The cores back out of :func:`concat_cores`' one array, by the modes and ranks."""
    cores, pos = [], 0
    for t, (k, n) in enumerate(zip(in_modes, out_modes)):
        size = ranks[t] * k * n * ranks[t + 1]
        cores.append(np.asarray(concatenated[pos:pos + size]).reshape(ranks[t], k, n, ranks[t + 1]))
        pos += size
    if pos != len(concatenated):
        raise ValueError(f"the concatenated cores hold {len(concatenated)} floats, the modes and ranks need {pos}")
    return cores


def order_macs(in_modes: Sequence[int], out_modes: Sequence[int], ranks: Sequence[int], right_to_left: bool) -> int:
    """Multiply-adds per token of the op's contraction in one order (mirrors TTBackend::order_macs)."""
    d = len(in_modes)
    total = 0
    for t in range(d):
        pf = math.prod(in_modes[:t]) if right_to_left else math.prod(out_modes[:t])
        q = math.prod(out_modes[t + 1:]) if right_to_left else math.prod(in_modes[t + 1:])
        total += pf * q * ranks[t] * in_modes[t] * out_modes[t] * ranks[t + 1]
    return total


def tt_macs(in_modes: Sequence[int], out_modes: Sequence[int], ranks: Sequence[int]) -> int:
    """Multiply-adds per token of the cheaper order (the one the op picks)."""
    return min(order_macs(in_modes, out_modes, ranks, False), order_macs(in_modes, out_modes, ranks, True))


def _truncation_rank(s: np.ndarray, max_rank: int | None, delta: float) -> int:
    """Smallest r with sum(s[r:]^2) <= delta^2, capped at max_rank, at least 1."""
    tail = np.sqrt(np.cumsum((s ** 2)[::-1]))[::-1]  # tail[r] = ||s[r:]||
    r = int(np.sum(tail > delta)) if delta > 0 else len(s)
    if max_rank is not None:
        r = min(r, int(max_rank))
    return max(1, min(r, len(s)))


def tt_svd(w: np.ndarray, in_modes: Sequence[int], out_modes: Sequence[int], max_rank: int | None = None,
           eps: float = 0.0) -> list[np.ndarray]:
    """TT-SVD: left-to-right truncated SVDs of the reshuffled tensor. Ranks capped by ``max_rank``
    and/or cut where the relative Frobenius error budget ``eps`` (split evenly over the d-1 cuts)
    allows. Exact (to float64 rounding) when the caps are at least the true TT ranks."""
    in_modes, out_modes = list(in_modes), list(out_modes)
    t = reshuffle(np.asarray(w, dtype=np.float64), in_modes, out_modes)
    d = len(in_modes)
    delta = eps * np.linalg.norm(t) / math.sqrt(max(1, d - 1))
    cores, r_prev, c = [], 1, t
    for i in range(d - 1):
        c = c.reshape(r_prev * in_modes[i] * out_modes[i], -1)
        u, s, vt = np.linalg.svd(c, full_matrices=False)
        r = _truncation_rank(s, max_rank, delta)
        cores.append(u[:, :r].reshape(r_prev, in_modes[i], out_modes[i], r))
        c = s[:r, None] * vt[:r]
        r_prev = r
    cores.append(c.reshape(r_prev, in_modes[-1], out_modes[-1], 1))
    return cores


def tt_round(cores: Sequence[np.ndarray], max_rank: int | None = None, eps: float = 0.0) -> list[np.ndarray]:
    """TT-rounding: right-to-left QR orthogonalisation, then left-to-right truncated SVDs."""
    cores = [np.asarray(g, dtype=np.float64).copy() for g in cores]
    d = len(cores)
    for i in range(d - 1, 0, -1):  # right-orthogonalise cores 1..d-1
        r0, k, n, r1 = cores[i].shape
        q, rr = np.linalg.qr(cores[i].reshape(r0, k * n * r1).T)
        cores[i] = q.T.reshape(-1, k, n, r1)
        cores[i - 1] = np.einsum("aknr,rs->akns", cores[i - 1], rr.T)
    norm = np.linalg.norm(cores[0])
    delta = eps * norm / math.sqrt(max(1, d - 1))
    for i in range(d - 1):
        r0, k, n, r1 = cores[i].shape
        u, s, vt = np.linalg.svd(cores[i].reshape(r0 * k * n, r1), full_matrices=False)
        r = _truncation_rank(s, max_rank, delta)
        cores[i] = u[:, :r].reshape(r0, k, n, r)
        cores[i + 1] = np.einsum("rs,sknt->rknt", s[:r, None] * vt[:r], cores[i + 1])
    return cores


# --------------------------------------------------------------------------------------- TT-cross


def maxvol(a: np.ndarray, tol: float = 1.05, max_iters: int = 200) -> np.ndarray:
    """Rows of a tall a [n, r] (n >= r, full column rank) spanning a sub-matrix of locally maximal
    |det| (Goreinov-Tyrtyshnikov maxvol): every row of a @ inv(a[rows]) has entries <= tol."""
    import scipy.linalg  # ~0.3 s to import; only factorising needs it, not every rewrite

    n, r = a.shape
    if n < r:
        raise ValueError(f"maxvol needs at least as many rows as columns, got {a.shape}")
    if n == r:
        return np.arange(n)
    _, _, piv = scipy.linalg.qr(a.T, mode="economic", pivoting=True)  # greedy start
    rows = np.array(piv[:r])
    b = scipy.linalg.solve(a[rows].T, a.T).T  # a @ inv(a[rows])
    for _ in range(max_iters):
        i, j = np.unravel_index(np.argmax(np.abs(b)), b.shape)
        if abs(b[i, j]) <= tol:
            break
        rows[j] = i
        col = b[:, j].copy()
        row = b[i, :].copy()
        row[j] -= 1.0
        b -= np.outer(col, row / b[i, j])
    return rows


def _entries(w: np.ndarray, idx: np.ndarray, in_modes: Sequence[int], out_modes: Sequence[int]) -> np.ndarray:
    """T[idx] for multi-indices idx [..., d] of the reshuffled tensor, read from W directly."""
    n_arr = np.asarray(out_modes)
    i_part, j_part = idx // n_arr, idx % n_arr
    rows = np.ravel_multi_index(tuple(np.moveaxis(i_part, -1, 0)), tuple(in_modes))
    cols = np.ravel_multi_index(tuple(np.moveaxis(j_part, -1, 0)), tuple(out_modes))
    return w[rows, cols]


def tt_cross_maxvol(w: np.ndarray, in_modes: Sequence[int], out_modes: Sequence[int], rank: int,
                    maxvol_k: int = 8, sweeps: int = 3, seed: int = 0) -> list[np.ndarray]:
    """TT-cross with maxvol: index sets of size R = rank + maxvol_k per interface (the oversampled
    fibres the cross reads), alternating left-to-right / right-to-left sweeps that QR each fibre
    matrix and pick its R interpolation rows by maxvol, then TT-rounding down to ``rank``.
    Exact on matrices of TT rank <= rank (generic fibres); reads only the fibres, not all of W."""
    in_modes, out_modes = list(in_modes), list(out_modes)
    _check_modes(w.shape, in_modes, out_modes)
    w = np.asarray(w, dtype=np.float64)
    d = len(in_modes)
    m = [k * n for k, n in zip(in_modes, out_modes)]
    if d == 1:
        return [w.reshape(1, in_modes[0], out_modes[0], 1).copy()]
    rng = np.random.default_rng(seed)
    want = rank + max(0, maxvol_k)
    caps = [min(want, math.prod(m[:t + 1]), math.prod(m[t + 1:])) for t in range(d - 1)]
    for t in range(1, d - 1):  # R_t <= R_{t-1} m_t keeps every fibre matrix tall
        caps[t] = min(caps[t], caps[t - 1] * m[t])
    for t in range(d - 3, -1, -1):
        caps[t] = min(caps[t], caps[t + 1] * m[t + 1])
    # right index sets J[t]: multi-indices of modes t+1..d-1, shape [R_t, d-t-1] (random start)
    right: list[np.ndarray] = []
    for t in range(d - 1):
        flat = rng.choice(math.prod(m[t + 1:]), size=caps[t], replace=False)
        right.append(np.stack(np.unravel_index(flat, m[t + 1:]), axis=-1))
    left: list[np.ndarray] = [np.zeros((1, 0), dtype=np.int64)] * (d - 1)

    def fibre(t: int, lset: np.ndarray, rset: np.ndarray) -> np.ndarray:
        """T[lset, :, rset] as [len(lset), m_t, len(rset)]."""
        a, b = len(lset), len(rset)
        idx = np.concatenate([
            np.broadcast_to(lset[:, None, None, :], (a, m[t], b, lset.shape[1])),
            np.broadcast_to(np.arange(m[t])[None, :, None, None], (a, m[t], b, 1)),
            np.broadcast_to(rset[None, None, :, :], (a, m[t], b, rset.shape[1]))], axis=-1)
        return _entries(w, idx, in_modes, out_modes)

    empty = np.zeros((1, 0), dtype=np.int64)
    cores: list[np.ndarray] = []
    for sweep in range(max(1, sweeps)):
        cores = []
        lset = empty
        for t in range(d - 1):  # left to right: new left sets
            f = fibre(t, lset, right[t]).reshape(len(lset) * m[t], -1)
            q, _ = np.linalg.qr(f)
            rows = maxvol(q)
            cores.append((q @ np.linalg.inv(q[rows])).reshape(len(lset), m[t], len(rows)))
            lset = np.concatenate([lset[rows // m[t]], (rows % m[t])[:, None]], axis=1)
            left[t] = lset
        cores.append(fibre(d - 1, lset, empty).reshape(len(lset), m[d - 1], 1))
        if sweep + 1 == max(1, sweeps):
            break
        rset = empty
        for t in range(d - 1, 0, -1):  # right to left: new right sets
            lprev = left[t - 1]
            f = fibre(t, lprev, rset).reshape(len(lprev), m[t] * len(rset)).T
            q, _ = np.linalg.qr(f)
            cols = maxvol(q)
            rset = np.concatenate([(cols // len(rset))[:, None], rset[cols % len(rset)]], axis=1)
            right[t - 1] = rset
    shaped = [g.reshape(g.shape[0], in_modes[t], out_modes[t], g.shape[2]) for t, g in enumerate(cores)]
    return tt_round(shaped, max_rank=rank)


# --------------------------------------------------------------------------------------- activation-aware


def input_covariance(x: np.ndarray, damp: float = 1e-6) -> np.ndarray:
    """C = X^T X / rows + damp * mean(diag) * I (float64), the calibration second moment."""
    x = np.asarray(x, dtype=np.float64).reshape(-1, np.shape(x)[-1])
    c = x.T @ x / max(1, len(x))
    c[np.diag_indices_from(c)] += damp * max(float(np.mean(np.diag(c))), 1e-30)
    return c


class WhitenedSVD:
    """SVD of L^T W (C = L L^T, Cholesky of the input covariance): rank-r truncations of it are the
    best rank-r W_r in ||X (W - W_r)||_F (SVD-LLM). One decomposition serves every rank."""

    def __init__(self, w: np.ndarray, x: np.ndarray | None = None, cov: np.ndarray | None = None):
        import scipy.linalg  # ~0.3 s to import; only factorising needs it, not every rewrite

        w = np.asarray(w, dtype=np.float64)
        if cov is None:
            cov = input_covariance(x) if x is not None else np.eye(w.shape[0])
        self.l = np.linalg.cholesky(cov)
        self.u, self.s, self.vt = np.linalg.svd(self.l.T @ w, full_matrices=False)
        # left factors in input space: L^{-T} U
        self.left = scipy.linalg.solve_triangular(self.l.T, self.u, lower=False)
        self.k, self.n = w.shape

    def cores(self, rank: int) -> list[np.ndarray]:
        r = max(1, min(rank, len(self.s)))
        # Split sqrt(s) between the cores: both factors of similar magnitude (fp32 friendly).
        root = np.sqrt(self.s[:r])
        u = self.left[:, :r] * root
        v = root[:, None] * self.vt[:r]
        return [u.reshape(1, self.k, 1, r), v.reshape(r, 1, self.n, 1)]


_WHITENED_CACHE: dict[tuple[str, str], WhitenedSVD] | None = None


def enable_factor_cache(enabled: bool = True) -> None:
    """Keep every WhitenedSVD computed by :func:`whitened_svd` (keyed by the bytes of W and X) for
    the rest of the process: sweeps that rebuild the same layers at many ranks pay each SVD once.
    ~10 MB per 576 x 1536 layer; off by default."""
    global _WHITENED_CACHE
    _WHITENED_CACHE = {} if enabled else None


def whitened_svd(w: np.ndarray, x: np.ndarray) -> WhitenedSVD:
    if _WHITENED_CACHE is None:
        return WhitenedSVD(w, x)
    key = (hashlib.sha1(np.ascontiguousarray(w).tobytes()).hexdigest(),
           hashlib.sha1(np.ascontiguousarray(x).tobytes()).hexdigest())
    if key not in _WHITENED_CACHE:
        _WHITENED_CACHE[key] = WhitenedSVD(w, x)
    return _WHITENED_CACHE[key]


def lowrank_whitened(w: np.ndarray, x: np.ndarray, rank: int) -> list[np.ndarray]:
    return WhitenedSVD(w, x).cores(rank)


def lowrank_svd(w: np.ndarray, rank: int) -> list[np.ndarray]:
    """Plain truncated SVD as lowrank-layout cores (sqrt(s) split between the factors)."""
    u, s, vt = np.linalg.svd(np.asarray(w, dtype=np.float64), full_matrices=False)
    r = max(1, min(rank, len(s)))
    root = np.sqrt(s[:r])
    return [(u[:, :r] * root).reshape(1, w.shape[0], 1, r), (root[:, None] * vt[:r]).reshape(r, 1, w.shape[1], 1)]


def _is_lowrank(cores: Sequence[np.ndarray]) -> bool:
    return len(cores) == 2 and cores[0].shape[2] == 1 and cores[1].shape[1] == 1


def gap(w: np.ndarray, approx: np.ndarray | Sequence[np.ndarray], x: np.ndarray, bias: np.ndarray | None = None) -> float:
    """Relative output error on calibration inputs: ||X W - X W~||_F / ||X W + b||_F (the bias cancels
    in the difference and only sets the scale). ``approx``: W~ [K, N] or TT cores."""
    w = np.asarray(w, dtype=np.float64)
    x = np.asarray(x, dtype=np.float64).reshape(-1, w.shape[0])
    ref = x @ w
    if not (isinstance(approx, np.ndarray) and approx.ndim == 2) and _is_lowrank(approx):
        u = np.asarray(approx[0], dtype=np.float64).reshape(w.shape[0], -1)
        v = np.asarray(approx[1], dtype=np.float64).reshape(-1, w.shape[1])
        out = (x @ u) @ v  # S (K + N) r instead of S K N
    else:
        out = x @ (approx if isinstance(approx, np.ndarray) and approx.ndim == 2 else tt_full(approx))
    denom = np.linalg.norm(ref + (0 if bias is None else np.asarray(bias, dtype=np.float64)))
    return float(np.linalg.norm(ref - out) / max(denom, 1e-30))


def split_calibration(x: np.ndarray, min_rows: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """(fit, held): alternate rows. Whitening is fitted on ``fit`` and the gap measured on ``held``,
    so a rank cannot pass by fitting the calibration rows themselves (with S rows, rank >= S
    reproduces them exactly). Fewer than 2 * min_rows rows: both are all of X."""
    x = np.asarray(x).reshape(-1, np.shape(x)[-1])
    if len(x) < 2 * min_rows:
        return x, x
    return x[0::2], x[1::2]


def weight_error(w: np.ndarray, cores: Sequence[np.ndarray]) -> float:
    """||W - W~||_F / ||W||_F (the activation-blind error, for comparison)."""
    w = np.asarray(w, dtype=np.float64)
    return float(np.linalg.norm(w - tt_full(cores)) / max(np.linalg.norm(w), 1e-30))


# --------------------------------------------------------------------------------------- autotune


@dataclasses.dataclass
class TTLayerResult:
    """Outcome of :func:`autotune` (or a fixed-rank build) for one layer: the per-layer metadata."""

    name: str
    decision: str  # "tt" | "dense"
    reason: str
    k: int
    n: int
    in_modes: list[int]
    out_modes: list[int]
    ranks: list[int]
    method: str
    gap: float  # on the calibration inputs (nan if none were given)
    flop_ratio: float  # dense MACs / TT MACs per token
    mem_ratio: float  # TT core floats / (K * N)
    cores: list[np.ndarray] | None = None
    tried: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    @property
    def rank(self) -> int:
        return max(self.ranks) if self.ranks else 0

    def metadata(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "cores"}
        out["rank"] = self.rank
        return out


def uniform_ranks(d: int, rank: int, in_modes: Sequence[int], out_modes: Sequence[int]) -> list[int]:
    """[1, r, ..., r, 1] capped by what the modes allow at each interface."""
    m = [a * b for a, b in zip(in_modes, out_modes)]
    return [1] + [min(rank, math.prod(m[:t + 1]), math.prod(m[t + 1:])) for t in range(d - 1)] + [1]


def factor(w: np.ndarray, in_modes: Sequence[int], out_modes: Sequence[int], rank: int, method: str = "svd",
           x: np.ndarray | None = None, maxvol_k: int = 8, whitened: WhitenedSVD | None = None) -> list[np.ndarray]:
    """Cores of W at a max rank by one method. ``svd-whitened`` needs the lowrank layout and X."""
    if method not in METHODS:
        raise ValueError(f"method {method!r} must be one of {METHODS}")
    lowrank = len(in_modes) == 2 and list(in_modes) == [w.shape[0], 1] and list(out_modes) == [1, w.shape[1]]
    if method == "svd-whitened":
        if not lowrank:
            raise ValueError("svd-whitened (activation-aware) works on the lowrank layout only: a whitening "
                             "transform of the rows does not keep a balanced TT-matrix's structure")
        return (whitened or WhitenedSVD(w, x)).cores(rank)
    if method == "cross":
        return tt_cross_maxvol(w, in_modes, out_modes, rank, maxvol_k=maxvol_k)
    if lowrank:
        return lowrank_svd(w, rank)
    return tt_svd(w, in_modes, out_modes, max_rank=rank)


def max_useful_rank(k: int, n: int, in_modes: Sequence[int], out_modes: Sequence[int],
                    min_flop_ratio: float = DEFAULT_MIN_FLOP_RATIO) -> int:
    """The largest uniform rank whose FLOP ratio (dense / TT) is still >= min_flop_ratio (0: none)."""
    d = len(in_modes)
    best, r = 0, 1
    cap = max(uniform_ranks(d, 1 << 30, in_modes, out_modes))
    while r <= cap:
        ranks = uniform_ranks(d, r, in_modes, out_modes)
        if k * n / tt_macs(in_modes, out_modes, ranks) < min_flop_ratio:
            break
        best = r
        r += 1
    return best


def build(w: np.ndarray, rank: int, *, name: str = "", layout: str = "lowrank", d: int = 2,
          method: str = "svd", x: np.ndarray | None = None, bias: np.ndarray | None = None,
          maxvol_k: int = 8, in_modes: Sequence[int] | None = None,
          out_modes: Sequence[int] | None = None) -> TTLayerResult:
    """A fixed-rank factorisation (``--tt-rank``) with its metadata; gap measured when X is given."""
    k, n = w.shape
    if in_modes is None or out_modes is None:
        in_modes, out_modes = choose_modes(k, n, d, layout)
    fit, held = split_calibration(x) if x is not None else (None, None)
    whitened = whitened_svd(w, fit) if method == "svd-whitened" else None
    cores = factor(w, in_modes, out_modes, rank, method, x=fit, maxvol_k=maxvol_k, whitened=whitened)
    ranks = tt_ranks(cores)
    macs = tt_macs(in_modes, out_modes, ranks)
    g = gap(w, cores, held, bias) if x is not None else float("nan")
    return TTLayerResult(name, "tt", f"fixed rank {rank}", k, n, list(in_modes), list(out_modes), ranks, method, g,
                         k * n / macs, sum(c.size for c in cores) / (k * n), cores)


def autotune(w: np.ndarray, x: np.ndarray, gap_tol: float = 0.02, *, name: str = "", bias: np.ndarray | None = None,
             layout: str = "lowrank", d: int = 2, method: str | None = None, maxvol_k: int = 8,
             min_flop_ratio: float = DEFAULT_MIN_FLOP_RATIO, max_rank: int | None = None) -> TTLayerResult:
    """The smallest uniform rank with gap <= gap_tol on the calibration inputs X, among ranks whose
    FLOP ratio is >= min_flop_ratio. Whitening is fitted on half of X's rows and the gap measured
    on the other half (:func:`split_calibration`). Binary search (the gap shrinks with the rank:
    in practice, and exactly for the whitened SVD on its fit rows). No such rank: the
    layer stays dense, ``reason`` says which bound failed and the gap at the largest useful rank."""
    k, n = w.shape
    in_modes, out_modes = choose_modes(k, n, d, layout)
    if method is None:
        method = "svd-whitened" if layout == "lowrank" else "svd"
    top = max_useful_rank(k, n, in_modes, out_modes, min_flop_ratio)
    if max_rank is not None:
        top = min(top, max_rank)
    dense = TTLayerResult(name, "dense", "", k, n, list(in_modes), list(out_modes), [], method, float("nan"), 1.0, 1.0)
    if top < 1:
        dense.reason = f"no rank gives a FLOP ratio >= {min_flop_ratio} for modes {in_modes} x {out_modes}"
        return dense
    fit, held = split_calibration(x)
    whitened = whitened_svd(w, fit) if method == "svd-whitened" else None
    cache: dict[int, tuple[float, list[np.ndarray]]] = {}

    def at(rank: int) -> float:
        if rank not in cache:
            cores = factor(w, in_modes, out_modes, rank, method, x=fit, maxvol_k=maxvol_k, whitened=whitened)
            g = gap(w, cores, held, bias)
            cache[rank] = (g, cores)
            dense.tried.append({"rank": rank, "gap": g})
        return cache[rank][0]

    if at(top) > gap_tol:
        dense.gap = cache[top][0]
        dense.reason = (f"gap {dense.gap:.4f} > {gap_tol} even at rank {top}, the largest rank with a FLOP ratio "
                        f">= {min_flop_ratio}")
        return dense
    lo, hi = 1, top  # invariant: at(hi) <= tol
    while lo < hi:
        mid = (lo + hi) // 2
        if at(mid) <= gap_tol:
            hi = mid
        else:
            lo = mid + 1
    g, cores = cache[hi]
    ranks = tt_ranks(cores)
    macs = tt_macs(in_modes, out_modes, ranks)
    result = TTLayerResult(name, "tt", f"smallest rank with gap <= {gap_tol}", k, n, list(in_modes), list(out_modes),
                           ranks, method, g, k * n / macs, sum(c.size for c in cores) / (k * n), cores, dense.tried)
    return result


def autotune_layers(layers: Iterable[tuple[str, np.ndarray, np.ndarray | None, np.ndarray]], gap_tol: float = 0.02,
                    progress: bool = True, **kwargs: Any) -> list[TTLayerResult]:
    """:func:`autotune` over (name, W, bias, X) with a progress bar."""
    results = []
    for name, w, bias, x in tqdm(list(layers), desc="tt autotune", unit="layer", disable=not progress):
        results.append(autotune(w, x, gap_tol, name=name, bias=bias, **kwargs))
    return results


def node_attributes(result: TTLayerResult, nan_guard: int = 1) -> dict[str, Any]:
    """TTMatMul attributes of a built layer (modes, ranks and the measured gap as metadata)."""
    return {"in_modes": list(result.in_modes), "out_modes": list(result.out_modes), "ranks": list(result.ranks),
            "gap": float(result.gap) if math.isfinite(result.gap) else -1.0, "nan_guard": int(nan_guard)}


# --------------------------------------------------------------------------------------- calibration inputs


def collect_matmul_inputs(model: Any, input_names: Sequence[str], batches: Iterable[Any], max_rows: int = 4096,
                          seed: int = 0, feeds: Callable[[Any, Any], Mapping[str, np.ndarray]] = lm_feeds
                          ) -> dict[str, np.ndarray]:
    """Runs ``model`` (ONNX proto) in ORT on calibration batches with the given values (MatMul
    inputs X) added as graph outputs; returns per value a [rows, K] float32 sample of at most
    ``max_rows`` rows (uniformly sub-sampled across batches). ``feeds(session, batch)`` makes the
    input dict (default: :func:`ortsparse.runtime.lm_feeds`, which also takes encoder batches; a
    KV-cache decoder then prefills from an empty past: :func:`ortsparse.runtime.captured_values`).
    ``ortsparse.commands.calibrate.layer_calibration`` picks the values of a layer target."""
    wanted = list(dict.fromkeys(input_names))
    chunks: dict[str, list[np.ndarray]] = {v: [] for v in wanted}
    one_thread = {"intra_op_num_threads": 1}
    for _, outputs in captured_values(model, wanted, batches, feeds=feeds, session_options=one_thread):
        for value, out in zip(wanted, outputs):
            chunks[value].append(out.reshape(-1, out.shape[-1]).astype(np.float32))
    rng = np.random.default_rng(seed)
    result = {}
    for value, parts in chunks.items():
        rows = np.concatenate(parts) if parts else np.zeros((0, 0), np.float32)
        if len(rows) > max_rows:
            rows = rows[np.sort(rng.choice(len(rows), max_rows, replace=False))]
        result[value] = rows
    return result
