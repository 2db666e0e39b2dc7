"""onnxruntime's own GroupQueryAttention CPU test configurations (the parameter grid of
onnxruntime/test/python/transformers/test_gqa_cpu.py: prompt, token and interactive phases, batch
sizes, sequence lengths, head counts and sizes, local windows, rotary (half split or interleaved),
packed QKV, soft-capping, smooth softmax, custom tree attention (position_ids + attention_bias), with
the KV buffer shared between past and present or not) run through PopcountGroupQueryAttention with
select=none and compared with onnxruntime's op on the same inputs: outputs within 1e-5 of their
scale, present_key / present_value bit-identical.

The fast suite runs a fixed sample of the grid onnxruntime's CI runs (its ``pipeline_mode``); ``-m
slow`` runs that whole grid plus a sample of the full one; the full grid (about 200k runs, hours)
is a script: ``python -m tests.ops.test_gqa_ort_grid --full [--limit N] [--shard i/n]``.
No configuration of the grid is refused by PopcountGroupQueryAttention; the cases onnxruntime
1.32 refuses itself (rotary with head_size % 16 != 0) have no reference and are skipped.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import random
import sys

import numpy as np
import onnxruntime as ort
import pytest

from . import gqa_graphs as G


@dataclasses.dataclass(frozen=True)
class Case:
    phase: str  # prompt | past | interactive
    batch: int
    s: int  # new rows per call
    kv: int  # prompt: rows of the prompt; past/interactive: rows of the past buffer
    heads: tuple[int, int]
    head_size: int
    local: bool
    rotary: tuple[bool, bool]  # (do_rotary, interleaved)
    packed: bool
    softcap: float
    smooth: bool
    tree: bool  # custom tree attention: position_ids + attention_bias
    shared: bool

    def __str__(self) -> str:
        return (f"{self.phase}-b{self.batch}-s{self.s}-kv{self.kv}-n{self.heads[0]}x{self.heads[1]}-h{self.head_size}"
                f"{'-local' if self.local else ''}{'-rot' if self.rotary[0] else ''}{'i' if self.rotary[1] else ''}"
                f"{'-packed' if self.packed else ''}{'-cap' if self.softcap else ''}{'-smooth' if self.smooth else ''}"
                f"{'-tree' if self.tree else ''}-{'shared' if self.shared else 'separate'}")


ROTARY = [(False, False), (True, False), (True, True)]
FULL_HEADS = [(6, 6), (6, 3), (9, 9), (9, 3)]
FULL_SIZES = [32, 40, 64, 80, 96, 128, 160, 192, 224, 256]
PAST_SEQS = [(1, 128), (1, 339), (1, 1024), (1, 5000), (1, 800), (1, 256), (1, 799), (1, 2048)]


def grid(full: bool):
    """Every case of test_gqa_cpu.py's TestGQA (full) or of its pipeline_mode."""
    flags = itertools.product([False, True], ROTARY, [False, True], [0.0, 50.0], [False, True], [False, True],
                              [True, False])
    flags = list(flags)  # local, rotary, packed, softcap, smooth, tree, shared
    prompt = ([1, 3, 5], [127, 35, 2000, 200, 240, 8000], FULL_HEADS, FULL_SIZES) if full else \
        ([3], [127, 240], [(32, 8)], [128])
    for b, sq, heads, h in itertools.product(*prompt):
        for local, rot, packed, cap, smooth, tree, shared in flags:
            yield Case("prompt", b, sq, sq, heads, h, local, rot, packed, cap, smooth, tree, shared)
    past = ([1, 3, 5], PAST_SEQS, FULL_HEADS, FULL_SIZES) if full else ([1], [(1, 128)], [(9, 3)], [64])
    for b, (s, kv), heads, h in itertools.product(*past):
        for local, rot, packed, cap, smooth, tree, shared in flags:
            yield Case("past", b, s, kv, heads, h, local, rot, packed, cap, smooth, tree, shared)
    interactive = ([1], PAST_SEQS, FULL_HEADS, FULL_SIZES) if full else ([1], [(256, 2048)], [(32, 8)], [32])
    for b, (s, kv), heads, h in itertools.product(*interactive):
        for local, rot, packed, cap, smooth, tree, shared in flags:
            if cap == 0.0 and not smooth:  # the interactive test has neither
                yield Case("interactive", b, s, kv, heads, h, local, rot, packed, cap, smooth, tree, shared)


def run_case(case: Case, seed: int = 0) -> None:
    """One case as test_gqa_cpu.py sets it up; asserts ours == onnxruntime's."""
    rng = np.random.default_rng(seed)
    pick = random.Random(seed)
    n, n2 = case.heads
    h = case.head_size
    rotary_dim = (h // 16) * 16 if case.rotary[0] else None
    prompt = case.phase == "prompt"
    # left window: random in [1, kv] (their window_size = (left, 0))
    window = pick.randint(1, case.kv) if case.local else -1
    extra = ("position_ids", "attention_bias") if case.tree else ()
    cfg = G.Gqa(num_heads=n, kv_num_heads=n2, head_size=h, packed=case.packed, rotary=case.rotary[0],
                interleaved=case.rotary[1], rotary_dim=rotary_dim, local_window=window, softcap=case.softcap,
                past=case.shared or not prompt, extra=extra)
    b, s, kv = case.batch, case.s, case.kv
    if prompt:
        buffer = s + kv + 8
        lengths = [kv] * b
        past_rows = [0] * b
        total = s
        cos_rows = buffer if case.shared else kv
    else:
        buffer = kv
        past_rows = [int(x) for x in rng.integers(0, kv - s + 1, b)]
        lengths = [p + s for p in past_rows]
        total = kv if case.shared else kv + s
        cos_rows = kv if case.shared else kv + s
    cos = sin = None
    if cfg.rotary:
        cos, sin = G.rotary_tables(rng, cos_rows, cfg.half)
    past_k = past_v = None
    if cfg.past:
        shape = (b, n2, buffer if (case.shared or not prompt) else 0, h)
        past_k = rng.standard_normal(shape, dtype=np.float32)
        past_v = rng.standard_normal(shape, dtype=np.float32)
    smooth = {"smooth_softmax": 1} if case.smooth else {}
    steppers = []
    for ours in (False, True):
        attrs = {"select": "none"} if ours else {}
        sess = G.session(cfg, ours=ours, **smooth, **attrs)
        steppers.append(G.Stepper(sess, cfg, batch=b, buffer=buffer, shared=case.shared and cfg.past, cos=cos,
                                  sin=sin, past_k=None if past_k is None else past_k.copy(),
                                  past_v=None if past_v is None else past_v.copy()))
    width = cfg.hidden + (2 * cfg.kv_hidden if cfg.packed else 0)
    q = rng.standard_normal((b, s, width), dtype=np.float32)
    k = None if cfg.packed else rng.standard_normal((b, s, cfg.kv_hidden), dtype=np.float32)
    v = None if cfg.packed else rng.standard_normal((b, s, cfg.kv_hidden), dtype=np.float32)
    feeds = {}
    if case.tree:
        positions = np.asarray(past_rows)[:, None] + np.arange(s)[None, :]
        feeds["position_ids"] = positions.astype(np.int64)
        bias = np.where(rng.random((b, 1, s, total)) < 0.2, -np.inf, 0.0).astype(np.float32)
        bias[..., 0] = 0.0  # every row keeps a key
        feeds["attention_bias"] = bias
    seqlens = [x - 1 for x in lengths]
    try:
        theirs = steppers[0].step(q, k, v, seqlens, total, **feeds)
    except (ort.capi.onnxruntime_pybind11_state.InvalidArgument, RuntimeError) as error:
        # onnxruntime 1.32 refuses some of its own test grid (rotary needs head_size % 16 == 0): nothing to compare
        raise OrtRefuses(str(error).split("Status Message: ")[-1]) from None
    ours = steppers[1].step(q, k, v, seqlens, total, **feeds)
    # Non-finite outputs at the same places (NaN, +Inf, -Inf), the finite ones within 1e-5 of scale.
    for name, test in (("NaN", np.isnan), ("+Inf", np.isposinf), ("-Inf", np.isneginf)):
        assert np.array_equal(test(ours), test(theirs)), f"{case}: {name} pattern differs"
    finite = np.isfinite(theirs)
    scale = max(float(np.abs(theirs[finite]).max()) if finite.any() else 0.0, 1e-30)
    err = float(np.abs(ours[finite] - theirs[finite]).max()) if finite.any() else 0.0
    assert err <= 1e-5 * scale, f"{case}: output error {err / scale:.2e} of scale"
    assert np.array_equal(steppers[0].k, steppers[1].k), f"{case}: present_key differs"
    assert np.array_equal(steppers[0].v, steppers[1].v), f"{case}: present_value differs"


class OrtRefuses(Exception):
    """onnxruntime's op refused the case (so there is no reference output)."""


def check_case(case: Case) -> None:
    try:
        run_case(case)
    except OrtRefuses as why:
        pytest.skip(f"onnxruntime refuses: {why}")


PIPELINE = list(grid(full=False))
FAST = PIPELINE[::12]  # a fixed sample of onnxruntime's CI grid


@pytest.mark.parametrize("case", FAST, ids=str)
def test_onnxruntime_ci_grid_sample(case):
    check_case(case)


@pytest.mark.slow
@pytest.mark.parametrize("case", PIPELINE, ids=str)
def test_onnxruntime_ci_grid(case):
    check_case(case)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in grid(full=True) if c.kv <= 2048 and c.head_size <= 128][::997], ids=str)
def test_onnxruntime_full_grid_sample(case):
    check_case(case)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="the full grid (default: onnxruntime's CI grid)")
    parser.add_argument("--limit", type=int, default=0, help="run at most N cases")
    parser.add_argument("--shard", default="0/1", help="i/n: run every n-th case starting at i")
    args = parser.parse_args(argv)
    index, count = (int(x) for x in args.shard.split("/"))
    cases = list(grid(args.full))[index::count]
    if args.limit:
        cases = cases[:args.limit]
    failed = refused = 0
    for number, case in enumerate(cases):
        try:
            run_case(case)
        except AssertionError as error:
            failed += 1
            print(f"FAIL {error}", flush=True)
        except OrtRefuses:
            refused += 1
        if number % 100 == 0:
            print(f"{number}/{len(cases)} cases, {failed} failed, {refused} refused by onnxruntime", flush=True)
    print(f"{len(cases)} cases, {failed} failed, {refused} refused by onnxruntime (not compared)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
