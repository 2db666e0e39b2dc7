"""Quantized gated layers that read the same input, fused into one op.

Before::

    X -> KwtaBlockMatMul(B1, scales1[, zp1], N=N1) -> Y1        (e.g. mlp/gate_proj)
    X -> KwtaBlockMatMul(B2, scales2[, zp2], N=N2) -> Y2        (e.g. mlp/up_proj)

After::

    X -> KwtaBlockMatMul([B1; B2], [scales1; scales2][, [zp1; zp2]], N=N1+N2) -> Y
    Y -> Split(axis=-1, split=[N1, N2]) -> Y1, Y2

When the pair is an MLP's SwiGLU (Y1 and Y2 used only by ``Mul(Y1 * Sigmoid(Y1), Y2)``, or by
``com.microsoft.QuickGelu(alpha=1)`` in place of ``Y1 * Sigmoid(Y1)``, as ORT's optimizer writes it;
N1 == N2), the activation moves into the op too — no Split, Sigmoid or Muls::

    X -> KwtaBlockMatMul([B1; B2], ..., N=2*N1, glu="silu") -> silu(Y1) * Y2

(The product's columns are bit-identical; the SwiGLU is the op's own exp, within a few float ulps
of ORT's Sigmoid/QuickGelu. `rewrite-onnx --no-fuse` keeps one node per layer and ORT's activation.)

The nodes must be KwtaBlockMatMul's quantized form (MatMulNBits' tensors) with the same attributes
but N and no bias: the gate then keeps the same rows for both (it reads only X), so one call plans
the rows once, and each kept row is one run of N1 + N2 columns instead of two shorter ones (longer
runs stream faster; docs/results.md has what the fusion bought end to end).
Each output column is computed exactly as before: the fused graph gives bit-identical outputs.
onnxruntime-genai's int8/int4 graphs have such pairs (gate_proj and up_proj of every MLP; their
q/k/v projections are already one MatMulNBits). The fused node is named after its parts joined by
FUSED_NAME_SEPARATOR, so the op's per-node metrics can be attributed back to them.

Near misses stay unfused and say why in the report: a bias, different gate settings (e.g.
thresholds calibrated apart), different bits/block_size/zero-point presence, or an opset below 13
(Split's sizes as an input). A pair that is fused but not as a SwiGLU says why too (e.g. the gate's
output has another use).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import onnx_ir as ir

from .graph_utils import MS_DOMAIN, is_onnx_op, is_op, single_consumer
from .replace import GraphEditor, NodeBuilder, WeightPreparer
from .rules import DOMAIN

FUSED_NAME_SEPARATOR = " + "
RULE_NAME = "fuse_shared_input"
_QUANTIZED_INPUTS = 4  # X, B, scales, zero_points (a fifth input is a bias)


@dataclasses.dataclass
class Fusion:
    """One group of layers fused into one node (``fused``), or left apart (``why`` says why)."""

    layers: tuple[str, ...]
    fused: str | None
    why: str = ""
    glu: str = ""       # "silu": the MLP's activation moved into the op
    why_no_glu: str = ""  # fused with a Split: why the SwiGLU form did not apply ("" if not a pair)


def _attributes(node: ir.Node) -> dict[str, object]:
    return {name: attr.value for name, attr in node.attributes.items()}


def _initializer_array(value: ir.Value | None) -> np.ndarray | None:
    if value is None or value.const_value is None:
        return None
    return value.const_value.numpy()


def _why_apart(nodes: Sequence[ir.Node]) -> str:
    """Why these KwtaBlockMatMul nodes on one X cannot be fused ('' when they can)."""
    first = _attributes(nodes[0])
    first_has_zp = len(nodes[0].inputs) > 3 and nodes[0].inputs[3] is not None
    for node in nodes:
        inputs = list(node.inputs)
        if len(inputs) < 3 or inputs[1] is None or inputs[1].const_value is None \
                or inputs[1].const_value.dtype != ir.DataType.UINT8:
            return f"{node.name} is not the quantized form"
        if len(inputs) > _QUANTIZED_INPUTS and inputs[_QUANTIZED_INPUTS] is not None:
            return f"{node.name} has a bias"
        if any(_initializer_array(v) is None for v in inputs[1:3]):
            return f"{node.name}'s weights are not initializers"
        has_zp = len(inputs) > 3 and inputs[3] is not None
        if has_zp != first_has_zp:
            return "zero points on some layers only"
        if has_zp and _initializer_array(inputs[3]) is None:
            return f"{node.name}'s zero points are not an initializer"
        attributes = _attributes(node)
        differing = sorted(k for k in set(first) | set(attributes) if k != "N" and first.get(k) != attributes.get(k))
        if differing:
            return f"{node.name} differs in {', '.join(differing)}"
    return ""


@dataclasses.dataclass
class _SwiGlu:
    gate: ir.Node              # the layer inside the sigmoid
    up: ir.Node
    activation: list[ir.Node]  # Sigmoid + Mul, or QuickGelu
    product: ir.Node           # Mul(silu(gate), up): its output is what the fused op writes


def _silu_of(gate_out: ir.Value) -> tuple[list[ir.Node], ir.Value] | None:
    """The nodes computing silu(gate_out) when they are its only uses, and their output."""
    if gate_out.is_graph_output():
        return None
    quick_gelu = single_consumer(gate_out)
    if is_op(quick_gelu, {f"{MS_DOMAIN}.QuickGelu"}):
        alpha = quick_gelu.attributes.get("alpha")
        return ([quick_gelu], quick_gelu.outputs[0]) if (alpha.value if alpha is not None else 1.702) == 1.0 else None
    users = list(gate_out.consumers())
    sigmoid = [u for u in users if is_onnx_op(u, "Sigmoid")]
    mul = [u for u in users if is_onnx_op(u, "Mul")]
    if len(gate_out.uses()) != 2 or len(sigmoid) != 1 or len(mul) != 1:
        return None
    if {id(v) for v in mul[0].inputs} != {id(gate_out), id(sigmoid[0].outputs[0])} \
            or single_consumer(sigmoid[0].outputs[0]) is not mul[0]:
        return None
    return [sigmoid[0], mul[0]], mul[0].outputs[0]


def _swiglu(nodes: Sequence[ir.Node]) -> tuple[_SwiGlu | None, str]:
    """The pair as a SwiGLU (gate, up, activation, product), or None and why not."""
    if len(nodes) != 2:
        return None, ""
    if int(_attributes(nodes[0])["N"]) != int(_attributes(nodes[1])["N"]):
        return None, "the two layers' N differ (not a gate/up pair)"
    for gate, up in ((nodes[0], nodes[1]), (nodes[1], nodes[0])):
        silu = _silu_of(gate.outputs[0])
        if silu is None:
            continue
        activation, silu_out = silu
        product = single_consumer(silu_out)
        if is_onnx_op(product, "Mul") and {id(v) for v in product.inputs} == {id(silu_out), id(up.outputs[0])} \
                and single_consumer(up.outputs[0]) is product:
            return _SwiGlu(gate, up, activation, product), ""
    return None, "no Mul(silu(one), other) is the only use of both outputs"


def _stacked(arrays: Sequence[np.ndarray], rows: Sequence[int]) -> np.ndarray:
    """The arrays stacked along N (each read as [its N, -1]), in the first one's shape when it had
    more than one dimension, flat otherwise."""
    stacked = np.concatenate([a.reshape(n, -1) for a, n in zip(arrays, rows)], axis=0)
    return stacked.reshape((sum(rows), *arrays[0].shape[1:])) if arrays[0].ndim > 1 else stacked.reshape(-1)


def fuse_shared_input(editor: GraphEditor, preparer: WeightPreparer, opset: int,
                      candidates: Sequence[str]) -> list[Fusion]:
    """Fuse every group of two or more quantized KwtaBlockMatMul nodes among ``candidates`` (the
    names of the nodes this rewrite emitted) reading the same X with the same settings (a SwiGLU
    pair with its activation); returns what was fused and what was left apart (and why)."""
    graph = editor.graph
    wanted = set(candidates)
    by_input: dict[int, list[ir.Node]] = {}
    for node in graph:
        if node.domain == DOMAIN and node.op_type == "KwtaBlockMatMul" and node.name in wanted \
                and node.inputs and node.inputs[0] is not None:
            by_input.setdefault(id(node.inputs[0]), []).append(node)
    results: list[Fusion] = []
    for nodes in by_input.values():
        if len(nodes) < 2 or not any(len(n.inputs) > 1 and n.inputs[1] is not None and n.inputs[1].const_value is not None
                                     and n.inputs[1].const_value.dtype == ir.DataType.UINT8 for n in nodes):
            continue  # float-weight layers on one X (not this pass's business)
        layer_names = tuple(node.name for node in nodes)
        why = _why_apart(nodes) or ("" if opset >= 13 else f"opset {opset} < 13")
        if why:
            results.append(Fusion(layer_names, None, why))
            continue
        glu, why_no_glu = _swiglu(nodes)
        if glu is not None:
            nodes = [glu.gate, glu.up]  # the gate's columns first: the op's SwiGLU reads them as gate
            layer_names = (glu.gate.name, glu.up.name)
        n_cols = [int(_attributes(node)["N"]) for node in nodes]
        inputs = [list(node.inputs) for node in nodes]
        stem = nodes[0].inputs[1].name
        fused_inputs: list[ir.Value | None] = [nodes[0].inputs[0]]
        for index, suffix in ((1, "fused"), (2, "scales_fused"), (3, "zero_points_fused")):
            if index >= len(inputs[0]) or inputs[0][index] is None:
                break
            fused_inputs.append(preparer.new_initializer(
                f"{stem}_{suffix}", _stacked([_initializer_array(i[index]) for i in inputs], n_cols)))
        attributes = {**_attributes(nodes[0]), "N": sum(n_cols)}
        fused_name = editor.new_node_name(FUSED_NAME_SEPARATOR.join(layer_names))
        build = NodeBuilder()
        preparer.replaced_values([v for node in nodes for v in node.inputs[1:] if v is not None])
        if glu is not None:
            y = build.op("KwtaBlockMatMul", *fused_inputs, _domain=DOMAIN, _name=fused_name, glu="silu", **attributes)
            editor.replace([*nodes, *glu.activation, glu.product], build.nodes, glu.product.outputs[0], y, RULE_NAME)
            results.append(Fusion(layer_names, fused_name, glu="silu"))
            continue
        y = build.op("KwtaBlockMatMul", *fused_inputs, _domain=DOMAIN, _name=fused_name, **attributes)
        sizes = build.Constant(value=ir.tensor(np.asarray(n_cols, dtype=np.int64), name=f"{fused_name}/split_sizes"),
                               _name=editor.new_node_name(f"{fused_name}/split_sizes"))
        parts = build.op("Split", y, sizes, axis=-1, _outputs=len(nodes), _name=editor.new_node_name(f"{fused_name}/split"))
        old_outputs = [node.outputs[0] for node in nodes]
        editor.replace(nodes, build.nodes, old_outputs, list(parts), RULE_NAME)
        results.append(Fusion(layer_names, fused_name, why_no_glu=why_no_glu))
    return results
