"""Allocation strategies compared at equal skipped bytes (genai int8 vs its fp32 reference), as run
for docs/results.md "A gating budget that transfers to Gemma-3-270M" (2026-11-28, loaded machine).

    python bench/allocation_probe_strategies.py INT8 FP32 first60.txt OUT [WINDOWS=4]

tune's window plan on the text (first 60% of Python's docs), cut to windows of 256 positions (the
machine was loaded); curves captured on 8 calibration windows, every unit probed once as tune does
(output error 2%, KL on one window: OUT/probe1.json), candidates = attention + MLP + the LM head
(target all). Then allocations at a target skip of the pool's bytes, each measured (dppl vs the
reference on WINDOWS calibration windows: OUT/points.jsonl): "linear-body" (the head left out, as
tune did) and "linear-all" (the head a candidate). The script's last stage (second probes at 8%
error) was stopped: bench/allocation_low_probes.py probes below instead.
"""
import json, math, pickle, sys, time
from pathlib import Path
import numpy as np

from ortsparse.calibration import allocation
from ortsparse.measure.source import open_model
from ortsparse.measure.text import tokenize_file, resolve_bos
from ortsparse.measure.corpus import first_scored
from ortsparse.measure.perplexity import perplexity
from ortsparse.runtime import open_session
from ortsparse.tuning.tune import resolve_inputs, plan_text, with_bos

model, ref, text, out = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])
nwin = int(sys.argv[5]) if len(sys.argv) > 5 else 4
out.mkdir(exist_ok=True)
log = lambda s: print(time.strftime("%H:%M:%S"), s, flush=True)
source, reference = open_model(model), open_model(ref)
tokens = tokenize_file(text, source.tokenizer)
bos = resolve_bos("auto", model, None, source.vocabulary)
inputs = resolve_inputs(source, tokens, out / "x", reference=reference, windows=10, bos=bos)
sess = open_session(reference.decoder)
windows = plan_text(inputs, sess, log)
plan = windows.plan
L = 256  # shorter windows than tune's 512: the machine is loaded (experiment cost)
T = L - (bos.id is not None)
calib = with_bos(plan.calibration[:nwin, :T], bos.id)
base = perplexity(reference, plan.calibration[:nwin, :T].reshape(-1), nwin, L, session=sess, bos=bos)["window_nll"]
del sess
prepared = allocation.prepare_lm(source, with_bos(plan.calibration[:8, :T], bos.id), with_bos(plan.probe[:, :T], bos.id),
                                 target="all", log=log)
units, layers = prepared.units, prepared.layers
head = [u for u in units if any(l.layer_class == "head" for l in u.layers)]
log(f"head units: {[u.name for u in head]}, bytes {[u.weight_bytes for u in head]}, total {sum(u.weight_bytes for u in units)}")
loss = allocation.LmLoss(prepared.session, calib, keep_logprobs=False, baseline_nll=base, first=first_scored(bos.id))
log(f"dense dppl vs ref: {math.expm1(float((loss.dense_window_nll - base).mean())):+.4f}")
probe_loss = allocation.LmLoss(prepared.session, with_bos(plan.probe[:, :T], bos.id), keep_logprobs=True,
                               first=first_scored(bos.id)).kl
rows = []
for u in units:
    rows.append({"name": u.name, "bytes": u.weight_bytes, "error": u.error.tolist(), "probe": u.probe, "scale": u.scale})
json.dump(rows, open(out / "probe1.json", "w"))

body = [u for u in units if u not in head]


def eval_at(strategy, pool, fraction, curves):
    """choice hitting ~fraction of pool bytes; measured window losses."""
    saved = {id(u): (u.scale, u.error) for u in pool}
    for u in pool:
        u.scale, u.error = 1.0, curves[id(u)]
    lo, hi = 1e-8, 1e3
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        c = allocation.allocate(pool, mid, floor=0.1)
        if allocation.skipped_fraction(pool, c) < fraction:
            lo = mid
        else:
            hi = mid
    choice = allocation.allocate(pool, hi, floor=0.1)
    pred = allocation.predicted_loss(pool, choice)
    for u in pool:
        u.scale, u.error = saved[id(u)]
    th = allocation.thresholds_for(units, layers, choice)
    w = loss.window_loss(th)
    sk = allocation.skipped_fraction(pool, choice)
    total = sum(u.weight_bytes for u in units)
    sk_all = sum(u.weight_bytes * u.grid[choice.get(u.input_name, 0)] for u in pool) / total
    spars = {u.name: float(u.grid[choice.get(u.input_name, 0)]) for u in pool}
    r = {"strategy": strategy, "target": fraction, "skipped_pool": sk, "skipped_all": sk_all,
         "dppl": math.expm1(float(w.mean())), "window": w.tolist(), "predicted": pred, "sparsity": spars}
    log(f"{strategy} @ {fraction:.2f}: skipped {sk:.1%} of pool ({sk_all:.1%} of all), dppl {r['dppl']:+.2%} (pred {pred:.4f})")
    with open(out / "points.jsonl", "a") as f:
        f.write(json.dumps(r) + "\n")
    return r


linear = {id(u): u.scale * u.error for u in units}
for f in (0.15, 0.25):
    eval_at("linear-body", body, f, linear)
for f in (0.15, 0.25):
    eval_at("linear-all", units, f, linear)

# second probe: where the error reaches 4x the level (power-law fit of loss vs error)
log("second probes")
grid = np.asarray(allocation.GRID)
for i, u in enumerate(units):
    allowed = np.flatnonzero((grid >= 0.1) & (grid <= 0.9))
    j1 = int(np.argmin(np.abs(grid - u.probe["sparsity"])))
    reaching = [j for j in allowed if u.error[j] >= 0.08 and j > j1]
    j2 = int(reaching[0] if reaching else min(j1 + 6, len(grid) - 1))
    l2 = probe_loss(allocation.thresholds_for(units, layers, {u.input_name: j2}))
    u.probe2 = {"sparsity": float(grid[j2]), "error": float(u.error[j2]), "loss": float(l2)}
    rows[i]["probe2"] = u.probe2
    if (i + 1) % 10 == 0:
        log(f"probed {i + 1}/{len(units)}")
json.dump(rows, open(out / "probe2.json", "w"))


def power_curve(u):
    e1, l1 = u.probe["error"], max(u.probe["loss"], 1e-9)
    e2, l2 = u.probe2["error"], max(u.probe2["loss"], 1e-9)
    p = math.log(l2 / l1) / math.log(e2 / e1) if e2 > e1 * 1.05 else 1.0
    p = min(max(p, 0.5), 3.0)
    return l1 * (np.maximum(u.error, 0) / max(e1, 1e-12)) ** p


power = {id(u): power_curve(u) for u in units}
for f in (0.15, 0.25):
    eval_at("power-body", body, f, power)
for f in (0.15, 0.25):
    eval_at("power-all", units, f, power)
log("done")
