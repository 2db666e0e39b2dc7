#!/usr/bin/env bash
# Re-measure the end-to-end claims with the real decode loop (docs/measure.md "Speed"). Run on a
# quiet machine: ~45 min on 2 cores (calibration on the genai graph ~15 of them). Writes under reports/:
#   bench_smollm2_calibrated_loop      calibrated KWTA (reports/smollm2_calibrated.json) on our export
#   smollm2_calibrated.genai.json      the same thresholds under the genai graph's layer names
#   quality_genai_calibrated.json      their dppl / top-1 agreement on genai fp32 (8 x 512 tokens)
#   bench_genai_calibrated_loop        ... and decode speed there, through ORT and the Generator
#   smollm2_genai_calibrated.json      KWTA calibrated on the genai graph itself (+ .report.json)
#   bench_genai_calibrated_own_loop    ... and its decode speed
#   bench_smollm2_attention_loop       PopcountAttention on our export at 2048 / 4096, genai fp32 beside
#   loop_stability                     two back-to-back runs of the loop (spread of the medians)
set -euo pipefail
cd "$(dirname "$0")/.."
M=$(python -c "from ortsparse.harness.cache import models_dir; print(models_dir())")
ortsparse models smollm2 corpus baselines genai

ortsparse bench ours --config reports/smollm2_calibrated.json --kwta=off --contexts 128 1024 --threads 1 2 \
  -o reports/bench_smollm2_calibrated_loop

python bench/genai_overrides.py reports/smollm2_calibrated.json -o reports/smollm2_calibrated.genai.json
ortsparse quality "$M/smollm2/genai-fp32" --config reports/smollm2_calibrated.genai.json --kwta=off \
  --json reports/quality_genai_calibrated.json
ortsparse bench genai-fp32 --rewrite genai-fp32 --config reports/smollm2_calibrated.genai.json --kwta=off \
  --contexts 128 1024 --threads 1 2 -o reports/bench_genai_calibrated_loop

ortsparse calibrate "$M/smollm2/genai-fp32" -o reports/smollm2_genai_calibrated.json --max-dppl 0.02 --margin 0.5 \
  --calib-windows 4 --eval-windows 8
ortsparse bench genai-fp32 --rewrite genai-fp32 --config reports/smollm2_genai_calibrated.json --kwta=off \
  --contexts 128 1024 --threads 1 -o reports/bench_genai_calibrated_own_loop

ortsparse bench ours genai-fp32 --kwta=off --attn=popcount --attn-min-keys 0 --attn-topk 256 --attn-candidates 4 \
  --attn-keep-first 4 --attn-keep-recent 64 --attn-proj-bits 256 --contexts 2048 4096 --threads 1 \
  -o reports/bench_smollm2_attention_loop

ortsparse bench ours genai-fp32 --contexts 128 1024 4096 --threads 1 --runs 2 -o reports/loop_stability
