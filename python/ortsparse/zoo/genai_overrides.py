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
    """Override entries with genai node names: one layer's entry (``node``, or a ``match`` that is a
    plain name) keyed by its genai ``node``; entries that are not one layer (``*``) stay."""
    out: list[dict] = []
    fused: dict[str, dict] = {}
    for entry in entries:
        key = "node" if "node" in entry else "match"
        match = _OURS.match(entry.get(key, ""))
        if match is None:
            if key == "match" and any(c in entry.get("match", "") for c in "*?["):
                out.append(entry)
                continue
            raise ValueError(f"override {entry.get(key)!r} is not a layer of our TorchScript export")
        name = f"/model/layers.{match['layer']}/{_GENAI[match['proj']]}/MatMul"
        settings = {k: v for k, v in entry.items() if k != key}
        if name in fused:
            if fused[name] != settings:
                raise ValueError(f"{name}: q, k and v have different settings; the fused layer can take only one")
            continue
        fused[name] = settings
        out.append({"node": name, **settings})
    return out
