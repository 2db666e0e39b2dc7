"""Second probes below the 2% one (output error ~0.4%, a third of each class and the head) and the
allocation with loss ~ error^p through both probes (the class's median p for units not probed
twice), measured at equal skipped bytes as bench/allocation_probe_strategies.py does (its OUT,
whose probe1.json it reads; OUT/probe_low.json, OUT/exponents.json, OUT/points.jsonl).

    python bench/allocation_low_probes.py INT8 FP32 first60.txt OUT 4 0.004
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
allocation.probe_units = lambda *a, **k: None  # probes loaded from probe1.json
prepared = allocation.prepare_lm(source, with_bos(plan.calibration[:8, :T], bos.id), with_bos(plan.probe[:, :T], bos.id),
                                 target="all", log=log)
units, layers = prepared.units, prepared.layers
head = [u for u in units if any(l.layer_class == "head" for l in u.layers)]
log(f"head units: {[u.name for u in head]}, bytes {[u.weight_bytes for u in head]}, total {sum(u.weight_bytes for u in units)}")
loss = allocation.LmLoss(prepared.session, calib, keep_logprobs=False, baseline_nll=base, first=first_scored(bos.id))
log(f"dense dppl vs ref: {math.expm1(float((loss.dense_window_nll - base).mean())):+.4f}")
probe_loss = allocation.LmLoss(prepared.session, with_bos(plan.probe[:, :T], bos.id), keep_logprobs=True,
                               first=first_scored(bos.id)).kl
rows = json.load(open(out / "probe1.json"))
for u, r in zip(units, rows):
    assert r["name"] == u.name and np.allclose(r["error"], u.error, rtol=1e-4, atol=1e-7), u.name
    u.probe, u.scale = r["probe"], r["scale"]
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


LOW = float(sys.argv[6]) if len(sys.argv) > 6 else 0.004
log(f"second probes at output error {LOW}")
grid = np.asarray(allocation.GRID)
def klass(u):
    return next(c for c in ("qkv", "o_proj", "gate", "down", "lm_head", "") if c in u.name)


seen = {}
for i, u in enumerate(units):
    seen[klass(u)] = seen.get(klass(u), -1) + 1
    if seen[klass(u)] % 3:
        continue  # a third of each class probed: the class's median exponent for the rest
    j1 = int(np.argmin(np.abs(grid - u.probe["sparsity"])))
    below = [j for j in range(1, j1) if u.error[j] >= LOW]
    j2 = int(below[0]) if below else max(1, j1 - 4)
    l2 = probe_loss(allocation.thresholds_for(units, layers, {u.input_name: j2}))
    u.probe2 = {"sparsity": float(grid[j2]), "error": float(u.error[j2]), "loss": float(l2)}
    rows[i]["probe_low"] = u.probe2
    log(f"low probe {u.name}: s {u.probe2['sparsity']} err {u.probe2['error']:.5f} KL {l2:.5f} (2% probe: s {u.probe['sparsity']} KL {u.probe['loss']:.5f})")
json.dump(rows, open(out / "probe_low.json", "w"))


for u in units:
    if hasattr(u, "probe2"):
        u.p = allocation.loss_exponent(u.probe2, u.probe)
for u in units:
    if not hasattr(u, "p"):
        u.p = float(np.median([v.p for v in units if hasattr(v, "p") and klass(v) == klass(u)]))


def power_curve(u):
    far = u.probe  # through the 2% probe, with the (class's) exponent
    return far["loss"] * (np.maximum(u.error, 0) / max(far["error"], 1e-12)) ** u.p


power = {id(u): power_curve(u) for u in units}
log("exponents: " + " ".join(f"{klass(u)}:{u.p:.2f}" for u in units))
json.dump([{"name": u.name, "p": u.p, "low": getattr(u, "probe2", None)} for u in units], open(out / "exponents.json", "w"))
eval_at("power-all", units, 0.2, power)
eval_at("power-body", body, 0.15, power)
eval_at("power-all", units, 0.15, power)
eval_at("power-all", units, 0.25, power)
log("done")
