#!/usr/bin/env bash
# The main job on a default model: install, rewrite the tiny Llama-like model (GQA, SwiGLU, tied
# head; exported by TorchScript, committed in models/tiny) with KwtaBlockMatMul on its MLP layers,
# verify the rewritten model against the original in ONNX Runtime, and print the metrics.
# usage: scripts/demo.sh [MODEL.onnx] [extra rewrite-onnx flags]
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -e .
model=${1:-models/tiny/llama_tiny.torchscript.onnx}
shift || true
out=$(mktemp -d)/$(basename "${model%.onnx}").kwta.onnx
rewrite-onnx "$model" -o "$out" --kwta=on --kwta-k 1.0 --kwta-target both --verify 2 "$@"
rewrite-onnx "$model" -o "$out" --kwta=on --kwta-k 0.75 --kwta-target mlp --verify 2 "$@"
echo "rewritten model: $out"
