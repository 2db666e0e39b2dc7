"""ProcSparseMatMul: the hash (golden values), the builder, the kernels on every ISA and the ORT op,
each against independent numpy / pure-Python references."""
import math
import os
import subprocess
import sys

import numpy as np
import pytest

import ortsparse
from ortsparse import _kernels as K
from ortsparse import proc_sparse as P

from .onnx_builders import proc_model
from .reference import kwta_block_scores, kwta_kept_blocks, kwta_keep_count, separated_input

ISAS = K.supported_isas()


# ----------------------------------------------------------------------------------------------
# The hash is part of the file format: these values must never change.
# ----------------------------------------------------------------------------------------------

GOLDEN_HASH = [  # (seed, n, k) -> h
    ((0, 0, 0), 0xE220A8397B1DCDAF),  # = Vigna's splitmix64 seeded with 0: first two outputs
    ((0, 0, 1), 0x6E789E6AA1B965F4),
    ((1, 2, 3), 0x12E80FFCFBBBD251),
    ((42, 1535, 575), 0x9EE68C1381022397),
    ((2 ** 63 - 1, 7, 100000), 0xCB8B39D4BD33BB8E),
]
GOLDEN_BASE = [  # (seed, base_scale, n, k) -> float32 bits of base(n, k)
    ((0, 1.0, 0, 0), 1061437776),
    ((42, 0.05, 3, 0), 1022149847),
    ((42, 0.05, 3, 1), 3173468634),
    ((7, 0.125, 1000, 1535), 3173335132),
    ((2 ** 40 + 5, 2.0, 12, 34), 3218855792),
]


@pytest.mark.parametrize("args,h", GOLDEN_HASH)
def test_golden_hash(args, h):
    assert P.splitmix64(*args) == h


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("args,bits", GOLDEN_BASE)
def test_golden_base_values_on_every_isa(isa, args, bits):
    seed, scale, n, k = args
    got = K.proc_base_values(isa, seed, scale, n, k, 1)
    assert got.view(np.uint32)[0] == bits
    assert P.hash_base(seed, scale, n, k).view(np.uint32) == bits


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("count", [1, 7, 8, 9, 15, 16, 17, 33, 100])
def test_base_values_match_numpy_and_pure_python(isa, count):
    seed, scale, n, k0 = 123456789, 0.03, 77, 1000
    got = K.proc_base_values(isa, seed, scale, n, k0, count)
    np.testing.assert_array_equal(got, P.hash_base(seed, scale, n, np.arange(k0, k0 + count)))
    for i in (0, count - 1):
        h = P.splitmix64(seed, n, k0 + i)
        u = np.float32((h >> 40) * 2.0 ** -23 - 1.0)  # exact in float64, then exact in float32
        assert got[i] == np.float32(np.float32(scale) * u)


def test_unit_values_cover_minus_one_to_one():
    u = P.hash_base(9, 1.0, np.arange(200), np.arange(200)[:, None]).ravel()
    assert u.min() >= -1.0 and u.max() < 1.0
    assert abs(u.mean()) < 0.02 and abs(u.std() - 1 / math.sqrt(3)) < 0.02


# ----------------------------------------------------------------------------------------------
# Builder against a numpy reference of the same rule.
# ----------------------------------------------------------------------------------------------

def reference_build(w, block, fanout, base_scale, seed, shed_eps, watermark, importance=None):
    k, n = w.shape
    nb = math.ceil(k / block)
    rows = np.arange(k)
    indices, deltas, soft, hard = [], [], 0, 0
    for j in range(n):
        base = P.hash_base(seed, base_scale, j, rows) if base_scale else np.zeros(k, np.float32)
        d = (w[:, j] - base).astype(np.float32)
        score = np.array([np.sum(d[b * block:(b + 1) * block].astype(np.float64) ** 2) for b in range(nb)])
        if importance is not None:
            score = score * importance.astype(np.float64) ** 2
        kept = np.sort(np.lexsort((np.arange(nb), -score))[:fanout])
        out = np.zeros((fanout, block), np.float32)
        for f, b in enumerate(kept):
            seg = d[b * block:(b + 1) * block].copy()
            small = np.abs(seg) < shed_eps
            soft += int(small.sum())
            seg[small] = 0
            out[f, :len(seg)] = seg
        flat = out.ravel()
        nz = np.flatnonzero(flat)
        if watermark and len(nz) > watermark:
            order = nz[np.lexsort((nz, -np.abs(flat[nz])))]
            flat[order[watermark:]] = 0
            hard += len(nz) - watermark
        indices.append(kept)
        deltas.append(flat.reshape(fanout, block))
    return np.array(indices, np.uint16), np.array(deltas, np.float32), soft, hard


@pytest.mark.parametrize("k,n,block,fanout", [(64, 10, 16, 2), (100, 7, 16, 3), (37, 5, 1, 9), (50, 4, 50, 1),
                                              (90, 6, 8, 12)])
@pytest.mark.parametrize("base_scale", [0.0, 0.3])
@pytest.mark.parametrize("shed_eps,watermark", [(0.0, 0), (0.4, 0), (0.0, 7), (0.3, 5)])
def test_builder_matches_reference(k, n, block, fanout, base_scale, shed_eps, watermark, rng):
    w = rng.standard_normal((k, n)).astype(np.float32)
    p = P.build_proc_sparse(w, block=block, fanout=fanout, base_scale=base_scale, seed=11, shed_eps=shed_eps,
                            watermark=watermark, delta_dtype="float32", chunk_units=3)
    idx, d, soft, hard = reference_build(w, block, fanout, base_scale, 11, shed_eps, watermark)
    np.testing.assert_array_equal(p.indices, idx)
    np.testing.assert_array_equal(p.deltas, d)
    assert (p.soft_trims, p.hard_trims) == (soft, hard)
    if watermark:
        assert (np.count_nonzero(p.deltas.reshape(n, -1), axis=1) <= watermark).all()


def test_builder_importance_changes_the_selection(rng):
    k, n, block = 64, 8, 8
    w = rng.standard_normal((k, n)).astype(np.float32)
    imp = np.ones(8, np.float32)
    imp[5] = 100.0  # block 5 always wins
    p = P.build_proc_sparse(w, block=block, fanout=2, importance=imp, delta_dtype="float32")
    assert (p.indices == 5).any(axis=1).all()
    idx, d, _, _ = reference_build(w, block, 2, 0.0, 0, 0.0, 0, importance=imp)
    np.testing.assert_array_equal(p.indices, idx)


def test_builder_fanout_fraction_and_memory_accounting(rng):
    w = rng.standard_normal((576, 64)).astype(np.float32)
    p16 = P.build_proc_sparse(w, block=32, fanout=0.5)
    p32 = P.build_proc_sparse(w, block=32, fanout=0.5, delta_dtype="float32")
    assert p16.fanout == 9 and p16.deltas.dtype == np.float16
    # indices: 2 bytes per kept block; deltas: block values per kept block
    assert p16.packed_bytes == 64 * 9 * 2 + 64 * 9 * 32 * 2
    assert p16.mem_ratio == pytest.approx((9 * 2 + 9 * 64) / (576 * 4))
    assert p32.mem_ratio == pytest.approx((9 * 2 + 9 * 128) / (576 * 4))
    assert p16.mem_ratio <= 0.5 < p32.mem_ratio  # fp32 deltas at half the blocks miss the bar by the indices
    np.testing.assert_array_equal(p16.deltas, p32.deltas.astype(np.float16))


def test_builder_rejects_bad_arguments(rng):
    w = rng.standard_normal((10, 4)).astype(np.float32)
    with pytest.raises(ValueError, match="block=11"):
        P.build_proc_sparse(w, block=11)
    with pytest.raises(ValueError, match="fanout=0"):
        P.build_proc_sparse(w, block=2, fanout=0)
    with pytest.raises(ValueError, match="seed"):
        P.build_proc_sparse(w, block=2, seed=-1)


# ----------------------------------------------------------------------------------------------
# Kernels: every ISA against the numpy reconstruction (and so against the scalar twin).
# ----------------------------------------------------------------------------------------------

def built(rng, k, n, block, fanout, base_scale, dtype, seed=3):
    w = rng.standard_normal((k, n)).astype(np.float32)
    p = P.build_proc_sparse(w, block=block, fanout=fanout, base_scale=base_scale, seed=seed, delta_dtype=dtype)
    return p, P.reconstruct(p).astype(np.float64)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("k,block,fanout", [(1, 1, 1), (33, 1, 10), (40, 7, 3), (100, 16, 4), (95, 32, 2),
                                            (130, 17, 5), (64, 64, 1), (200, 40, 5),
                                            (160, 16, 7), (200, 32, 5), (256, 64, 3), (300, 64, 4),
                                            (100, 1, 45), (70, 1, 64)])
@pytest.mark.parametrize("base_scale", [0.0, 0.25])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_kernel_matches_reconstruction(isa, k, block, fanout, base_scale, dtype, rng):
    n = 21
    p, w = built(rng, k, n, block, fanout, base_scale, dtype)
    bias = rng.standard_normal(n).astype(np.float32)
    for m in (1, 2, 3, 4, 5, 9):
        x = rng.standard_normal((m, k)).astype(np.float32)
        mm = K.ProcMatMul(p.indices, p.deltas, k, block, p.seed, base_scale, isa=isa)
        y = mm(x, bias)
        np.testing.assert_allclose(y, x.astype(np.float64) @ w + bias, rtol=1e-5, atol=1e-5 * math.sqrt(k))
        assert mm.last_stats() == (math.ceil(m / 4) * n * p.fanout, math.ceil(m / 4) * n)


@pytest.mark.parametrize("isa", ISAS)
def test_kernel_nan_in_a_dropped_block_does_not_leak(isa, rng):
    # Rows outside a unit's kept blocks are never read for that unit.
    k, n, block = 64, 8, 16
    w = np.zeros((k, n), np.float32)
    w[:16] = 1.0  # every unit keeps block 0 only (fanout 1)
    p = P.build_proc_sparse(w, block=block, fanout=1, delta_dtype="float32")
    x = np.ones((1, k), np.float32)
    x[0, 40] = np.nan
    y = K.ProcMatMul(p.indices, p.deltas, k, block, isa=isa)(x)
    np.testing.assert_array_equal(y, np.full((1, n), 16.0, np.float32))


# ----------------------------------------------------------------------------------------------
# The ORT op.
# ----------------------------------------------------------------------------------------------

def extra(p):
    """The builder's attributes other than the ones proc_model sets itself."""
    return {a: v for a, v in p.attributes().items() if a not in ("K", "N", "block")}


def run(model, x):
    # The session ends here, so its node's entry leaves ortsparse.metrics(): tests read the total.
    return ortsparse.inference_session(model).run(None, {"X": x})[0]


@pytest.mark.parametrize("k,n,block", [(1, 1, 1), (17, 5, 4), (64, 48, 16), (100, 130, 32), (576, 40, 32)])
@pytest.mark.parametrize("m", [1, 2, 5])
def test_all_blocks_no_base_no_shed_is_dense_matmul(k, n, block, m, rng):
    w = rng.standard_normal((k, n)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    p = P.build_proc_sparse(w, block=block, fanout=1.0, delta_dtype="float32")
    assert p.fanout == math.ceil(k / block)
    np.testing.assert_array_equal(P.reconstruct(p), w)
    x = rng.standard_normal((1, m, k)).astype(np.float32)
    y = run(proc_model(p.indices, p.deltas, b, k=k, block=block, x_shape=(1, "s", None)), x)
    np.testing.assert_allclose(y, x.astype(np.float64) @ w + b, rtol=1e-5, atol=2e-6 * math.sqrt(k))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("base_scale", [0.0, 0.05])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_op_matches_numpy_reconstruction(dtype, base_scale, m, rng):
    k, n, block = 150, 70, 32
    w = rng.standard_normal((k, n)).astype(np.float32) * 0.05
    b = rng.standard_normal(n).astype(np.float32)
    p = P.build_proc_sparse(w, block=block, fanout=2, base_scale=base_scale, seed=2 ** 40 + 3, shed_eps=0.01,
                            delta_dtype=dtype)
    x = rng.standard_normal((m, k)).astype(np.float32)
    model = proc_model(p.indices, p.deltas, b, k=k, block=block, node_name="pm", **extra(p))
    ortsparse.reset_metrics()
    y = run(model, x)
    np.testing.assert_allclose(y, x.astype(np.float64) @ P.reconstruct(p) + b, rtol=1e-5, atol=1e-5)
    stats = ortsparse.metrics()["total/ProcSparseMatMul"]
    assert stats["proc.fanout_effective"] == 2
    assert stats["proc.mem_ratio"] == pytest.approx(p.mem_ratio)
    # trims = stored zero deltas on real rows; shed_eps = 0.01 on N(0, 0.05) weights sheds ~16%
    rows_real = sum(min(block, k - int(bb) * block) for bb in p.indices.ravel())
    zeros = sum(int(np.count_nonzero(p.deltas[j, f, :min(block, k - int(bb) * block)] == 0))
                for j in range(n) for f, bb in enumerate(p.indices[j]))
    assert stats["proc.trims"] == zeros and 0.05 * rows_real < zeros < 0.3 * rows_real
    if base_scale:  # a shed entry is the base, not zero
        j, f = np.argwhere((p.deltas == 0).any(axis=2))[0]
        bb = int(p.indices[j, f])
        r = int(np.flatnonzero(p.deltas[j, f] == 0)[0])
        assert P.reconstruct(p)[bb * block + r, j] == P.hash_base(p.seed, base_scale, j, bb * block + r)


@pytest.mark.parametrize("kwta_block", [1, 8, 16])
@pytest.mark.parametrize("m", [1, 2, 6])
@pytest.mark.parametrize("base_scale", [0.0, 0.1])
@pytest.mark.parametrize("block", [16, 1])
def test_composed_kwta_gate(kwta_block, m, base_scale, block, rng):
    k, n, k_frac = 96, 40, 0.5
    w = rng.standard_normal((k, n)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    p = P.build_proc_sparse(w, block=block, fanout=5, base_scale=base_scale, seed=5, delta_dtype="float32")
    wh = P.reconstruct(p).astype(np.float64)
    x = separated_input(rng, m, k, kwta_block)
    keep = kwta_keep_count(k, kwta_block, k_frac, 0)
    expected = np.empty((m, n))
    for t in range(m):
        blocks = kwta_kept_blocks(kwta_block_scores(x[t], kwta_block, "l2"), keep)
        mask = np.zeros(k, bool)
        for g in blocks:
            mask[g * kwta_block:(g + 1) * kwta_block] = True
        expected[t] = (x[t] * mask) @ wh + b
    model = proc_model(p.indices, p.deltas, b, k=k, block=block, node_name="comp", kwta_k_frac=k_frac,
                       kwta_block=kwta_block, **extra(p))
    ortsparse.reset_metrics()
    np.testing.assert_allclose(run(model, x), expected, rtol=1e-5, atol=1e-4)
    stats = ortsparse.metrics()["total/ProcSparseMatMul"]
    assert stats["kwta.keep_ratio"] == pytest.approx(keep / math.ceil(k / kwta_block))
    if kwta_block == block == 16 and m <= 4:
        # one tile: proc blocks computed = kept ∩ the union of the tile's gated blocks
        assert stats["proc.fanout_effective"] < 5
    # the pybind twin (same engine) agrees
    for isa in ISAS:
        mm = K.ProcMatMul(p.indices, p.deltas, k, block, 5, base_scale, kwta_k_frac=k_frac, kwta_block=kwta_block,
                          isa=isa)
        np.testing.assert_allclose(mm(x, b), expected, rtol=1e-5, atol=1e-4)


def test_composed_gate_at_decode_counts_the_intersection(rng):
    k, n, block = 64, 30, 16
    w = rng.standard_normal((k, n)).astype(np.float32)
    p = P.build_proc_sparse(w, block=block, fanout=2, delta_dtype="float32")
    x = separated_input(rng, 1, k, block)
    gate_blocks = set(kwta_kept_blocks(kwta_block_scores(x[0], block, "l2"), 2).tolist())
    expected = np.mean([len(gate_blocks & set(p.indices[j].tolist())) for j in range(n)])
    model = proc_model(p.indices, p.deltas, None, k=k, block=block, node_name="dec", kwta_k_frac=0.5)
    ortsparse.reset_metrics()
    run(model, x)
    assert ortsparse.metrics()["total/ProcSparseMatMul"]["proc.fanout_effective"] == pytest.approx(expected)


def test_leading_dims_and_empty_input(rng):
    k, n, block = 48, 20, 16
    w = rng.standard_normal((k, n)).astype(np.float32)
    p = P.build_proc_sparse(w, block=block, fanout=2, delta_dtype="float32")
    model = proc_model(p.indices, p.deltas, None, k=k, block=block, x_shape=("a", "b", "c", None))
    x = rng.standard_normal((2, 3, 4, k)).astype(np.float32)
    np.testing.assert_allclose(run(model, x), x @ P.reconstruct(p), rtol=1e-5, atol=1e-5)
    assert run(model, np.zeros((2, 0, 4, k), np.float32)).shape == (2, 0, 4, n)


class TestBadInput:
    def create(self, model):
        with pytest.raises(Exception) as info:
            ortsparse.inference_session(model)
        return str(info.value)

    def packed(self, rng, k=64, n=6, block=16, fanout=2):
        w = rng.standard_normal((k, n)).astype(np.float32)
        return P.build_proc_sparse(w, block=block, fanout=fanout, delta_dtype="float32")

    def test_index_out_of_range(self, rng):
        p = self.packed(rng)
        idx = p.indices.copy()
        idx[3, 1] = 4
        msg = self.create(proc_model(idx, p.deltas, k=64, block=16, node_name="bad1"))
        assert "ProcSparseMatMul node 'bad1'" in msg and "indices[3, 1] = 4" in msg and "4 blocks" in msg

    def test_index_not_ascending(self, rng):
        p = self.packed(rng)
        idx = p.indices.copy()
        idx[2] = [3, 1]
        msg = self.create(proc_model(idx, p.deltas, k=64, block=16, node_name="bad2"))
        assert "bad2" in msg and "strictly ascending" in msg and "indices[2, 1] = 1" in msg

    def test_deltas_shape(self, rng):
        p = self.packed(rng)
        msg = self.create(proc_model(p.indices, p.deltas[:, :, :8], k=64, block=16, node_name="bad3"))
        assert "bad3" in msg and "input deltas has shape [6, 2, 8]" in msg and "[6, 2, 16]" in msg

    def test_deltas_dtype(self, rng):
        p = self.packed(rng)
        msg = self.create(proc_model(p.indices, p.deltas.astype(np.float64), k=64, block=16, node_name="bad4"))
        assert "bad4" in msg and "deltas must be float32 or float16" in msg

    def test_indices_dtype(self, rng):
        p = self.packed(rng)
        with pytest.raises(Exception, match="indices"):
            ortsparse.inference_session(proc_model(p.indices.astype(np.int32), p.deltas, k=64, block=16))

    def test_deltas_not_constant(self, rng):
        p = self.packed(rng)
        msg = self.create(proc_model(p.indices, p.deltas, k=64, block=16, node_name="bad5", constant=False))
        assert "bad5" in msg and "constant initializer" in msg

    @pytest.mark.parametrize("attrs,text", [
        ({"fanout": 3}, "fanout=3"), ({"K": 0}, "K=0"), ({"block": 65}, "block=65"),
        ({"N": 5}, "expected [N=5, fanout]"), ({"kwta_k_frac": 1.5}, "kwta_k_frac=1.5"),
        ({"kwta_score": "max"}, "score='max'"), ({"kwta_k_frac": 0.5, "kwta_block": 0}, "kwta_block=0"),
    ])
    def test_bad_attributes(self, attrs, text, rng):
        p = self.packed(rng)
        args = {"k": 64, "block": 16, **attrs}
        model = proc_model(p.indices, p.deltas, node_name="bad6", **args)
        msg = self.create(model)
        assert "bad6" in msg and text in msg

    def test_wrong_x_width(self, rng):
        p = self.packed(rng)
        session = ortsparse.inference_session(proc_model(p.indices, p.deltas, k=64, block=16, x_shape=(1, "k")))
        with pytest.raises(Exception, match=r"\[1, 63\].*K = 64"):
            session.run(None, {"X": np.zeros((1, 63), np.float32)})


ISA_SCRIPT = r"""
import numpy as np, ortsparse, sys, ctypes
sys.path.insert(0, {tests!r})
from ops.onnx_builders import proc_model
from ortsparse import proc_sparse as P
rng = np.random.default_rng(7)
w = rng.standard_normal((77, 45)).astype(np.float32); b = rng.standard_normal(45).astype(np.float32)
for dtype in ("float32", "float16"):
    for base_scale in (0.0, 0.1):
        p = P.build_proc_sparse(w, block=10, fanout=3, base_scale=base_scale, seed=9, delta_dtype=dtype)
        wh = P.reconstruct(p).astype(np.float64)
        for m in (1, 2, 7):
            x = rng.standard_normal((m, 77)).astype(np.float32)
            model = proc_model(p.indices, p.deltas, b, k=77, block=10, seed=9, base_scale=base_scale)
            y = ortsparse.inference_session(model).run(None, {{"X": x}})[0]
            np.testing.assert_allclose(y, x @ wh + b, rtol=1e-5, atol=1e-4)
lib = ctypes.CDLL(ortsparse.get_library_path()); lib.OrtSparseActiveIsa.restype = ctypes.c_char_p
print(lib.OrtSparseActiveIsa().decode())
"""


@pytest.mark.parametrize("isa", ISAS)
def test_op_on_every_isa(isa):
    tests_dir = os.path.dirname(os.path.dirname(__file__))
    out = subprocess.run([sys.executable, "-c", ISA_SCRIPT.format(tests=tests_dir)],
                         env=dict(os.environ, ORTSPARSE_ISA=isa), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == isa
