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


class EventReference:
    """EventDrivenMatMul's documented semantics (docs/ops.md), computed directly: the output of an
    event row is sum_b c_b * x_ref_b @ W_b + B with c_b = 1 for a block refreshed on this row and
    stale_beta * exp(-stale_lambda * age_b) for a reused one (no delta accumulation, no renorm).
    budget_ms is modelled as either no deadline or an already expired one (``expired=True``: only
    the quorum of each row's selected blocks is computed)."""

    def __init__(self, w, bias=None, *, block=1, axis="sequence", topk=0.4, delta_theta=0.01, stale_beta=1.0,
                 stale_lambda=0.0, age_max=0, quorum=0.6, gap_every=64, gap_tol=0.03, kwta_k=0.0, expired=False,
                 max_gated_rows=0, deadline=False):
        self.w = w.astype(np.float64)
        self.bias = None if bias is None else bias.astype(np.float64)
        self.k, self.n = w.shape
        self.block = block
        self.nb = math.ceil(self.k / block)
        self.axis = axis
        self.refresh = max(1, min(math.ceil(np.float32(topk) * self.nb * (1 - 1e-6)), self.nb))
        self.kwta = max(1, min(math.ceil(np.float32(kwta_k) * self.nb * (1 - 1e-6)), self.nb)) if kwta_k > 0 else 0
        self.theta, self.beta, self.lam = np.float32(delta_theta), float(np.float32(stale_beta)), float(np.float32(stale_lambda))
        self.age_max, self.quorum = age_max, float(np.float32(quorum))
        self.gap_every, self.gap_tol, self.expired = gap_every, float(np.float32(gap_tol)), expired
        self.max_gated_rows = max_gated_rows
        self.deadline = deadline or expired  # budget_ms > 0: rows run alone, no dense-row cost rule
        self.reset()
        self.refreshed = self.total = self.gap_checks = self.disables = self.deadline_stops = 0
        self.last_gap = None

    def reset(self):
        self.streams, self.enabled, self.gap_counter, self.prev = {}, True, 0, (0, 0)

    def _bounds(self, b):
        return b * self.block, min(self.k, (b + 1) * self.block)

    def _block_sumsq(self, v):
        return np.array([np.sum(v[slice(*self._bounds(b))].astype(np.float64) ** 2) for b in range(self.nb)])

    def _output(self, st):
        c = np.where(st["age"] == 0, 1.0, self.beta * np.exp(-self.lam * st["age"]))
        eff = st["x_ref"].astype(np.float64) * np.repeat(c, self.block)[: self.k]
        y = eff @ self.w
        return y + self.bias if self.bias is not None else y

    def _dense(self, st, xr):
        st.update(x_ref=xr.copy(), age=np.zeros(self.nb, dtype=np.int64), live=True)

    def _plan(self, st, xr, wave_rows=1):
        """None for a dense row, else the refreshed blocks (forced first, then by delta). In a wave
        of more than 2 rows without a deadline, a row refreshing more than 50% of its blocks is a
        dense row (the engine's cost rule)."""
        if not self.enabled or not st.get("live"):
            return None
        self.total += self.nb
        d2 = self._block_sumsq(xr - st["x_ref"])
        energy = self._block_sumsq(xr)
        cand = np.ones(self.nb, dtype=bool)
        if 0 < self.kwta < self.nb:
            cand[:] = False
            cand[np.lexsort((np.arange(self.nb), -energy))[: self.kwta]] = True
        forced = (st["age"] >= self.age_max) if self.age_max > 0 else np.zeros(self.nb, dtype=bool)
        eligible = cand & ~forced & ~(d2 <= float(self.theta) ** 2 * energy)
        idx = np.flatnonzero(eligible)
        keep = min(self.refresh, len(idx))
        by_delta = idx[np.lexsort((idx, -d2[idx]))][:keep]
        order = list(np.flatnonzero(forced)) + list(by_delta)
        if len(order) == self.nb or (wave_rows > 2 and not self.deadline and len(order) > 0.5 * self.nb):
            self.refreshed += self.nb
            return None
        if self.expired:
            q = min(len(order), int(forced.sum()) + math.ceil(self.quorum * keep * (1 - 1e-6)))
            if q < len(order):
                self.deadline_stops += 1
            order = order[:q]
        self.refreshed += len(order)
        return order

    def __call__(self, x, reset=False):
        if reset:
            self.reset()
        shape = x.shape
        x2 = x.reshape(-1, self.k).astype(np.float32)
        seq = shape[-2] if x.ndim >= 2 else 1
        batch = x2.shape[0] // seq if seq else 0
        y = np.zeros((x2.shape[0], self.n))
        if 0 < self.max_gated_rows < x2.shape[0]:  # a prefill: dense, streams resync on their last row
            for b in range(batch):
                for s in (range(seq) if self.axis == "call" else [seq - 1]):
                    self._dense(self.streams.setdefault((b, s if self.axis == "call" else 0), {}), x2[b * seq + s])
            if self.axis == "call":
                self.prev = (batch, seq)
            y = x2.astype(np.float64) @ self.w + (self.bias if self.bias is not None else 0)
            return y.reshape(*shape[:-1], self.n)
        if self.axis == "call":
            waves = [[(b * seq + s, (b, s)) for b in range(batch) for s in range(seq)]]
            for b in range(batch):
                for s in range(seq):
                    if b >= self.prev[0] or s >= self.prev[1]:
                        self.streams.pop((b, s), None)
            self.prev = (batch, seq)
        else:
            waves = [[(b * seq + t, (b, 0)) for b in range(batch)] for t in range(seq)]
        for wave in waves:
            plans = []
            for row, key in wave:
                st = self.streams.setdefault(key, {})
                order = self._plan(st, x2[row], len(wave))
                check = False
                if order is not None and self.gap_every > 0:
                    self.gap_counter += 1
                    check = self.gap_counter % self.gap_every == 0
                plans.append((row, st, order, check))
            for row, st, order, check in plans:
                xr = x2[row]
                if order is None:
                    self._dense(st, xr)
                else:
                    st["age"] += 1
                    for b in order:
                        lo, hi = self._bounds(b)
                        st["x_ref"][lo:hi] = xr[lo:hi]
                        st["age"][b] = 0
                y[row] = self._output(st)
            for row, st, order, check in plans:
                if not check:
                    continue
                dense = x2[row].astype(np.float64) @ self.w + (self.bias if self.bias is not None else 0)
                gap = np.linalg.norm(y[row] - dense) / np.linalg.norm(dense)
                self.gap_checks += 1
                self.last_gap = gap
                if gap > self.gap_tol and self.enabled:
                    self.enabled = False
                    self.disables += 1
                self._dense(st, x2[row])
                y[row] = dense
        return y.reshape(*shape[:-1], self.n)


def smooth_stream(rng, calls, rows, k, block, step=0.02, full_change_every=0):
    """Inputs changing a little per call, with block norms and block changes far apart (no
    near-ties in energy or delta rankings). Yields [rows, K] arrays."""
    x = separated_input(rng, rows, k, block)
    nb = math.ceil(k / block)
    for call in range(calls):
        if full_change_every and call and call % full_change_every == 0:
            x = separated_input(rng, rows, k, block)
        else:
            for t in range(rows):
                levels = np.repeat(1.0 + 0.3 * rng.permutation(nb), block)[:k]
                x[t] = x[t] + (step * levels * rng.choice([-1.0, 1.0], size=k)).astype(np.float32)
        yield x.copy()
