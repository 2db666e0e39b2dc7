"""Decomposed ("eager") attention, as both torch exporters write it, becomes one PopcountAttention.

Before -> After::

    S = MatMul(Q·a, KT·b)            KT = Transpose(K, [0,1,3,2]) | Transpose(K_bshd, [0,2,3,1])
                                          | Reshape(Transpose(Reshape(K, [BH,S,D]), [0,2,1]), [B,H,D,S])
    S = S · c  |  S / c              (a, b, c scalar constants, each optional)
    S = S + M  |  Where(C, S, fill)  (zero or more masks, after the scale)
    P = Softmax(S, axis=-1) [-> Cast(float)]* [-> Where(IsNaN(P), 0, P)]
    Y = MatMul(P, V)
    ->
    Y = ai.ortsparse.PopcountAttention(Q, K', V', mask, scale = a·b·c, <settings>)

K' is K in [B, H, Skv, D] (a Transpose is inserted when K^T came from another layout). When K and V
are both transformers' repeat_kv (``Reshape(Expand(Unsqueeze(kv, 2)))``, GQA) the un-expanded
[B, Hkv, Skv, D] tensors are passed. Masks keep their meaning: an additive M is passed as is;
Where(C, S, fill) becomes Where(C, 0, fill) added to the scores (several masks are summed).
Where(IsNaN(P), 0, P) (SDPA's guard for fully masked rows) is dropped: see docs/rewriter.md.
"""
from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import MatchResult

from ..graph_utils import is_constant_like, is_onnx_op, op_name
from ._base import (
    AttentionRule,
    Core,
    Mask,
    Operand,
    check_float,
    check_rank4,
    mask_dtype_ok,
    rank_of,
    resolve_key,
    scalar_constant,
    strip_scalar_scale,
    undo_repeat_kv,
)

_TAIL_CASTS = ("Cast", "Identity", "Dropout")
_SCORE_PASS = ("Add", "Mul", "Div", "Where", "Cast", "Identity")


def _is_activation_matmul(node: ir.Node | None) -> bool:
    return is_onnx_op(node, "MatMul") and not any(is_constant_like(v) for v in node.inputs[:2])


def _leads_to_scores(value: ir.Value, depth: int = 6) -> bool:
    """Whether ``value`` is computed from an activation x activation MatMul through score ops."""
    producer = value.producer()
    if _is_activation_matmul(producer):
        return True
    if depth == 0 or not is_onnx_op(producer, *_SCORE_PASS):
        return False
    inputs = producer.inputs[1:3] if producer.op_type == "Where" else producer.inputs
    return any(v is not None and not is_constant_like(v) and _leads_to_scores(v, depth - 1) for v in inputs)


def _softmax_of(probs: ir.Value, nodes: list[ir.Node]) -> ir.Node | None:
    value = probs
    for _ in range(6):
        producer = value.producer()
        if is_onnx_op(producer, "Softmax"):
            return producer
        if is_onnx_op(producer, *_TAIL_CASTS):
            if producer.op_type == "Cast" and producer.attributes.get_int("to", 0) != ir.DataType.FLOAT:
                return None
            nodes.append(producer)
            value = producer.inputs[0]
            continue
        if is_onnx_op(producer, "Where"):
            cond, zero, kept = producer.inputs
            guard = cond.producer()
            if is_onnx_op(guard, "IsNaN") and guard.inputs[0] is kept and scalar_constant(zero) == 0.0:
                nodes.extend([producer, guard])
                value = kept
                continue
        return None
    return None


class EagerAttention(AttentionRule):
    rule_name = "attention_eager"
    before_after = "MatMul(Softmax(MatMul(Q, K^T)·scale + mask), V) -> PopcountAttention(Q, K, V, mask)"

    def takes(self, anchor: ir.Node) -> bool:
        return is_onnx_op(anchor, "MatMul") and len(anchor.inputs) == 2

    def analyze(self, anchor: ir.Node, opset: int) -> tuple[MatchResult, Core | None]:
        result = MatchResult()
        probs, v = anchor.inputs
        nodes: list[ir.Node] = [anchor]
        softmax = _softmax_of(probs, nodes)
        if softmax is None:
            return result.fail(f"input 0 of '{anchor.name}' reaches the Softmax through ops other than Cast, Identity, "
                               "Dropout and the IsNaN guard", anchor), None
        nodes.append(softmax)
        axis = softmax.attributes.get_int("axis", -1)
        rank = rank_of(softmax.inputs[0])
        if axis != -1 and not (rank is not None and axis == rank - 1):
            return result.fail(f"Softmax '{softmax.name}' normalises axis {axis}, not the key axis (-1)", softmax), None

        masks: list[Mask] = []
        factor, scaled = 1.0, False
        value = softmax.inputs[0]
        score = None
        for _ in range(12):
            producer = value.producer()
            if _is_activation_matmul(producer):
                score = producer
                break
            if is_onnx_op(producer, "Add"):
                a, b = producer.inputs
                lead_a, lead_b = _leads_to_scores(a), _leads_to_scores(b)
                if lead_a == lead_b:
                    return result.fail(f"Add '{producer.name}' before the Softmax: cannot tell scores from mask", producer), None
                if scaled:
                    return result.fail(f"mask Add '{producer.name}' comes before a scale (the op adds the mask after scaling)",
                                       producer), None
                value, mask = (a, b) if lead_a else (b, a)
                masks.append(Mask("add", mask))
            elif is_onnx_op(producer, "Where"):
                cond, kept, fill = producer.inputs
                fill_value = scalar_constant(fill)
                if fill_value is None or not _leads_to_scores(kept):
                    return result.fail(f"Where '{producer.name}' before the Softmax is not Where(mask, scores, constant)",
                                       producer), None
                if scaled:
                    return result.fail(f"mask Where '{producer.name}' comes before a scale", producer), None
                masks.append(Mask("where", cond, fill_value))
                value = kept
            elif is_onnx_op(producer, "Mul", "Div"):
                base, f = strip_scalar_scale(value, nodes)
                if base is value:
                    return result.fail(f"{producer.op_type} '{producer.name}' before the Softmax does not scale by a "
                                       "constant scalar (a scale computed at run time is not folded)", producer), None
                factor *= f
                scaled = True
                value = base
                continue
            elif is_onnx_op(producer, "Cast", "Identity"):
                if producer.op_type == "Cast" and producer.attributes.get_int("to", 0) != ir.DataType.FLOAT:
                    return result.fail(f"Cast '{producer.name}' before the Softmax leaves float32", producer), None
                value = producer.inputs[0]
            else:
                what = "a graph input" if producer is None else f"{op_name(producer)} '{producer.name}'"
                return result.fail(f"the Softmax '{softmax.name}' input comes from {what}, which the rule does not "
                                   "follow back to MatMul(Q, K^T)", softmax), None
            nodes.append(producer)
        if score is None:
            return result.fail(f"no MatMul(Q, K^T) found before Softmax '{softmax.name}'", softmax), None
        nodes.append(score)

        q, fq = strip_scalar_scale(score.inputs[0], nodes)
        key_result, key, fk = resolve_key(score.inputs[1], nodes)
        if not key_result:
            return key_result, None
        scale = factor * fq * fk
        if not (scale > 0.0):
            return result.fail(f"folded scale {scale:g} is not positive", score), None
        for check in (check_float(q, "Q"), check_float(v, "V"), check_rank4(q, "Q"), check_rank4(v, "V"),
                      check_float(key.value, "K")):
            if not check:
                return check, None
        for mask in masks:
            check = mask_dtype_ok(mask.value, mask.kind)
            if not check:
                return check, None

        core = Core(q=Operand(q), k=key, v=Operand(v), scale=scale, masks=masks, nodes=nodes, name_hint=softmax.name or "")
        if key.perm is None:
            k_undone, v_undone = undo_repeat_kv(key.value), undo_repeat_kv(v)
            if k_undone is not None and v_undone is not None:
                core.k, core.v = Operand(k_undone[0]), Operand(v_undone[0])
                core.gqa_undone = True
                core.gqa_rep = k_undone[1] or v_undone[1]
                nodes.extend(k_undone[2] + v_undone[2])
            elif (k_undone is None) != (v_undone is None):
                core.notes.append("only one of K/V is a repeat_kv expansion: both passed expanded")
        return result, core
