"""Allocation strategies compared at equal skipped bytes (genai int8 vs its fp32 reference), as run
for docs/results.md "Where the budget goes on Gemma-3-270M" (2026-11-28, loaded machine).

    python bench/allocation_probe_strategies.py INT8 FP32 first60.txt OUT [WINDOWS=4]

tune's window plan on the text (first 60% of Python's docs), windows of 256 positions
(bench/allocation_experiment.py); curves on 8 calibration windows, every unit probed once as tune does
(output error 2%, KL on one window: OUT/probe1.json), candidates = attention + MLP + the LM head
(target all). Then allocations at a target skip of the pool's bytes, each measured (dppl vs the
reference on WINDOWS calibration windows: OUT/points.jsonl): "linear-body" (the head left out, as
tune did) and "linear-all" (the head a candidate). bench/allocation_low_probes.py probes further.
"""
import json
import sys
from pathlib import Path

from allocation_experiment import log, measure_at, set_up


def main(argv: list[str]) -> int:
    model, reference, text, out = argv[0], argv[1], argv[2], Path(argv[3])
    windows = int(argv[4]) if len(argv) > 4 else 4
    out.mkdir(exist_ok=True)
    experiment = set_up(model, reference, text, out, windows)
    units = experiment.units
    head = [unit for unit in units if unit not in experiment.body]
    log(f"head units: {[u.name for u in head]}, bytes {[u.weight_bytes for u in head]}, "
        f"total {sum(u.weight_bytes for u in units)}")
    (out / "probe1.json").write_text(json.dumps([{"name": u.name, "bytes": u.weight_bytes, "error": u.error.tolist(),
                                                  "probe": u.probe, "scale": u.scale} for u in units]))
    linear = {id(u): u.scale * u.error for u in units}
    for strategy, pool in (("linear-body", experiment.body), ("linear-all", units)):
        for fraction in (0.15, 0.25):
            measure_at(experiment, strategy, pool, fraction, linear, out / "points.jsonl")
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
