"""One allocation from the probes of bench/allocation_probe_strategies.py (and the exponents of
bench/allocation_low_probes.py for "power-*"), at a target skip of the pool's bytes: checked on 6
check windows of tune's held-out parts (256 positions, vs the reference), then written as a genai
folder as tune writes it (gated calls of up to 8 rows) for `ortsparse quality` at the point of use.

    python bench/allocation_write_checked.py INT8 FP32 first60.txt OUT/probe1.json STRATEGY FRACTION OUTDIR [--no-write]
"""
import json, math, sys, time, types
from pathlib import Path
import numpy as np

from ortsparse.calibration import allocation
from ortsparse.measure.source import open_model
from ortsparse.measure.text import tokenize_file, resolve_bos
from ortsparse.measure.corpus import first_scored
from ortsparse.measure.perplexity import perplexity
from ortsparse.runtime import open_session
from ortsparse.tuning.tune import resolve_inputs, plan_text, with_bos, rewrite_config
from ortsparse.graph_rewrite.genai import rewrite_genai_folder

model, ref, text, probes, strategy, fraction, out = sys.argv[1:8]
fraction = float(fraction)
nwin = 6
log = lambda s: print(time.strftime("%H:%M:%S"), s, flush=True)
source, reference = open_model(model), open_model(ref)
tokens = tokenize_file(text, source.tokenizer)
bos = resolve_bos("auto", model, None, source.vocabulary)
inputs = resolve_inputs(source, tokens, Path(out + ".x"), reference=reference, windows=10, bos=bos)
sess = open_session(reference.decoder)
plan = plan_text(inputs, sess, log).plan
L = 256
T = L - (bos.id is not None)
layers = allocation.gated_layers(source, "all")
units = allocation.units_of(layers)
captured = allocation.capture_inputs(source.weights, units, list(with_bos(plan.calibration[:8, :T], bos.id)), max_rows=2048)
allocation.measure_curves(units, captured, "l2")
del captured
while strategy == "wait":  # decided while the capture ran (the probes' evaluation finishing elsewhere)
    d = Path("/tmp/h3/decision.txt")
    if d.exists() and d.read_text().strip():
        strategy, fraction = d.read_text().split()
        fraction = float(fraction)
        log(f"decision: {strategy} {fraction}")
    else:
        time.sleep(10)
rows = {r["name"]: r for r in json.load(open(probes))}
if strategy.startswith("power"):
    for e in json.load(open(Path(probes).parent / "exponents.json")):
        rows[e["name"]]["p"] = e["p"]
for u in units:
    r = rows[u.name]
    assert np.allclose(r["error"], u.error, rtol=1e-4, atol=1e-7), u.name
    u.probe, u.scale = r["probe"], r["scale"]
    if strategy.startswith("power"):
        u.exponent = r["p"]  # the class's median where the unit had no low probe (bench script 2)
pool = units if strategy.endswith("all") else [u for u in units if all(l.layer_class != "head" for l in u.layers)]
lo, hi = 1e-8, 1e3
for _ in range(60):
    mid = math.sqrt(lo * hi)
    if allocation.skipped_fraction(pool, allocation.allocate(pool, mid, floor=0.1)) < fraction:
        lo = mid
    else:
        hi = mid
choice = allocation.allocate(pool, hi, floor=0.1)
found = allocation.Allocation("l2", layers, units, choice, 0.0, 0.0, [], {})
skipped_pool = allocation.skipped_fraction(pool, choice)
skipped_all = allocation.skipped_fraction(units, choice)
log(f"{strategy}: skipped {skipped_pool:.1%} of the pool's bytes, {skipped_all:.1%} of all linear bytes")
# held-out: check windows (held-out parts), 256 positions, vs the reference
check = plan.check[:nwin, :T]
base = perplexity(reference, check.reshape(-1), nwin, L, session=sess, bos=bos)
del sess
probe = allocation.ProbeSession(source.weights, layers)
loss = allocation.LmLoss(probe, with_bos(check, bos.id), keep_logprobs=False, baseline_nll=base["window_nll"],
                         first=first_scored(bos.id))
dense = loss.dense_window_nll - base["window_nll"]
gated = loss.window_loss(allocation.thresholds_for(units, layers, choice))
result = {"strategy": strategy, "target": fraction, "skipped_pool": skipped_pool, "skipped_all": skipped_all,
          "held_out_windows": nwin, "window_len": L, "check_parts": plan.check_parts[:nwin].tolist(),
          "dense_dppl": math.expm1(float(dense.mean())), "gated_dppl": math.expm1(float(gated.mean())),
          "gated_window": gated.tolist(), "sparsity": found.sparsity(), "plan": found.plan().entries()}
log(f"held-out ({nwin} windows of {L}): input {result['dense_dppl']:+.2%}, gated {result['gated_dppl']:+.2%}")
Path(out + ".json").write_text(json.dumps(result, indent=1, default=float))
if "--no-write" in sys.argv:
    sys.exit(0)
del probe, loss
source.release_weights() if hasattr(source, "release_weights") else None
written = rewrite_genai_folder(source.folder, Path(out), rewrite_config(types.SimpleNamespace(plan=found.plan()), None))
log(f"wrote {out}")
