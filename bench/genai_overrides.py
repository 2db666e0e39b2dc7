"""Carry a per-layer override file of our TorchScript export over to the onnxruntime-genai graph.

The genai builder fuses q/k/v into one `qkv_proj` MatMul and renames the layers
(`/model/model/layers.N/self_attn/q_proj/MatMul` -> `/model/layers.N/attn/qkv_proj/MatMul`,
`.../mlp/gate_proj/MatMul` -> `/model/layers.N/mlp/gate_proj/MatMul`). A calibrated KWTA
threshold is a quantile of the layer's input, and q, k and v read the same input, so the three
thresholds of a layer are equal (refused otherwise) and become the fused layer's.

The translation is ortsparse.zoo.genai_overrides.translate.

usage: python bench/genai_overrides.py reports/smollm2_calibrated.json -o reports/smollm2_calibrated.genai.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ortsparse.zoo.genai_overrides import translate


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", help="override file of our export (e.g. from ortsparse calibrate)")
    parser.add_argument("-o", "--output", required=True)
    args = parser.parse_args(argv)
    try:
        entries = json.loads(Path(args.overrides).read_text())["layers"]
        result = translate(entries)
    except (OSError, ValueError, KeyError, TypeError) as error:
        print(f"genai_overrides: error: {error}", file=sys.stderr)
        return 2
    Path(args.output).write_text(json.dumps({"layers": result}, indent=1) + "\n")
    print(f"wrote {args.output}: {len(result)} entries (from {len(entries)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
