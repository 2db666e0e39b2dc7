"""One allocation from the probes of bench/allocation_probe_strategies.py (and the exponents of
bench/allocation_low_probes.py for "power-*"), at a target skip of the pool's bytes ("*-all": the head
a candidate; "*-body": attention and MLP only): checked on 6 check windows of tune's held-out parts
(256 positions, vs the reference; OUTDIR.json), then written as a genai folder as tune writes it for
`ortsparse quality` at the point of use (unless --no-write).

    python bench/allocation_write_checked.py INT8 FP32 first60.txt OUT/probe1.json STRATEGY FRACTION OUTDIR [--no-write]
"""
import json
import math
import sys
import types
from pathlib import Path

from allocation_experiment import WINDOW_LEN, choice_at, load_probes, log, power_curve, set_up
from ortsparse.calibration import allocation
from ortsparse.graph_rewrite.genai import rewrite_genai_folder
from ortsparse.tuning.tune import rewrite_config

CHECK_WINDOWS = 6


def main(argv: list[str]) -> int:
    model, reference, text, probes, strategy, fraction, out = argv[:7]
    fraction, out = float(fraction), Path(out)
    work = out.with_name(out.name + ".work")
    work.mkdir(exist_ok=True)
    experiment = set_up(model, reference, text, work, CHECK_WINDOWS, probe=False, scored="check")
    units, layers = experiment.units, experiment.prepared.layers
    load_probes(units, Path(probes))
    if strategy.startswith("power"):
        p = {row["name"]: row["p"] for row in json.loads((Path(probes).parent / "exponents.json").read_text())}
        curves = {id(u): power_curve(u, p[u.name]) for u in units}
    else:
        curves = {id(u): u.scale * u.error for u in units}
    pool = units if strategy.endswith("all") else experiment.body
    choice = choice_at(pool, fraction, curves)
    found = allocation.Allocation("l2", layers, units, choice, 0.0, 0.0, [], {})
    gated = experiment.loss.window_loss(allocation.thresholds_for(units, layers, choice))
    dense = json.loads((work / "dense_check.json").read_text())["dense_dppl"]
    result = {"strategy": strategy, "target": fraction, "skipped_pool": allocation.skipped_fraction(pool, choice),
              "skipped_all": allocation.skipped_fraction(units, choice), "held_out_windows": CHECK_WINDOWS,
              "window_len": WINDOW_LEN,
              "check_parts": experiment.plan.check_parts[:CHECK_WINDOWS].tolist(), "dense_dppl": dense,
              "gated_dppl": math.expm1(float(gated.mean())), "gated_window": gated.tolist(),
              "sparsity": found.sparsity(), "plan": found.plan().entries()}
    log(f"{strategy}: skipped {result['skipped_pool']:.1%} of the pool's bytes ({result['skipped_all']:.1%} of all); "
        f"held out ({CHECK_WINDOWS} windows): input {dense:+.2%}, gated {result['gated_dppl']:+.2%}")
    out.with_suffix(".json").write_text(json.dumps(result, indent=1, default=float))
    if "--no-write" not in argv:
        rewrite_genai_folder(experiment.source.folder, out, rewrite_config(types.SimpleNamespace(plan=found.plan()), None))
        log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
