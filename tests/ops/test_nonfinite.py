"""NaN/Inf behaviour of the ops that document it here (KWTA, event and TT have theirs in their own
test files): ProcSparseMatMul and PopcountAttention. docs/ops.md states the same rules."""
from __future__ import annotations

import numpy as np

import ortsparse
from ortsparse import _kernels
from ortsparse.proc_sparse import build_proc_sparse

from .onnx_builders import proc_model


def test_proc_nan_reaches_only_units_that_keep_its_block():
    rng = np.random.default_rng(0)
    k, n, block = 128, 40, 32
    p = build_proc_sparse(rng.standard_normal((k, n)).astype(np.float32), block=block, fanout=2, base_scale=0.0)
    session = ortsparse.inference_session(proc_model(p.indices, p.deltas, k=k, block=block, seed=p.seed,
                                                     base_scale=0.0))
    x = rng.standard_normal((1, k)).astype(np.float32)
    x[0, 40] = np.nan  # block 1
    y = session.run(None, {"X": x})[0][0]
    keeps_block_1 = (p.indices.astype(np.int64) == 1).any(axis=1)
    assert keeps_block_1.any() and (~keeps_block_1).any()
    assert np.isnan(y[keeps_block_1]).all()  # like MatMul for the blocks a unit reads
    assert np.isfinite(y[~keeps_block_1]).all()  # a dropped block is never read


def _qkv(rng):
    q = rng.standard_normal((1, 2, 1, 16)).astype(np.float32)
    k = rng.standard_normal((1, 1, 64, 16)).astype(np.float32)
    v = rng.standard_normal((1, 1, 64, 16)).astype(np.float32)
    return q, k, v


def test_attention_nan_key_propagates_like_exact_attention():
    q, k, v = _qkv(np.random.default_rng(1))
    k[0, 0, 5, 3] = np.nan
    for select in ("none", "popcount"):
        y, _ = _kernels.popcount_attention(q, k, v, topk=8, min_keys=0, select=select)
        assert np.isnan(y).all(), select


def test_attention_inf_value_of_an_unselected_key_does_not_reach_the_output():
    q, k, v = _qkv(np.random.default_rng(2))
    exact, _ = _kernels.popcount_attention(q, k, v, topk=8, min_keys=0, select="none")
    scores = np.einsum("bhqd,bkd->bhk", q, k[:, 0])
    dropped = int(np.argmin(scores.max(axis=1)))  # the key every head ranks lowest (not selected: fixed seed)
    v[0, 0, dropped, 0] = np.inf
    y, _ = _kernels.popcount_attention(q, k, v, topk=8, min_keys=0, select="popcount")
    assert np.isfinite(y).all()
    y_exact, _ = _kernels.popcount_attention(q, k, v, topk=8, min_keys=0, select="none")
    assert not np.isfinite(y_exact).all() and np.isfinite(exact).all()
