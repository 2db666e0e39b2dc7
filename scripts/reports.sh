#!/usr/bin/env bash
# The full real-model reports (long: ~1 h on 2 cores; not part of CI). Builds the model cache,
# then writes every report under reports/: zoo validation, quality, calibration, end-to-end speed,
# the KWTA sweep (+ PNG) and the kernel benchmark. Needs the models extra:
#   pip install -e ".[models,plot]"   (torch==2.13.0 CPU, transformers 5.x, gguf, accelerate)
set -euo pipefail
cd "$(dirname "$0")/.."
M=$(python -c "from ortsparse.zoo.cache import models_dir; print(models_dir())")
mkdir -p reports
ortsparse models
ortsparse validate --kwta-k 0.9 --json reports/zoo.json --markdown reports/zoo.md
ortsparse quality "$M/minilm/torchscript.onnx" --kwta-target mlp --kwta-k 0.75 --json reports/minilm_mlp_k0.75.json
ortsparse calibrate -o reports/smollm2_calibrated.json --max-dppl 0.02 --greedy --calib-windows 4 --eval-windows 8
ortsparse bench --config reports/smollm2_calibrated.json --kwta=off -o reports/bench_smollm2_calibrated
ortsparse bench ours ours-int4 ours-int8 --kwta-target both --kwta-k 0.75 -o reports/bench_smollm2_both_k0.75
python bench/baselines.py -o reports/baselines
ortsparse sweep --scopes mlp down both --keeps 0.9 0.75 0.6 0.5 0.4 --blocks 1 32 --scores l2 -o reports/sweep_kwta_smollm2
python bench/bench_kwta_kernel.py -o reports/kwta_kernel
