"""The op library's counters (``ortsparse.metrics()``) as the harness reports them: keep ratios per
op type and node, and weighted by the gated layers' weight sizes."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._library import DOMAIN, metrics
from ..graph_rewrite.fuse import FUSED_NAME_SEPARATOR
from ..runtime import load_proto


def metrics_summary(raw: Mapping[str, Mapping[str, Any]], model: Any = None) -> dict[str, Any]:
    """Compact view of ``ortsparse.metrics()``: per op type the overall keep ratio (blocks kept /
    blocks total, every call and token), per node its keep ratio (a fused node's also under each
    layer it holds), and — given the model — the keep ratio weighted by each gated layer's weight
    size (the fraction of gated weight bytes read)."""
    ops: dict[str, dict[str, Any]] = {}
    nodes: dict[str, float] = {}
    for name, values in raw.items():
        if name.startswith("total/"):
            op = name.split("/", 1)[1]
            total = float(values.get("blocks_total", 0) or 0)
            kept = float(values.get("blocks_kept", 0) or 0)
            ops[op] = {"keep_ratio": kept / total if total else None, "calls": values.get("calls"),
                       "blocks_total": total, "blocks_kept": kept}
        elif values.get("calls"):  # "<op type>/<node name>": the entry names its node
            total = float(values.get("blocks_total", 0) or 0)
            nodes[values.get("node", name)] = float(values.get("blocks_kept", 0) or 0) / total if total else float("nan")
    for name in [n for n in nodes if FUSED_NAME_SEPARATOR in n]:  # a fused node speaks for each layer in it
        for part in name.split(FUSED_NAME_SEPARATOR):
            nodes.setdefault(part, nodes[name])
    summary: dict[str, Any] = {"ops": ops, "nodes": nodes}
    if model is not None and nodes:
        proto = load_proto(model)
        dims = {init.name: tuple(init.dims) for init in proto.graph.initializer}
        sizes = {}
        for node in proto.graph.node:
            if node.domain == DOMAIN and node.name in nodes and len(node.input) > 1:
                shape = dims.get(node.input[1])
                if shape and len(shape) == 2:
                    sizes[node.name] = shape[0] * shape[1]
        weight = sum(sizes.values())
        if weight:
            summary["weighted_keep_ratio"] = sum(nodes[n] * s for n, s in sizes.items()) / weight
            summary["gated_weights"] = weight
    return summary


def snapshot(model: Any = None) -> dict[str, Any]:
    """:func:`metrics_summary` of the counters now."""
    return metrics_summary(metrics(), model)


def keep_ratios(raw: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """KWTA keep ratio per node that ran since the last reset (slots of nodes from earlier sessions
    stay registered with zero counts; they are left out)."""
    return {values["node"]: values["kwta.keep_ratio"] for values in raw.values()
            if "node" in values and "kwta.keep_ratio" in values and values.get("blocks_total", 0) > 0}

