"""What the probes predict (no model run): the loss the one-probe line and the two-probe power fit
predict for the allocations bench/allocation_probe_strategies.py measured, and the allocations the
power fit makes at given skips of all linear bytes (the head a candidate).

    python bench/allocation_predictions.py OUT   (OUT of the two bench scripts; points_linear.jsonl = its points.jsonl
                                                  before the low-probe script appended to it)
"""
import collections, json, math, sys

import numpy as np

D = sys.argv[1]
DENSE = json.load(open(f'{D}/dense_calibration.json'))['dense_dppl']  # the int8 model alone (strategies script)
GRID = np.asarray([round(0.025 * i, 3) for i in range(37)])
rows = json.load(open(f'{D}/probe1.json'))
ex = {e['name']: e['p'] for e in json.load(open(f'{D}/exponents.json'))}
pts = [json.loads(l) for l in open(f'{D}/points_linear.jsonl')]
def cls(n):
    for k,v in (('qkv','q/k/v'),('o_proj','attn out'),('gate','gate/up'),('down','down'),('lm_head','head')):
        if k in n: return v
# unit-level: layer names -> unit row
unit_of = {}
for r in rows:
    for l in r['name'].split('+'):
        unit_of[l] = r['name']
def lin(r):  return r['scale'] * np.asarray(r['error'])
def pw(r):
    e = np.asarray(r['error']); f = r['probe']
    return f['loss'] * (np.maximum(e, 0) / max(f['error'], 1e-12)) ** ex[r['name']]
for p in pts:
    sp = {}
    sp = p['sparsity']
    pl = sum(lin(r)[int(np.argmin(abs(GRID - sp.get(r['name'], 0))))] for r in rows)
    pp = sum(pw(r)[int(np.argmin(abs(GRID - sp.get(r['name'], 0))))] for r in rows)
    dense = DENSE
    meas = math.log1p(p['dppl']) - math.log1p(dense)
    print(f"{p['strategy']:12s} {p['skipped_all']:.3f} of all: measured {meas:.4f} nats beyond int8, linear predicts {pl:.4f}, power predicts {pp:.4f}")
# allocations under power curves
total = sum(r['bytes'] for r in rows)
def allocate(curves, pool, mu, floor=0.1):
    tb = sum(r['bytes'] for r in pool); ch = {}
    for r in pool:
        obj = curves(r) - mu * r['bytes'] / tb * GRID
        obj[(GRID > 0) & (GRID < floor)] = np.inf
        ch[r['name']] = int(np.argmin(obj))
    return ch
def at(curves, pool, frac):
    lo, hi = 1e-8, 1e3
    for _ in range(60):
        mid = math.sqrt(lo*hi); c = allocate(curves, pool, mid)
        sk = sum(r['bytes']*GRID[c[r['name']]] for r in pool)/sum(r['bytes'] for r in pool)
        lo, hi = (mid, hi) if sk < frac else (lo, mid)
    return allocate(curves, pool, hi)
for name, curves in (('linear', lin), ('power', pw)):
    for frac in (0.15, 0.2, 0.25):
        c = at(curves, rows, frac)
        by = collections.defaultdict(list)
        for r in rows: by[cls(r['name'])].append(GRID[c[r['name']]])
        sk = sum(r['bytes']*GRID[c[r['name']]] for r in rows)/total
        pred = sum(curves(r)[c[r['name']]] for r in rows)
        print(name, frac, f"skipped {sk:.3f}, predicted {pred:.4f}", {k: round(float(np.mean(v)),3) for k, v in by.items()})
print()
for frac in (0.16, 0.17, 0.18, 0.19):
    c = at(pw, rows, frac)
    sk = sum(r['bytes']*GRID[c[r['name']]] for r in rows)/total
    pred = sum(pw(r)[c[r['name']]] for r in rows)
    by = collections.defaultdict(list)
    for r in rows: by[cls(r['name'])].append(GRID[c[r['name']]])
    print('power', frac, f"skipped {sk:.3f}, predicted {pred:.4f} -> total dppl ~{math.expm1(pred + math.log1p(DENSE)):+.2%}", {k: round(float(np.mean(v)),3) for k, v in by.items()})
