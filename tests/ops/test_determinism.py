"""Deterministic ops give bit-identical outputs across runs, sessions and intra-op thread counts
(work is split into a fixed number of chunks, never by thread count). docs/ops.md states this per op."""
from __future__ import annotations

import numpy as np
import pytest

import ortsparse

from .onnx_builders import kwta_model, proc_model


def kwta_case(rng, m):
    k, n = 1536, 200
    w = rng.standard_normal((k, n)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    return kwta_model(w, b, k_frac=0.37), {"X": x}


def proc_case(rng, m):
    from ortsparse.proc_sparse import build_proc_sparse

    k, n = 1536, 700
    p = build_proc_sparse(rng.standard_normal((k, n)).astype(np.float32), block=32, fanout=0.5, base_scale=0.05)
    x = rng.standard_normal((m, k)).astype(np.float32)
    return proc_model(p.indices, p.deltas, None, k=k, block=32, seed=p.seed, base_scale=p.base_scale,
                      kwta_k_frac=0.6), {"X": x}


def tt_case(rng, m):
    from .test_tt_op import random_cores, tt_model

    low_rank = random_cores(rng, [1536, 1], [1, 576], [1, 256, 1])  # decode steps on gemv spans
    x = rng.standard_normal((m, 1536)).astype(np.float32)
    return tt_model(low_rank), {"X": x}


def tt3_case(rng, m):
    from .test_tt_op import random_cores, tt_model

    cores = random_cores(rng, [12, 8, 6], [16, 12, 8], [1, 8, 8, 1])
    x = rng.standard_normal((m, 576)).astype(np.float32)
    return tt_model(cores), {"X": x}


CASES = {"kwta": kwta_case, "proc": proc_case, "tt": tt_case, "tt3": tt3_case}


@pytest.mark.parametrize("m", [1, 2, 9])
@pytest.mark.parametrize("case", CASES)
def test_bit_identical_across_runs_and_thread_counts(case, m):
    model, feeds = CASES[case](np.random.default_rng(11), m)
    outputs = []
    for threads in (1, 2, 3, 4):
        session = ortsparse.inference_session(model, intra_op_num_threads=threads)
        outputs += [session.run(None, feeds)[0] for _ in range(2)]
    for other in outputs[1:]:
        assert np.array_equal(outputs[0].view(np.uint32), other.view(np.uint32))
