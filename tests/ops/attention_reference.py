"""Independent numpy reference of PopcountAttention (test oracle; nothing here is used by the library).

Written from the contract (docs/ops.md#popcountattention), not from the C++: bits as boolean
arrays, counts as sums of boolean products, softmax in float64; the fixed random projection of
proj_bits is generated here too (:func:`projection_matrix`), compared bit for bit with the op's.
"""
from __future__ import annotations

import math

import numpy as np
from onnx import TensorProto, helper


_SEED = np.uint64(0x243F6A8885A308D3)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def splitmix64_stream(seed, count):
    """The first ``count`` outputs of splitmix64 from state ``seed`` (uint64, wrapping arithmetic):
    state += golden; z = state; z = (z ^ z >> 30) * M1; z = (z ^ z >> 27) * M2; out = z ^ z >> 31."""
    z = np.uint64(seed) + np.arange(1, count + 1, dtype=np.uint64) * _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def projection_matrix(d, bits):
    """float32 [d, bits]: the op's fixed projection of proj_bits, row-major N(0, 1) values by
    Box-Muller from the splitmix64 stream of 0x243F6A8885A308D3. Each pair of values takes two
    draws: u1 = (top 53 bits + 1) * 2^-53 in (0, 1], u2 = top 53 bits * 2^-53 in [0, 1); the pair is
    r cos(2 pi u2), r sin(2 pi u2) with r = sqrt(-2 ln u1), computed in float64 and rounded to
    float32 (an odd count drops the last sine)."""
    n = d * bits
    draws = splitmix64_stream(_SEED, n + (n & 1)) >> np.uint64(11)
    u1 = (draws[0::2].astype(np.float64) + 1.0) * 2.0 ** -53
    u2 = draws[1::2].astype(np.float64) * 2.0 ** -53
    radius, angle = np.sqrt(-2.0 * np.log(u1)), 6.283185307179586 * u2
    values = np.empty(draws.size, dtype=np.float32)
    values[0::2] = radius * np.cos(angle)
    values[1::2] = radius * np.sin(angle)
    return values[:n].reshape(d, bits)


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
    """Exact attention in float64. keep: optional bool [B, H, Sq, Skv]; keys outside it are dropped.
    NaN / Inf as the contract (docs/ops.md, as onnxruntime): the mask is added (bool False = -inf, so
    a NaN score stays NaN); keys outside the causal range are not scored for the query; a NaN score
    makes the row NaN; P multiplies every V row (0 for the keys a query does not attend, so a NaN
    there reaches its column; a row whose scores are all -inf is 0·V); a row with no key in its
    causal range is 0."""
    h = q.shape[1]
    kk = expand_kv(k, h).astype(np.float64)
    vv = expand_kv(v, h).astype(np.float64)
    s = np.einsum("bhid,bhjd->bhij", q.astype(np.float64), kk) * float(scale_of(scale, q.shape[3]))
    s = s + additive_mask(mask, s.shape)
    if causal:
        s = np.where(causal_allowed(q.shape[2], k.shape[2]), s, -np.inf)
    if keep is not None:
        s = np.where(keep, s, -np.inf)
    y = np.einsum("bhij,bhjd->bhid", softmax_rows(s), vv)
    if causal:
        no_key = ~causal_allowed(q.shape[2], k.shape[2]).any(axis=-1)
        y[:, :, no_key] = 0.0
    return y


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


def selection_scores(q, k, mask=None, *, causal=False, scale=0.0, select="popcount", mode="sign", eps=1e-4,
                     center=True, proj_bits=0):
    """float32 [B, H, Sq, Skv] scores the selector ranks (-inf: not attendable). Popcount packs
    k - mean(k over the call's keys) when center, and x @ R (R: the op's fixed projection,
    :func:`projection_matrix`) when proj_bits > 0."""
    b, h, sq, d = q.shape
    kk = expand_kv(k, h)
    bias = full_bias(mask, q, k, causal)
    if select == "energy":
        norm = np.sqrt((kk.astype(np.float64) ** 2).sum(-1)).astype(np.float32)
        return (norm[:, :, None, :] + bias).astype(np.float32)
    qx = q
    if center is not False:
        # The mean of the first min(Skv, 256) keys of each (b, kv head).
        mu = k[:, :, :256].astype(np.float64).mean(axis=2, keepdims=True).astype(np.float32)
        kk = expand_kv((k - mu).astype(np.float32), h)
    if proj_bits:
        r = projection_matrix(d, proj_bits).astype(np.float64)
        qx = (q.astype(np.float64) @ r).astype(np.float32)
        kk = (kk.astype(np.float64) @ r).astype(np.float32)
    qp, qn, gq = pack(qx, mode, eps)
    kp, kn, gk = pack(kk, mode, eps)
    a = approx_counts((qp, qn), (kp, kn), mode, qx.shape[-1]).astype(np.float32)
    sc = scale_of(scale, d)
    s = a * gq[..., :, None] * gk[..., None, :] * sc + bias
    return s.astype(np.float32)


def top_indices(values, count):
    """Indices of the `count` largest values, ties to the lower index."""
    order = np.lexsort((np.arange(len(values)), -values.astype(np.float64)))
    return np.sort(order[:count])


def selected_keys(q, k, mask=None, *, causal=False, scale=0.0, select="popcount", mode="sign", eps=1e-4, topk=256,
                  candidates=1.0, keep_first=0, keep_recent=0, center=True, proj_bits=0):
    """bool [B, H, Sq, Skv]: the keys that get exact scores and take part in the softmax. The
    first keep_first and the last keep_recent keys of each query's causal prefix are always kept
    (unless masked out); topk more come from the selector."""
    sel = selection_scores(q, k, mask, causal=causal, scale=scale, select=select, mode=mode, eps=eps, center=center,
                           proj_bits=proj_bits)
    b, h, sq, skv = sel.shape
    keep = np.zeros(sel.shape, dtype=bool)
    sel = np.where(sel < np.float32(-1e30), np.float32(-np.inf), sel)  # finfo.min-style masks: out
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


def approximate_attention(q, k, v, mask=None, *, causal=False, scale=0.0, mode="sign", eps=1e-4, center=True):
    """topk = 0: softmax of the approximate scores over all attendable keys."""
    sel = selection_scores(q, k, mask, causal=causal, scale=scale, mode=mode, eps=eps, center=center)
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
