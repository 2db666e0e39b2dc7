"""Independent numpy reference of PopcountAttention (test oracle; nothing here is used by the library).

Written from the contract (docs/ops.md#popcountattention), not from the C++: bits as boolean
arrays, counts as sums of boolean products, softmax in float64.
"""
from __future__ import annotations

import math

import numpy as np
from onnx import TensorProto, helper


def additive_mask(mask, shape):
    """The mask as float added to scores, broadcast to shape [B, H, Sq, Skv] (bool False -> -inf)."""
    if mask is None:
        return np.zeros(shape, dtype=np.float32)
    if mask.dtype == np.bool_:
        mask = np.where(mask, np.float32(0), np.float32(-np.inf))
    return np.broadcast_to(mask.astype(np.float32), shape)


def causal_allowed(sq, skv):
    """[Sq, Skv] bool: query i (token Skv - Sq + i) attends keys j <= Skv - Sq + i."""
    i = np.arange(sq)[:, None]
    j = np.arange(skv)[None, :]
    return j <= skv - sq + i


def softmax_rows(s):
    """float64 softmax over the last axis; rows that are all -inf give 0."""
    s = s.astype(np.float64)
    mx = np.max(s, axis=-1, keepdims=True)
    dead = ~np.isfinite(mx) & (mx < 0)
    e = np.exp(s - np.where(dead, 0.0, mx))
    e = np.where(np.isneginf(s), 0.0, e)
    total = e.sum(axis=-1, keepdims=True)
    return np.where(dead, 0.0, e / np.where(total == 0, 1.0, total))


def expand_kv(x, h):
    return np.repeat(x, h // x.shape[1], axis=1)


def scale_of(scale, d):
    return np.float32(scale) if scale > 0 else np.float32(1.0 / math.sqrt(d))


def full_bias(mask, q, k, causal):
    b, h, sq, _ = q.shape
    skv = k.shape[2]
    bias = np.array(additive_mask(mask, (b, h, sq, skv)), dtype=np.float32)
    if causal:
        bias = np.where(causal_allowed(sq, skv), bias, np.float32(-np.inf))
    return bias


def attention(q, k, v, mask=None, *, causal=False, scale=0.0, keep=None):
    """Exact attention in float64. keep: optional bool [B, H, Sq, Skv]; keys outside it are dropped."""
    h = q.shape[1]
    kk = expand_kv(k, h).astype(np.float64)
    vv = expand_kv(v, h).astype(np.float64)
    s = np.einsum("bhid,bhjd->bhij", q.astype(np.float64), kk) * float(scale_of(scale, q.shape[3]))
    s = s + full_bias(mask, q, k, causal)
    if keep is not None:
        s = np.where(keep, s, -np.inf)
    return np.einsum("bhij,bhjd->bhid", softmax_rows(s), vv)


def pack(x, mode, eps):
    """Bits of x [..., D] per the contract: (pos, neg) bool arrays and gamma (float32)."""
    x = x.astype(np.float32)
    a = np.abs(x.astype(np.float64))
    if mode == "sign":
        pos = x > 0
        return pos, np.zeros_like(pos), np.float32(a.mean(axis=-1)) if x.shape[-1] else np.float32(0)
    if mode == "binary":
        pos = np.abs(x) > np.float32(eps)
        neg = np.zeros_like(pos)
    else:
        pos = x > np.float32(eps)
        neg = x < -np.float32(eps)
    active = pos | neg
    n = active.sum(axis=-1)
    total = np.where(active, a, 0.0).sum(axis=-1)
    gamma = np.where(n > 0, total / np.maximum(n, 1), np.float64(np.float32(eps)))
    return pos, neg, gamma.astype(np.float32)


def approx_counts(qbits, kbits, mode, d):
    """Integer approximate q·k in units of gamma_q·gamma_k, [..., Sq, Skv]."""
    qp, qn = qbits
    kp, kn = kbits
    dot = lambda a, b: np.einsum("...id,...jd->...ij", a.astype(np.int64), b.astype(np.int64))
    if mode == "sign":
        return d - 2 * (dot(qp, ~kp) + dot(~qp, kp))  # agreements - disagreements = D - 2 * hamming
    if mode == "binary":
        return dot(qp, kp)
    return dot(qp, kp) + dot(qn, kn) - dot(qp, kn) - dot(qn, kp)


def selection_scores(q, k, mask=None, *, causal=False, scale=0.0, select="popcount", mode="sign", eps=1e-4):
    """float32 [B, H, Sq, Skv] scores the selector ranks (-inf: not attendable)."""
    b, h, sq, d = q.shape
    kk = expand_kv(k, h)
    bias = full_bias(mask, q, k, causal)
    if select == "energy":
        norm = np.sqrt((kk.astype(np.float64) ** 2).sum(-1)).astype(np.float32)
        return (norm[:, :, None, :] + bias).astype(np.float32)
    qp, qn, gq = pack(q, mode, eps)
    kp, kn, gk = pack(kk, mode, eps)
    a = approx_counts((qp, qn), (kp, kn), mode, d).astype(np.float32)
    sc = scale_of(scale, d)
    s = a * gq[..., :, None] * gk[..., None, :] * sc + bias
    return s.astype(np.float32)


def top_indices(values, count):
    """Indices of the `count` largest values, ties to the lower index."""
    order = np.lexsort((np.arange(len(values)), -values.astype(np.float64)))
    return np.sort(order[:count])


def selected_keys(q, k, mask=None, *, causal=False, scale=0.0, select="popcount", mode="sign", eps=1e-4, topk=256,
                  candidates=1.0, keep_first=0, keep_recent=0):
    """bool [B, H, Sq, Skv]: the keys that get exact scores and take part in the softmax. The
    first keep_first and the last keep_recent keys of each query's causal prefix are always kept
    (unless masked out); topk more come from the selector."""
    sel = selection_scores(q, k, mask, causal=causal, scale=scale, select=select, mode=mode, eps=eps)
    b, h, sq, skv = sel.shape
    keep = np.zeros(sel.shape, dtype=bool)
    for idx in np.ndindex(b, h, sq):
        row = sel[idx].copy()
        i = idx[2]
        limit = max(0, min(skv, skv - sq + i + 1)) if causal else skv
        allowed = np.flatnonzero(~np.isneginf(row))
        protected = np.array([j for j in allowed if j < keep_first or j >= limit - keep_recent], dtype=int)
        row[protected] = np.inf
        forced = len(protected)
        if len(allowed) <= topk + forced:
            keep[idx][:] = True  # exact over everything (masked keys weigh 0 anyway)
            continue
        want = forced + max(topk, math.ceil(candidates * topk))
        cand = top_indices(row, min(want, len(allowed)))
        if len(cand) > topk + forced:
            exact = attention_scores_row(q, k, mask, causal, scale, idx)[cand]
            exact = np.where(np.isin(cand, protected), np.inf, exact)
            cand = cand[top_indices(exact, topk + forced)]
        keep[idx][cand] = True
    return keep


def attention_scores_row(q, k, mask, causal, scale, idx):
    b, hh, i = idx
    h = q.shape[1]
    kk = expand_kv(k, h)
    s = kk[b, hh].astype(np.float64) @ q[b, hh, i].astype(np.float64) * float(scale_of(scale, q.shape[3]))
    return s + full_bias(mask, q, k, causal)[b, hh, i]


def approximate_attention(q, k, v, mask=None, *, causal=False, scale=0.0, mode="sign", eps=1e-4):
    """topk = 0: softmax of the approximate scores over all attendable keys."""
    sel = selection_scores(q, k, mask, causal=causal, scale=scale, mode=mode, eps=eps)
    vv = expand_kv(v, q.shape[1]).astype(np.float64)
    return np.einsum("bhij,bhjd->bhid", softmax_rows(sel), vv)


def attention_model(*, mask_type=None, mask_shape=None, node_name="attn", **attrs):
    """One PopcountAttention node; Q, K, V (and attn_mask) are graph inputs of free shape."""
    inputs = ["Q", "K", "V"] + (["attn_mask"] if mask_type is not None else [])
    node = helper.make_node("PopcountAttention", inputs, ["Y"], domain="ai.ortsparse", name=node_name, **attrs)
    graph_inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("Q", "K", "V")]
    if mask_type is not None:
        graph_inputs.append(helper.make_tensor_value_info("attn_mask", mask_type, mask_shape))
    graph = helper.make_graph([node], "attn", graph_inputs, [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.ortsparse", 1)],
                             ir_version=9)
