"""onnxruntime's ``com.microsoft.GroupQueryAttention`` (what onnxruntime-genai's model builder writes
for every decoder layer) becomes ``ai.ortsparse.PopcountGroupQueryAttention``: the same inputs,
attributes and outputs plus the selection attributes, so the node is swapped in place and its
neighbours (the QKV projection, the KV-cache graph inputs/outputs, the rotary caches) are untouched.

Before -> After::

    output, present_key, present_value = com.microsoft.GroupQueryAttention(
        query, key?, value?, past_key?, past_value?, seqlens_k, total_sequence_length,
        cos_cache?, sin_cache?, num_heads=H, kv_num_heads=Hkv, scale=s, softcap=c,
        local_window_size=w, do_rotary=r, rotary_interleaved=i)
    ->
    output, present_key, present_value = ai.ortsparse.PopcountGroupQueryAttention(
        <the same inputs>, <the same attributes>, <settings>)

Packed QKV (key and value empty) and separate Q/K/V, rotary or not, local windows, soft-capping,
smooth softmax, ``position_ids``, ``attention_bias``, ``head_sink`` and window-sized KV buffers
(``sliding_window_cache=1``, onnxruntime-genai's default for sliding-window layers) are all taken; the
shared past/present buffer of onnxruntime-genai needs nothing from the graph (the op sees it at run
time). Declined (near-misses), because the op does not implement them: the later optional inputs
(quantized-KV scales, Q/K norm weights, query_seqlens); ``qk_output`` (or an output_qk in use); a
quantized KV cache (k/v_quant_type, kv_cache_bit_width); a float16 (or any non-float32) query;
``do_rotary=1`` without cos/sin caches; ``sliding_window_cache=1`` without past inputs or without a
``local_window_size`` > 0; values onnxruntime runs but the op refuses (a negative or NaN scale,
softcap=inf, num_heads not a multiple of kv_num_heads, a window without causal). Values onnxruntime
1.32 runs as "off" are written as the op's "off" (:func:`_as_onnxruntime_runs_them`), so the node
written always loads.
"""
from __future__ import annotations

import math

import onnx_ir as ir
from onnxscript.rewriter import MatchResult

from .. import op_schema
from ..rules import DOMAIN, DOMAIN_VERSION
from ..techniques.popcount import GQA_OP_TYPE, AttentionSettings
from ._base import AttentionRule, Core, Operand, check_float

MS = "com.microsoft"
# Input names of the op, by index (onnxruntime >= 1.21 and later releases).
INPUTS = op_schema.inputs(GQA_OP_TYPE)  # graph_rewrite/op_schema.json (the C++ op reads the same list)
SUPPORTED_INPUTS = 12  # query .. head_sink
# GroupQueryAttention attributes the op reads (passed through as given); others are dropped.
PASSED_ATTRIBUTES = tuple(op_schema.attributes(GQA_OP_TYPE, "from_graph"))


def _refusal(anchor: ir.Node) -> str | None:
    """Why the op cannot take this node (None: it can)."""
    inputs = list(anchor.inputs)
    used = [f"{index} ({INPUTS[index] if index < len(INPUTS) else '?'})"
            for index, value in enumerate(inputs) if value is not None and index >= SUPPORTED_INPUTS]
    if used:
        return f"uses input(s) {', '.join(used)}, which PopcountGroupQueryAttention does not implement"
    attributes = anchor.attributes
    if attributes.get_int("num_heads", 0) <= 0 or attributes.get_int("kv_num_heads", 0) <= 0:
        return "has no num_heads / kv_num_heads > 0"
    if attributes.get_int("qk_output", 0):
        return f"has qk_output={attributes.get_int('qk_output', 0)} (not implemented)"
    if attributes.get_int("sliding_window_cache", 0) and (attributes.get_int("local_window_size", -1) <= 0
                                                          or len(inputs) < 5 or inputs[3] is None):
        return "has sliding_window_cache=1 without past_key / past_value or local_window_size > 0"
    for name in ("k_quant_type", "v_quant_type"):
        if attributes.get_string(name, "NONE") != "NONE":
            return f"has {name}={attributes.get_string(name, 'NONE')!r} (quantized KV cache: not implemented)"
    if attributes.get_int("kv_cache_bit_width", 0):
        return "has a quantized KV cache (kv_cache_bit_width): not implemented"
    if len(anchor.outputs) > 3 and (anchor.outputs[3].uses() or anchor.outputs[3].is_graph_output()):
        return "has its output_qk in use (not implemented)"
    if len(anchor.outputs) < 3 or any(out.name == "" for out in anchor.outputs[1:3]):
        return "has no present_key / present_value outputs"
    if attributes.get_int("do_rotary", 0) == 1 and (len(inputs) < 9 or inputs[7] is None or inputs[8] is None):
        return "has do_rotary=1 but no cos_cache / sin_cache"
    return _refused_value(attributes)


def _refused_value(attributes) -> str | None:
    """Attribute values onnxruntime runs (or refuses itself) that PopcountGroupQueryAttention refuses."""
    heads, kv_heads = attributes.get_int("num_heads", 0), attributes.get_int("kv_num_heads", 0)
    if heads % kv_heads:
        return f"has num_heads={heads}, not a multiple of kv_num_heads={kv_heads}"
    scale = attributes.get_float("scale", 0.0)
    if not math.isfinite(scale) or scale < 0:
        return f"has scale={scale:g} (the op takes a finite scale >= 0; 0: 1/sqrt(head_size))"
    if attributes.get_float("softcap", 0.0) == math.inf:
        return "has softcap=inf (onnxruntime's output is NaN; the op takes a finite soft-cap)"
    causal = attributes.get_int("causal", 1)
    if causal not in (0, 1):
        return f"has causal={causal} (must be 0 or 1)"
    window = attributes.get_int("local_window_size", -1)
    if causal == 0 and window >= 0:
        return f"has local_window_size={window} with causal=0 (the op's window needs causal=1)"
    return None


def _as_onnxruntime_runs_them(attributes: dict) -> dict:
    """The passed attributes with what onnxruntime 1.32 runs as "off" written as the op's "off":
    softcap <= 0 or NaN (its test is softcap > 0) -> 0; local_window_size < 0 -> -1; do_rotary,
    rotary_interleaved, smooth_softmax other than 1 (its test is == 1) -> 0. The op refuses the
    other spellings, so copying them would write a model that does not load."""
    normal = dict(attributes)
    if "softcap" in normal and not normal["softcap"] > 0:
        normal["softcap"] = 0.0
    if normal.get("local_window_size", -1) < 0:
        normal["local_window_size"] = -1
    for flag in ("do_rotary", "rotary_interleaved", "smooth_softmax"):
        if flag in normal and normal[flag] != 1:
            normal[flag] = 0
    return normal


class MsGroupQueryAttention(AttentionRule):
    rule_name = "attention_ms_gqa"
    before_after = ("com.microsoft.GroupQueryAttention(query, key, value, past_key, past_value, seqlens_k, ...) -> "
                    "PopcountGroupQueryAttention(<the same inputs>)")
    new_op = GQA_OP_TYPE

    def takes(self, anchor: ir.Node) -> bool:
        return anchor.domain == MS and anchor.op_type == "GroupQueryAttention"

    def analyze(self, anchor: ir.Node, opset: int) -> tuple[MatchResult, Core | None]:
        result = MatchResult()
        why = _refusal(anchor)
        if why is not None:
            return result.fail(f"GroupQueryAttention '{anchor.name}' {why}", anchor), None
        inputs = list(anchor.inputs) + [None] * (SUPPORTED_INPUTS - len(anchor.inputs))
        query, key, value = inputs[:3]
        if query is None:
            return result.fail(f"GroupQueryAttention '{anchor.name}' has no query", anchor), None
        if (key is None) != (value is None):
            return result.fail(f"GroupQueryAttention '{anchor.name}' has only one of key / value", anchor), None
        for operand, what in ((query, "query"), (key, "key"), (value, "value"), (inputs[3], "past_key")):
            if operand is None:
                continue
            check = check_float(operand, f"GroupQueryAttention '{anchor.name}' {what}")
            if not check:
                return check, None
        attributes = anchor.attributes
        packed = key is None
        core = Core(q=Operand(query), k=Operand(query if packed else key), v=Operand(query if packed else value),
                    scale=attributes.get_float("scale", 0.0), is_causal=attributes.get_int("causal", 1),
                    nodes=[anchor], name_hint=anchor.name or "")
        core.notes.append("packed QKV" if packed else "separate Q, K, V")
        if attributes.get_int("do_rotary", 0) == 1:
            core.notes.append("rotary" + (" (interleaved)" if attributes.get_int("rotary_interleaved", 0) == 1 else ""))
        if attributes.get_int("local_window_size", -1) > 0:
            core.notes.append(f"local window {attributes.get_int('local_window_size', -1)}"
                              + (" (window-sized KV buffers)" if attributes.get_int("sliding_window_cache", 0) else ""))
        if attributes.get_float("softcap", 0.0) > 0.0:
            core.notes.append(f"softcap {attributes.get_float('softcap', 0.0):g}")
        if inputs[3] is None:
            core.notes.append("no past (prompt only)")
        return result, core

    def emit(self, op, core: Core, anchor: ir.Node, settings: AttentionSettings, name: str | None,
             opset: int) -> list[ir.Value]:
        inputs = list(anchor.inputs[:SUPPORTED_INPUTS])
        inputs[0] = core.q.value
        if inputs[1] is not None:
            inputs[1], inputs[2] = core.k.value, core.v.value
        while inputs and inputs[-1] is None:
            inputs.pop()
        attributes = _as_onnxruntime_runs_them(
            {attr.name: attr.value for attr in anchor.attributes.values() if attr.name in PASSED_ATTRIBUTES})
        return list(op.op(GQA_OP_TYPE, *inputs, _domain=DOMAIN, _version=DOMAIN_VERSION, _outputs=3, _name=name,
                          **attributes, **settings.gqa_attributes()))
