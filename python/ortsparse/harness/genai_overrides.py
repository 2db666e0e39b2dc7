"""Carry a per-layer override file of our TorchScript export over to the onnxruntime-genai graph.

The genai builder fuses q/k/v into one `qkv_proj` MatMul and renames the layers
(`/model/model/layers.N/self_attn/q_proj/MatMul` -> `/model/layers.N/attn/qkv_proj/MatMul`,
`.../mlp/gate_proj/MatMul` -> `/model/layers.N/mlp/gate_proj/MatMul`). A calibrated KWTA
threshold is a quantile of the layer's input, and q, k and v read the same input, so the three
thresholds of a layer are equal (refused otherwise) and become the fused layer's.
The command line is bench/genai_overrides.py.
"""
from __future__ import annotations

import re

_OURS = re.compile(r"^/model/model/layers\.(?P<layer>\d+)/(?P<block>self_attn|mlp)/(?P<proj>\w+)_proj/MatMul$")
_GENAI = {"q": "attn/qkv_proj", "k": "attn/qkv_proj", "v": "attn/qkv_proj", "o": "attn/o_proj",
          "gate": "mlp/gate_proj", "up": "mlp/up_proj", "down": "mlp/down_proj"}


def translate(entries: list[dict]) -> list[dict]:
    """Override entries with genai node names; entries that are not one layer (``*``) stay."""
    out: list[dict] = []
    fused: dict[str, dict] = {}
    for entry in entries:
        match = _OURS.match(entry.get("match", ""))
        if match is None:
            if any(c in entry.get("match", "") for c in "*?["):
                out.append(entry)
                continue
            raise ValueError(f"override {entry.get('match')!r} is not a layer of our TorchScript export")
        name = f"/model/layers.{match['layer']}/{_GENAI[match['proj']]}/MatMul"
        if name in fused:
            if fused[name] != {k: v for k, v in entry.items() if k != "match"}:
                raise ValueError(f"{name}: q, k and v have different settings; the fused layer can take only one")
            continue
        fused[name] = {k: v for k, v in entry.items() if k != "match"}
        out.append({"match": name, **fused[name]})
    return out
