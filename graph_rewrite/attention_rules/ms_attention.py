"""onnxruntime's fused attention ops (``com.microsoft``, written by onnxruntime.transformers'
optimizer) become PopcountAttention plus the layout ops they hide.

Before -> After (``Attention``: the QKV projection is inside the op)::

    Y = com.microsoft.Attention(X, W, b [, mask_index] [, , attention_bias], num_heads=H, scale=s,
                                unidirectional=u, mask_filter_value=f)
    ->
    q, k, v = Split(MatMul(X, W) + b, axis=-1)
    Y = Reshape(Transpose(PopcountAttention(heads(q), heads(k), heads(v), mask, scale=s,
                                            is_causal=u), [0,2,1,3]), [0,0,-1])
    heads(x) = Transpose(Reshape(x, [0,0,H,-1]), [0,2,1,3])

Before -> After (``MultiHeadAttention``: projections outside)::

    Y = com.microsoft.MultiHeadAttention(Q, K, V [, bias] [, key_padding_mask] [, attention_bias], num_heads=H)
    ->
    Y = Reshape(Transpose(PopcountAttention(heads(Q + bq), heads(K + bk), heads(V + bv), mask), ...), [0,0,-1])

Masks keep onnxruntime's meaning exactly: a mask_index / key_padding_mask [B, Skv] (0 = masked) or
[B] (valid keys end at mask_index[b]) becomes Where(valid, 0, mask_filter_value) added to the
scores, as onnxruntime adds mask_filter_value (default -10000); attention_bias is added as is.
``unidirectional`` -> ``is_causal`` (Attention: no past, so Sq == Skv; MultiHeadAttention: only when the
query and key lengths are provably equal, since the op aligns the triangle KV-cache style).
Declined (near-misses): past state, packed QKV, rotary inside the op, 3-D/4-D mask_index.
"""
from __future__ import annotations

import dataclasses

import onnx_ir as ir
from onnxscript.rewriter import MatchResult

from ..techniques.popcount import AttentionSettings
from ._base import (
    AttentionRule,
    Core,
    Mask,
    Operand,
    check_float,
    emit_attention,
    rank_of,
    same_length,
)

MS = "com.microsoft"


def _heads(op, x: ir.Value, heads: int) -> ir.Value:
    shaped = op.Reshape(x, op.Constant(value_ints=[0, 0, heads, -1]))
    return op.Transpose(shaped, perm=[0, 2, 1, 3])


def _merge(op, y: ir.Value) -> ir.Value:
    return op.Reshape(op.Transpose(y, perm=[0, 2, 1, 3]), op.Constant(value_ints=[0, 0, -1]))


def _mask_rank(mask: ir.Value) -> int | None:
    rank = rank_of(mask)
    if rank is None and mask.producer() is not None and mask.producer().op_type == "EmbedLayerNormalization" \
            and mask.producer().outputs[1] is mask:
        return 1  # EmbedLayerNormalization's mask_index output is [batch] by its contract
    return rank


def _check_padding_mask(mask: ir.Value, what: str) -> MatchResult:
    rank = _mask_rank(mask)
    if rank not in (1, 2):
        shape = "unknown rank" if rank is None else f"rank {rank}"
        return MatchResult().fail(f"{what} '{mask.name}' has {shape}; only [B] (end positions) and [B, Skv] "
                                  "(1 = keep) are rewritten", mask)
    return MatchResult()


def _padding_additive(op, mask: ir.Value, key_heads: ir.Value, fill: float) -> ir.Value:
    """[B, 1, 1, Skv] float: 0 where the key takes part, ``fill`` where onnxruntime masks it."""
    zero, masked = op.Constant(value_float=0.0), op.Constant(value_float=float(fill))
    if _mask_rank(mask) == 2:
        valid = op.Cast(mask, to=ir.DataType.BOOL)
    else:
        skv = op.Gather(op.Shape(key_heads), op.Constant(value_int=2), axis=0)
        positions = op.Range(op.Constant(value_int=0), skv, op.Constant(value_int=1))
        ends = op.Unsqueeze(op.Cast(mask, to=ir.DataType.INT64), op.Constant(value_ints=[1]))
        valid = op.Less(op.Unsqueeze(positions, op.Constant(value_ints=[0])), ends)
    additive = op.Where(valid, zero, masked)
    return op.Unsqueeze(additive, op.Constant(value_ints=[1, 2]))


class _FusedRule(AttentionRule):
    op_type: str

    def takes(self, anchor: ir.Node) -> bool:
        return anchor.domain == MS and anchor.op_type == self.op_type

    def _common(self, anchor: ir.Node, first_optional: int) -> MatchResult:
        result = MatchResult()
        if anchor.attributes.get_int("num_heads", 0) <= 0:
            return result.fail(f"{anchor.op_type} '{anchor.name}' has no num_heads attribute", anchor)
        if any(out.uses() or out.is_graph_output() for out in anchor.outputs[1:]):
            return result.fail(f"{anchor.op_type} '{anchor.name}' has present/extra outputs in use (past state)", anchor)
        later = [i for i, v in enumerate(anchor.inputs) if v is not None and i >= first_optional]
        if later:
            return result.fail(f"{anchor.op_type} '{anchor.name}' uses input(s) {later} (past state, rotary or "
                               "sequence lengths): not rewritten", anchor)
        for name in ("do_rotary", "past_present_share_buffer"):
            if anchor.attributes.get_int(name, 0):
                return result.fail(f"{anchor.op_type} '{anchor.name}' has {name}=1: not rewritten", anchor)
        return result


class MsAttention(_FusedRule):
    rule_name = "attention_ms_attention"
    before_after = "com.microsoft.Attention(X, Wqkv, bqkv, mask) -> MatMul+Split+PopcountAttention"
    op_type = "Attention"

    def analyze(self, anchor: ir.Node, opset: int) -> tuple[MatchResult, Core | None]:
        result = self._common(anchor, first_optional=6)
        if not result:
            return result, None
        inputs = list(anchor.inputs) + [None] * (6 - len(anchor.inputs))
        x, w = inputs[0], inputs[1]
        if x is None or w is None:
            return result.fail(f"Attention '{anchor.name}' lacks its input or weight", anchor), None
        if inputs[4] is not None:
            return result.fail(f"Attention '{anchor.name}' takes past state: not rewritten", anchor), None
        check = check_float(x, "input")
        if not check:
            return check, None
        if rank_of(x) not in (None, 3):
            return result.fail(f"Attention '{anchor.name}' input has rank {rank_of(x)}; expected [B, S, hidden]", x), None
        sizes = tuple(anchor.attributes.get_ints("qkv_hidden_sizes", ()))
        if sizes and not (len(sizes) == 3 and sizes[0] == sizes[1]):
            return result.fail(f"Attention '{anchor.name}' has qkv_hidden_sizes={list(sizes)}; Q and K must match", anchor), None
        masks = []
        if inputs[3] is not None:
            check = _check_padding_mask(inputs[3], "mask_index")
            if not check:
                return check, None
            masks.append(Mask("padding", inputs[3], anchor.attributes.get_float("mask_filter_value", -10000.0)))
        if inputs[5] is not None:
            masks.append(Mask("add", inputs[5]))
        core = Core(q=Operand(x), k=Operand(w), v=Operand(inputs[2]) if inputs[2] is not None else Operand(w),
                    scale=anchor.attributes.get_float("scale", 0.0),
                    is_causal=anchor.attributes.get_int("unidirectional", 0), masks=masks, nodes=[anchor],
                    name_hint=anchor.name or "")
        if inputs[2] is None:
            core.notes.append("no bias")
        return result, core

    def emit(self, op, core: Core, anchor: ir.Node, settings: AttentionSettings, name: str | None,
             opset: int) -> ir.Value:
        heads = anchor.attributes.get_int("num_heads", 0)
        x, w = anchor.inputs[0], anchor.inputs[1]
        bias = anchor.inputs[2] if len(anchor.inputs) > 2 else None
        qkv = op.MatMul(x, w)
        if bias is not None:
            qkv = op.Add(qkv, bias)
        sizes = tuple(anchor.attributes.get_ints("qkv_hidden_sizes", ()))
        if sizes:
            q, k, v = op.Split(qkv, op.Constant(value_ints=list(sizes)), axis=-1, _outputs=3)
        elif opset >= 18:
            q, k, v = op.Split(qkv, axis=-1, num_outputs=3, _outputs=3)
        else:
            q, k, v = op.Split(qkv, axis=-1, _outputs=3)
        qh, kh, vh = _heads(op, q, heads), _heads(op, k, heads), _heads(op, v, heads)
        masks = [Mask("add", _padding_additive(op, m.value, kh, m.fill)) if m.kind == "padding" else m for m in core.masks]
        core = dataclasses.replace(core, q=Operand(qh), k=Operand(kh), v=Operand(vh), masks=masks)
        return _merge(op, emit_attention(op, core, settings, name))


class MsMultiHeadAttention(_FusedRule):
    rule_name = "attention_ms_mha"
    before_after = "com.microsoft.MultiHeadAttention(Q, K, V, bias, mask) -> PopcountAttention(heads(Q), ...)"
    op_type = "MultiHeadAttention"

    def analyze(self, anchor: ir.Node, opset: int) -> tuple[MatchResult, Core | None]:
        result = self._common(anchor, first_optional=6)
        if not result:
            return result, None
        inputs = list(anchor.inputs) + [None] * (6 - len(anchor.inputs))
        q, k, v = inputs[:3]
        if q is None or k is None or v is None:
            return result.fail(f"MultiHeadAttention '{anchor.name}' has no separate key/value (packed QKV): not "
                               "rewritten", anchor), None
        unknown = []
        for value, what in ((q, "query"), (k, "key"), (v, "value")):
            rank = rank_of(value)
            if rank is None:
                unknown.append(what)
            elif rank != 3:
                return result.fail(f"MultiHeadAttention '{anchor.name}' {what} has rank {rank}; only 3-D "
                                   "[B, S, H*D] query/key/value are rewritten (packed and 4-D forms are not)", value), None
            check = check_float(value, what)
            if not check:
                return check, None
        masks = []
        if inputs[4] is not None:
            check = _check_padding_mask(inputs[4], "key_padding_mask")
            if not check:
                return check, None
            masks.append(Mask("padding", inputs[4], anchor.attributes.get_float("mask_filter_value", -10000.0)))
        if inputs[5] is not None:
            masks.append(Mask("add", inputs[5]))
        causal = anchor.attributes.get_int("unidirectional", 0)
        if causal and not same_length(q, k, axis=1):
            return result.fail(f"MultiHeadAttention '{anchor.name}' is unidirectional and query/key lengths are "
                               "not provably equal (causal alignment would be ambiguous)", anchor), None
        core = Core(q=Operand(q), k=Operand(k), v=Operand(v), scale=anchor.attributes.get_float("scale", 0.0),
                    is_causal=causal, masks=masks, nodes=[anchor], name_hint=anchor.name or "")
        if unknown:
            core.notes.append(f"rank of {', '.join(unknown)} unknown: taken as 3-D [B, S, H*D]")
        return result, core

    def emit(self, op, core: Core, anchor: ir.Node, settings: AttentionSettings, name: str | None,
             opset: int) -> ir.Value:
        heads = anchor.attributes.get_int("num_heads", 0)
        q, k, v = core.q.value, core.k.value, core.v.value
        bias = anchor.inputs[3] if len(anchor.inputs) > 3 else None
        if bias is not None:
            bq, bk, bv = op.Split(bias, axis=0, num_outputs=3, _outputs=3) if opset >= 18 \
                else op.Split(bias, axis=0, _outputs=3)
            q, k, v = op.Add(q, bq), op.Add(k, bk), op.Add(v, bv)
        qh, kh, vh = _heads(op, q, heads), _heads(op, k, heads), _heads(op, v, heads)
        masks = [Mask("add", _padding_additive(op, m.value, kh, m.fill)) if m.kind == "padding" else m for m in core.masks]
        core = dataclasses.replace(core, q=Operand(qh), k=Operand(kh), v=Operand(vh), masks=masks)
        return _merge(op, emit_attention(op, core, settings, name))
