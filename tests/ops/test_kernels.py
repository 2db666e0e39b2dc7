"""Every SIMD kernel against its scalar reference twin, tails included, on every ISA this CPU has."""
import numpy as np
import pytest

from ortsparse import _kernels as K

ISAS = K.supported_isas()
SIMD_ISAS = [isa for isa in ISAS if isa != "scalar"]
TILE = K.TOKEN_TILE


def _cpu_flags() -> set[str]:
    """The CPU flags Linux reports (an independent view of what the library's CpuFeatures detect)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def test_every_isa_the_cpu_has_is_tested():
    """The SIMD twins below run only for the ISAs the library reports: it must report each one the
    CPU has (else a detection bug would silently skip the AVX-512 tests)."""
    flags = _cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags on this OS to compare with")
    assert "scalar" in ISAS
    if {"avx2", "fma"} <= flags:
        assert "avx2" in ISAS
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        assert "avx512" in ISAS
    if {"avx512f", "avx512_vpopcntdq"} <= flags:
        assert "vpopcntdq" in K.popcnt_paths()
    if "popcnt" in flags:
        assert "popcnt" in K.popcnt_paths()


@pytest.mark.parametrize("isa", SIMD_ISAS)
@pytest.mark.parametrize("n", [1, 7, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100])
@pytest.mark.parametrize("keep", [0.0, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("accumulate", [False, True])
def test_gemv_rows_matches_scalar(isa, n, keep, accumulate, rng):
    k = 37
    w = rng.standard_normal((k, n)).astype(np.float32)
    rows = np.flatnonzero(rng.random(k) < keep).astype(np.int32)
    xv = rng.standard_normal(len(rows)).astype(np.float32)
    y0 = rng.standard_normal(n).astype(np.float32) if accumulate else None
    got = K.gemv_rows(isa, w, rows, xv, y0)
    ref = K.gemv_rows("scalar", w, rows, xv, y0)
    exact = (y0 if accumulate else 0) + xv.astype(np.float64) @ w[rows].astype(np.float64)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ref, exact, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("nrows", [0, 1, 3, 4, 5, 8, 9, 12, 13, 17])
def test_gemv_rows_all_row_groupings(isa, nrows, rng):
    n = 33
    w = rng.standard_normal((20, n)).astype(np.float32)
    xv = rng.standard_normal(nrows).astype(np.float32)
    got = K.gemv_rows(isa, w, None, xv)  # rows = None: the first nrows rows
    np.testing.assert_allclose(got, xv @ w[:nrows] if nrows else np.zeros(n), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", SIMD_ISAS)
@pytest.mark.parametrize("n", [1, 8, 15, 16, 17, 40, 63, 64, 65, 129])
@pytest.mark.parametrize("accumulate", [False, True])
def test_gemm_rows_matches_scalar(isa, n, accumulate, rng):
    k = 29
    w = rng.standard_normal((k, n)).astype(np.float32)
    rows = np.flatnonzero(rng.random(k) < 0.6).astype(np.int32)
    xv = rng.standard_normal((len(rows), TILE)).astype(np.float32)
    xv[rng.random(xv.shape) < 0.3] = 0.0  # tokens that skip a shared row
    y0 = rng.standard_normal((TILE, n)).astype(np.float32) if accumulate else None
    got = K.gemm_rows(isa, w, rows, xv, y0)
    ref = K.gemm_rows("scalar", w, rows, xv, y0)
    exact = (y0 if accumulate else 0) + xv.T.astype(np.float64) @ w[rows].astype(np.float64)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ref, exact, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", SIMD_ISAS)
@pytest.mark.parametrize("k", [1, 5, 16, 17, 33, 100])
@pytest.mark.parametrize("block", [1, 3, 16, 32])
def test_block_reductions_match_scalar(isa, k, block, rng):
    x = rng.standard_normal(k).astype(np.float32)
    for name in ("block_sumsq", "block_sumabs"):
        got = getattr(K, name)(isa, x, block)
        ref = getattr(K, name)("scalar", x, block)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    nb = -(-k // block)
    expected = [np.sum(x[b * block:(b + 1) * block] ** 2) for b in range(nb)]
    np.testing.assert_allclose(K.block_sumsq("scalar", x, block), expected, rtol=1e-5)


@pytest.mark.parametrize("isa", ISAS)
def test_nan_prefilled_output_is_overwritten(isa, rng):
    # accumulate=False must never read y: a NaN left in the buffer would leak through.
    w = rng.standard_normal((8, 19)).astype(np.float32)
    xv = rng.standard_normal(8).astype(np.float32)
    got = K.gemv_rows(isa, w, None, xv)
    assert np.isfinite(got).all()


def _special_values(rng, n):
    v = rng.standard_normal(n).astype(np.float32)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1e-45, -1e-45], dtype=np.float32)
    v[rng.integers(0, n, size=min(n, 8))] = specials[: min(n, 8)]
    return v


@pytest.mark.parametrize("isa", SIMD_ISAS)
@pytest.mark.parametrize("n", [1, 7, 8, 9, 15, 16, 17, 33, 100])
def test_selection_kernels_match_scalar(isa, n, rng):
    v = _special_values(rng, n)
    keys, lo, hi = K.order_keys(isa, v)
    ref_keys, ref_lo, ref_hi = K.order_keys("scalar", v)
    assert keys.tolist() == ref_keys.tolist() and (lo, hi) == (ref_lo, ref_hi)
    order = np.lexsort((np.arange(n), -v.astype(np.float64)))  # NaN sorts first with -v: same as keys
    finite = ~np.isnan(v)
    assert np.all(np.diff(keys[order][finite[order]].astype(np.int64)) <= 0)
    for t in [0, int(lo), int(keys[n // 2]), int(hi), 2**32 - 1]:
        assert K.count_at_least(isa, keys, t) == K.count_at_least("scalar", keys, t) == int(np.sum(keys >= t))
        for top in [t, 2**32 - 1]:
            expected = np.flatnonzero((keys >= t) & (keys <= top)).tolist()
            assert K.indices_in_range(isa, keys, t, top).tolist() == expected


@pytest.mark.parametrize("isa", ISAS)
class TestSelectTopK:
    def test_keeps_largest_in_index_order(self, isa):
        v = np.array([0.1, 5.0, 3.0, 5.0, -1.0, 4.0], dtype=np.float32)
        assert K.select_top_k(v, 3, isa).tolist() == [1, 3, 5]

    def test_ties_go_to_lower_index(self, isa):
        v = np.ones(10, dtype=np.float32)
        assert K.select_top_k(v, 4, isa).tolist() == [0, 1, 2, 3]
        v = np.array([2, 1, 1, 1, 1, 0], dtype=np.float32)
        assert K.select_top_k(v, 3, isa).tolist() == [0, 1, 2]
        v = np.array([0.0, -0.0, 1.0, -0.0, 0.0], dtype=np.float32)  # -0 ties with +0
        assert K.select_top_k(v, 3, isa).tolist() == [0, 1, 2]

    def test_nan_counts_as_largest(self, isa):
        v = np.array([1.0, np.nan, 3.0, 2.0, -np.nan, np.inf], dtype=np.float32)
        assert K.select_top_k(v, 3, isa).tolist() == [1, 4, 5]

    def test_k_edge_cases(self, isa):
        v = np.arange(5, dtype=np.float32)
        assert K.select_top_k(v, 0, isa).tolist() == []
        assert K.select_top_k(v, 5, isa).tolist() == [0, 1, 2, 3, 4]
        assert K.select_top_k(v, 9, isa).tolist() == [0, 1, 2, 3, 4]

    @pytest.mark.parametrize("n", [1, 2, 15, 16, 17, 300, 5000])
    def test_random_against_lexsort(self, isa, n, rng):
        for trial in range(20):
            v = rng.standard_normal(n).astype(np.float32)
            if trial % 3 == 0:
                v = np.round(v, 1)  # many exact ties
            if trial % 5 == 1:
                v = np.abs(v) ** 2  # non-negative scores as the gate produces
            k = int(rng.integers(1, n + 1))
            expected = np.sort(np.lexsort((np.arange(n), -v))[:k])
            assert K.select_top_k(v, k, isa).tolist() == expected.tolist()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("n", [1, 7, 8, 9, 15, 16, 17, 33, 100, 1536])
def test_silu_glu_matches_scalar_bits_and_float64(isa, n, rng):
    """silu(gate) * up (the SwiGLU epilogue): every ISA gives the scalar twin's bits, tails and
    special values included, and the scalar twin is within a few ulps of float64 (absolutely within
    1e-35 below g = -87, where exp_generic's exp flushes to 0)."""
    special = [0.0, -0.0, 1e-30, -1e-30, 20.0, -20.0, 87.5, -87.5, 100.0, -100.0, np.inf, -np.inf, np.nan]
    gate = np.concatenate([rng.standard_normal(n) * 4, special]).astype(np.float32)
    up = rng.standard_normal(gate.size).astype(np.float32)
    got, ref = K.silu_glu(isa, gate, up), K.silu_glu("scalar", gate, up)
    # Bits, except a NaN's sign and payload: x86 returns the first operand's NaN, and which operand
    # comes first in g * sigmoid(g) is the compiler's choice (it differs between -O2 and -O3 builds).
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(got), nan) and np.array_equal(got[~nan].view(np.uint32), ref[~nan].view(np.uint32))
    g = gate.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        want = g / (1.0 + np.exp(-g)) * up
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=5e-7, atol=1e-35)
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.array_equal(got[np.isinf(want)], want[np.isinf(want)])
