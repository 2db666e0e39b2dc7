"""ONNX ``Attention`` (opset 23, what torch's dynamo exporter writes for SDPA at opset >= 23)
becomes PopcountAttention.

Before -> After::

    Y = Attention(Q, K, V [, attn_mask], scale=s, is_causal=c)      Q, K, V: [B, H|Hkv, S, D]
    ->
    Y = ai.ortsparse.PopcountAttention(Q, K', V', attn_mask, scale=s (0 when absent: 1/sqrt(D)),
                                       is_causal=c, <settings>)

The mask keeps its meaning (bool: True takes part; float: added to the scores). K'/V' are the
un-expanded [B, Hkv, S, D] tensors when both are repeat_kv expansions (GQA). ``is_causal`` is passed
through only when Sq == Skv is provable from the shapes: ONNX aligns the causal triangle top-left,
PopcountAttention bottom-right (KV-cache style); they agree only on square score matrices.
Declined (near-misses): 3-D inputs, past_key/past_value, softcap, extra outputs in use.
"""
from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import MatchResult

from ..graph_utils import is_onnx_op
from ._base import (
    AttentionRule,
    Core,
    Mask,
    Operand,
    check_float,
    mask_dtype_ok,
    rank_of,
    same_length,
    undo_repeat_kv,
)


class OnnxAttention(AttentionRule):
    rule_name = "attention_onnx"
    before_after = "Attention(Q, K, V, mask) -> PopcountAttention(Q, K, V, mask)"

    def takes(self, anchor: ir.Node) -> bool:
        return is_onnx_op(anchor, "Attention")

    def analyze(self, anchor: ir.Node, opset: int) -> tuple[MatchResult, Core | None]:
        result = MatchResult()
        inputs = list(anchor.inputs) + [None] * (7 - len(anchor.inputs))
        q, k, v = inputs[:3]
        if q is None or k is None or v is None:
            return result.fail(f"Attention '{anchor.name}' lacks Q, K or V", anchor), None
        if inputs[4] is not None or inputs[5] is not None:
            return result.fail(f"Attention '{anchor.name}' takes past_key/past_value (KV cache inside the op): "
                               "not rewritten", anchor), None
        if inputs[6] is not None:
            return result.fail(f"Attention '{anchor.name}' takes nonpad_kv_seqlen: not rewritten", anchor), None
        if any(out.uses() or out.is_graph_output() for out in anchor.outputs[1:]):
            return result.fail(f"Attention '{anchor.name}' has present_key/present_value/qk outputs in use", anchor), None
        softcap = anchor.attributes.get_float("softcap", 0.0)
        if softcap != 0.0:
            return result.fail(f"Attention '{anchor.name}' has softcap={softcap:g}; the op has no soft-capping", anchor), None
        for value, what in ((q, "Q"), (k, "K"), (v, "V")):
            rank = rank_of(value)
            if rank is not None and rank != 4:
                return result.fail(f"Attention '{anchor.name}' {what} has rank {rank}; only 4-D [B, H, S, D] "
                                   "inputs are rewritten", value), None
            check = check_float(value, what)
            if not check:
                return check, None
        masks = []
        if inputs[3] is not None:
            mask = inputs[3]
            kind = "bool" if mask.dtype == ir.DataType.BOOL else "add"
            check = mask_dtype_ok(mask, kind)
            if not check:
                return check, None
            masks.append(Mask(kind, mask))
        causal = anchor.attributes.get_int("is_causal", 0)
        if causal and not same_length(q, k, axis=2):
            return result.fail(f"Attention '{anchor.name}' has is_causal=1 and Sq, Skv are not provably equal: ONNX "
                               "aligns the causal triangle top-left, PopcountAttention KV-cache style (bottom-right)",
                               anchor), None
        scale_attr = anchor.attributes.get("scale")
        scale = float(scale_attr.value) if scale_attr is not None else 0.0
        core = Core(q=Operand(q), k=Operand(k), v=Operand(v), scale=scale,
                    is_causal=causal, masks=masks, nodes=[anchor],
                    name_hint=anchor.name or "")
        k_undone, v_undone = undo_repeat_kv(k), undo_repeat_kv(v)
        if k_undone is not None and v_undone is not None:
            core.k, core.v = Operand(k_undone[0]), Operand(v_undone[0])
            core.gqa_undone, core.gqa_rep = True, k_undone[1] or v_undone[1]
            core.nodes.extend(k_undone[2] + v_undone[2])
        return result, core
