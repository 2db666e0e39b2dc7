"""The quant weight backend (MatMulNBits weights): every SIMD kernel against the scalar reference,
tails included, and the backend against ONNX Runtime's own com.microsoft.MatMulNBits.

Tolerances.
* decode (fp32 products of the dequantized weights) against float64 x @ W, against the scalar
  kernel, and against MatMulNBits accuracy_level 0: |diff| <= 2e-5 * (|x| @ |W|) per element, i.e.
  a few fp32 roundings of the largest possible sum.
* prefill (int8 activations per K-block) against the scalar kernel (the same int8 values):
  2e-5 * (|x| @ |W|). Against float64 x @ W and MatMulNBits accuracy_level 4, the bound of
  symmetric int8 rounding, e(t, n) = sum_b amax(x[t, b]) / 254 * sum_{r in b} |W[r, n]|:
  |ours - exact| <= e (+ fp32 slack) and |ours - ORT| <= 2 e (+ slack), both sides rounding x once.
"""
import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from ortsparse import _kernels as K

ISAS = K.supported_isas()
SIMD_ISAS = [isa for isa in ISAS if isa != "scalar"]
NO_PREFILL = 1 << 30  # prefill_min_tokens that keeps every token on the decode path


def make_weights(rng, k, n, bits, block, zero_points, flat_scales=False):
    """Random MatMulNBits tensors: B [N, nb, blob], scales, packed uint8 zero points (or None)."""
    nb = (k + block - 1) // block
    b = rng.integers(0, 256, (n, nb, block * bits // 8), dtype=np.uint8)
    scales = (rng.standard_normal((n, nb)) * 0.05).astype(np.float32)
    if flat_scales:
        scales = scales.reshape(-1)
    zp = rng.integers(0, 256, (n, (nb * bits + 7) // 8), dtype=np.uint8) if zero_points else None
    return b, scales, zp


def dequantize(b, scales, zp, k, n, bits, block):
    """W [K, N] straight from MatMulNBits' definition (independent of the backend's packing)."""
    nb = (k + block - 1) // block
    if bits == 4:
        q = np.stack([b & 0x0F, b >> 4], axis=-1).reshape(n, nb, block)
    else:
        q = b.reshape(n, nb, block)
    if zp is None:
        z = np.full((n, nb), 8 if bits == 4 else 128, dtype=np.float32)
    elif bits == 4:
        z = np.stack([zp & 0x0F, zp >> 4], axis=-1).reshape(n, -1)[:, :nb].astype(np.float32)
    else:
        z = zp.astype(np.float32)
    w = (q.astype(np.float32) - z[:, :, None]) * scales.reshape(n, nb)[:, :, None]
    return np.ascontiguousarray(w.reshape(n, nb * block)[:, :k].T)


def fp32_bound(x, w):
    return 2e-5 * (np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64)) + 1e-6


def int8_bound(x, w, block):
    """Per element: the largest effect of rounding x to int8 per (token, K-block)."""
    k = x.shape[1]
    out = np.zeros((x.shape[0], w.shape[1]))
    for b0 in range(0, k, block):
        amax = np.abs(x[:, b0:b0 + block]).max(axis=1, keepdims=True).astype(np.float64)
        out += amax / 254.0 * np.abs(w[b0:b0 + block]).astype(np.float64).sum(axis=0)[None, :]
    return out


def assert_within(got, ref, bound):
    err = np.abs(got.astype(np.float64) - ref.astype(np.float64))
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert np.all(err <= bound), f"at {worst}: |{got[worst]} - {ref[worst]}| = {err[worst]} > {bound[worst]}"


def random_rows(rng, m, k, keep):
    """Per token an ascending kept-row list (keep = fraction of K), or None (dense) when keep is None."""
    if keep is None:
        return None
    return [np.flatnonzero(rng.random(k) < keep).astype(np.int32) for _ in range(m)]


def gated_reference(x, w, rows, scale=None, bias=None):
    ref = np.zeros((x.shape[0], w.shape[1]))
    for t in range(x.shape[0]):
        r = np.arange(x.shape[1]) if rows is None or rows[t] is None else rows[t]
        ref[t] = x[t, r].astype(np.float64) @ w[r].astype(np.float64)
        if scale is not None:
            ref[t] *= scale[t]
    return ref + (0 if bias is None else bias)


# ---------------------------------------------------------------------------------------------
# Packing
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("block", [16, 32, 64, 128])
@pytest.mark.parametrize("zero_points", [False, True])
@pytest.mark.parametrize("k, n", [(16, 1), (93, 65), (200, 129), (128, 700)])
def test_repacked_weights_dequantize_as_matmulnbits_defines(bits, block, zero_points, k, n, rng):
    b, scales, zp = make_weights(rng, k, n, bits, block, zero_points, flat_scales=(n % 2 == 1))
    q = K.QuantMatMul(b, scales, zp, k, n, bits, block, max_panel=256)
    np.testing.assert_array_equal(q.dequantized(), dequantize(b, scales, zp, k, n, bits, block))
    assert q.panel % K.QUANT_GROUP == 0 and q.panel * q.num_panels >= n


# ---------------------------------------------------------------------------------------------
# Decode: every ISA against the scalar reference and float64
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("block", [16, 32, 64, 128])
@pytest.mark.parametrize("zero_points", [False, True])
@pytest.mark.parametrize("keep", [None, 0.0, 0.5, 0.9, 1.0])
def test_decode_matches_scalar_and_float64(isa, bits, block, zero_points, keep, rng):
    k, n, m = 203, 321, 2  # K tail inside the last block, N tail inside the last group and panel
    b, scales, zp = make_weights(rng, k, n, bits, block, zero_points)
    kwargs = dict(max_panel=192, prefill_min_tokens=NO_PREFILL, decode_min_chunk_rows=32)
    got_q = K.QuantMatMul(b, scales, zp, k, n, bits, block, isa=isa, **kwargs)
    ref_q = K.QuantMatMul(b, scales, zp, k, n, bits, block, isa="scalar", **kwargs)
    w = dequantize(b, scales, zp, k, n, bits, block)
    x = rng.standard_normal((m, k)).astype(np.float32)
    rows = random_rows(rng, m, k, keep)
    out = np.full((m, n), np.nan, dtype=np.float32)
    got = got_q(x, rows, out=out)
    assert got is not None and np.shares_memory(got, out)
    ref = ref_q(x, rows)
    exact = gated_reference(x, w, rows)
    assert_within(out, ref, fp32_bound(x, w))
    assert_within(ref, exact, fp32_bound(x, w))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("accuracy_level", [0, 4])
@pytest.mark.parametrize("keep", [None, 0.0, 0.5])
def test_wide_layer_split_by_panel_matches_row_chunks(isa, accuracy_level, keep, rng):
    # 8 panels of 64 columns: one task per panel (no partial sums) against the same layer split in
    # row chunks (decode_panel_tasks out of reach): the same products, summed in another order.
    k, n, bits, block, m = 300, 500, 4, 32, 3
    b, scales, zp = make_weights(rng, k, n, bits, block, True)
    kwargs = dict(max_panel=64, prefill_min_tokens=NO_PREFILL, decode_min_chunk_rows=32, accuracy_level=accuracy_level)
    by_panel = K.QuantMatMul(b, scales, zp, k, n, bits, block, isa=isa, **kwargs)
    by_rows = K.QuantMatMul(b, scales, zp, k, n, bits, block, isa=isa, decode_panel_tasks=1 << 30, **kwargs)
    w = dequantize(b, scales, zp, k, n, bits, block)
    x = rng.standard_normal((m, k)).astype(np.float32)
    rows = random_rows(rng, m, k, keep)
    bias = rng.standard_normal(n).astype(np.float32)
    out = np.full((m, n), np.nan, dtype=np.float32)
    by_panel(x, rows, bias=bias, out=out)
    assert_within(out, by_rows(x, rows, bias=bias), 2 * fp32_bound(x, w) + 1e-6 * np.abs(bias))
    np.testing.assert_array_equal(by_panel(x, rows, bias=bias, threads=2), out)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 17])
def test_decode_per_token_lists_scale_and_bias(isa, m, rng):
    k, n, bits, block = 150, 77, 4, 32
    b, scales, zp = make_weights(rng, k, n, bits, block, True)
    q = K.QuantMatMul(b, scales, zp, k, n, bits, block, isa=isa, prefill_min_tokens=NO_PREFILL)
    w = dequantize(b, scales, zp, k, n, bits, block)
    x = rng.standard_normal((m, k)).astype(np.float32)
    keeps = [0.0, 0.5, 0.9, 1.0, None]
    rows = [None if keeps[t % 5] is None else np.flatnonzero(rng.random(k) < keeps[t % 5]).astype(np.int32)
            for t in range(m)]
    scale = rng.uniform(0.5, 2.0, m).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    out = np.full((m, n), np.nan, dtype=np.float32)
    q(x, rows, scale=scale, bias=bias, out=out)
    assert_within(out, gated_reference(x, w, rows, scale, bias), fp32_bound(x, w) * 2 + 1e-6 * np.abs(bias))


@pytest.mark.parametrize("isa", ISAS)
def test_decode_reads_no_skipped_row(isa, rng):
    # Rows the gate drops may hold anything: NaN scales in a block no kept row touches, and the
    # inputs of dropped rows are NaN; the result must stay finite and exact.
    k, n, bits, block = 128, 64, 8, 32
    b, scales, zp = make_weights(rng, k, n, bits, block, False)
    scales[:, 1] = np.nan  # block 1 (rows 32..63): never kept below
    q = K.QuantMatMul(b, scales, zp, k, n, bits, block, isa=isa, prefill_min_tokens=NO_PREFILL)
    rows = [np.array([0, 5, 31, 64, 100, 127], dtype=np.int32)]
    x = np.full((1, k), np.nan, dtype=np.float32)
    x[0, rows[0]] = rng.standard_normal(len(rows[0]))
    got = q(x, rows)
    w = dequantize(b, np.nan_to_num(scales), zp, k, n, bits, block)
    assert_within(got, gated_reference(x, w, rows), fp32_bound(np.nan_to_num(x), w))


# ---------------------------------------------------------------------------------------------
# Int8 decode (accuracy_level 4): every ISA bit-identical to the scalar reference, which matches
# the int8 products exactly emulated in float64
# ---------------------------------------------------------------------------------------------

def int8_decode_emulation(x, w, rows, block, scale=None):
    """Float64 of what decode_int8 computes: per token x with its gated-off rows zeroed, rounded to
    int8 per K-block exactly as quant_quantize (the scalar reference) rounds it, times W."""
    k = x.shape[1]
    out = np.zeros((x.shape[0], w.shape[1]))
    for t in range(x.shape[0]):
        xt = x[t].copy()
        if rows is not None and rows[t] is not None:
            keep = np.zeros(k, dtype=bool)
            keep[rows[t]] = True
            xt[~keep] = 0.0
        q, _, s, _ = K.quant_quantize("scalar", xt, block)
        deq = q[:k].astype(np.float64) * np.repeat(s.astype(np.float64), block)[:k]
        out[t] = deq @ w.astype(np.float64) * (1.0 if scale is None else scale[t])
    return out


@pytest.mark.parametrize("isa", SIMD_ISAS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("block", [16, 32, 64, 128])
@pytest.mark.parametrize("zero_points", [False, True])
@pytest.mark.parametrize("keep", [None, 0.0, 0.3, 0.5, 0.9, 1.0])
def test_int8_decode_is_bit_identical_on_every_isa(isa, bits, block, zero_points, keep, rng):
    # K tail inside the last block; N tails inside a group and a panel; kept rows per block from 0 to
    # the whole block, so every count of rows in a pass and in its last quad occurs.
    k, m = 203, 3
    b_weights = {n: make_weights(rng, k, n, bits, block, zero_points) for n in (1, 63, 65, 321)}
    for n, (b, scales, zp) in b_weights.items():
        # 321 columns in panels of 64: 6 panels, split by panel (decode_panel_tasks); else row chunks.
        kwargs = dict(max_panel=64 if n == 321 else 192, prefill_min_tokens=NO_PREFILL, decode_min_chunk_rows=32,
                      accuracy_level=4)
        got_q = K.QuantMatMul(b, scales, zp, k, n, bits, block, isa=isa, **kwargs)
        ref_q = K.QuantMatMul(b, scales, zp, k, n, bits, block, isa="scalar", **kwargs)
        x = (rng.standard_normal((m, k)) * rng.choice([0.01, 1.0, 30.0], (m, k))).astype(np.float32)
        rows = random_rows(rng, m, k, keep)
        out = np.full((m, n), np.nan, dtype=np.float32)
        got_q(x, rows, out=out)
        np.testing.assert_array_equal(out, ref_q(x, rows))


@pytest.mark.parametrize("isa", SIMD_ISAS)
@pytest.mark.parametrize("bits", [4, 8])
def test_int8_decode_row_count_tails(isa, bits, rng):
    # Every count of kept rows from 1 to 2 passes + 1 (16-row passes of 4-row quads on AVX-512,
    # 8-row passes on AVX2) in one block, dense and as the first rows of a list.
    block, n = 64, 130
    for k in range(1, 2 * 16 + 2):
        b, scales, zp = make_weights(rng, k, n, bits, block, True)
        kwargs = dict(prefill_min_tokens=NO_PREFILL, accuracy_level=4)
        got_q = K.QuantMatMul(b, scales, zp, k, n, bits, block, isa=isa, **kwargs)
        ref_q = K.QuantMatMul(b, scales, zp, k, n, bits, block, isa="scalar", **kwargs)
        x = rng.standard_normal((2, k)).astype(np.float32)
        rows = [None, np.arange(0, k, 2, dtype=np.int32)]
        out = np.full((2, n), np.nan, dtype=np.float32)
        got_q(x, rows, out=out)
        np.testing.assert_array_equal(out, ref_q(x, rows), err_msg=f"K={k}")


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("block", [16, 32, 128])
@pytest.mark.parametrize("zero_points", [False, True])
@pytest.mark.parametrize("keep", [None, 0.5])
def test_int8_decode_reference_is_the_int8_product(bits, block, zero_points, keep, rng):
    k, n, m = 203, 321, 3
    b, scales, zp = make_weights(rng, k, n, bits, block, zero_points)
    q = K.QuantMatMul(b, scales, zp, k, n, bits, block, isa="scalar", max_panel=192, prefill_min_tokens=NO_PREFILL,
                      accuracy_level=4)
    w = dequantize(b, scales, zp, k, n, bits, block)
    x = rng.standard_normal((m, k)).astype(np.float32)
    rows = random_rows(rng, m, k, keep)
    scale = rng.uniform(0.5, 2.0, m).astype(np.float32)
    got = q(x, rows, scale=scale)
    # Exact up to fp32 rounding of the int8 product; within the int8 rounding bound of x @ W.
    assert_within(got, int8_decode_emulation(x, w, rows, block, scale), fp32_bound(x, w) * 2)
    masked = x.copy()
    for t in range(m):
        if rows is not None:
            masked[t, np.setdiff1d(np.arange(k), rows[t])] = 0.0
    bound = (int8_bound(masked, w, block) + fp32_bound(x, w)) * scale[:, None]
    assert_within(got, gated_reference(x, w, rows, scale), bound)
    # The fp32 decode differs from it: the switch changes the numerics.
    fp32 = K.QuantMatMul(b, scales, zp, k, n, bits, block, isa="scalar", max_panel=192, prefill_min_tokens=NO_PREFILL)
    assert not np.array_equal(got, fp32(x, rows, scale=scale))


@pytest.mark.parametrize("isa", ISAS)
def test_int8_decode_skips_dropped_rows_and_marks_nonfinite_blocks(isa, rng):
    k, n, bits, block = 128, 64, 4, 32
    b, scales, zp = make_weights(rng, k, n, bits, block, True)
    scales[:, 1] = np.nan  # block 1 (rows 32..63): never kept below
    q = K.QuantMatMul(b, scales, zp, k, n, bits, block, isa=isa, prefill_min_tokens=NO_PREFILL, accuracy_level=4)
    rows = [np.array([0, 5, 31, 64, 100, 127], dtype=np.int32)] * 2
    x = np.full((2, k), np.nan, dtype=np.float32)
    x[:, rows[0]] = rng.standard_normal((2, len(rows[0])))
    x[1, 100] = np.inf  # a kept non-finite input: its block's products are NaN, as they would be in fp32
    got = q(x, rows)
    w = dequantize(b, np.nan_to_num(scales), zp, k, n, bits, block)
    assert_within(got[:1], int8_decode_emulation(np.nan_to_num(x[:1]), w, rows[:1], block),
                  fp32_bound(np.nan_to_num(x[:1]), w) * 2)
    assert np.all(np.isnan(got[1]))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("parallel_min_bytes", [0, 1 << 20])  # decode tasks on two threads / on the caller
@pytest.mark.parametrize("max_panel", [K.QUANT_MAX_PANEL, 128])  # row chunks / one task per panel (6 panels)
def test_int8_decode_two_threads_give_the_serial_result(isa, parallel_min_bytes, max_panel, rng):
    k, n, bits, block, m = 1100, 700, 8, 32, 3
    b, scales, zp = make_weights(rng, k, n, bits, block, True)
    q = K.QuantMatMul(b, scales, zp, k, n, bits, block, isa=isa, decode_min_chunk_rows=64, accuracy_level=4,
                      prefill_min_tokens=NO_PREFILL, decode_parallel_min_bytes=parallel_min_bytes, max_panel=max_panel,
                      decode_dispatch="pool")
    x = rng.standard_normal((m, k)).astype(np.float32)
    rows = [None, np.flatnonzero(rng.random(k) < 0.6).astype(np.int32), np.arange(0, k, 7, dtype=np.int32)]
    np.testing.assert_array_equal(q(x, rows, threads=2), q(x, rows, threads=1))


def test_accuracy_level_outside_matmulnbits_levels_is_refused(rng):
    b, scales, zp = make_weights(rng, 64, 16, 8, 32, False)
    with pytest.raises(Exception, match="accuracy_level=5"):
        K.QuantMatMul(b, scales, zp, 64, 16, 8, 32, accuracy_level=5)


# ---------------------------------------------------------------------------------------------
# Prefill: every ISA against the scalar reference (same int8 activations) and the int8 bound
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("block", [16, 32, 64, 128])
@pytest.mark.parametrize("k", [1, 15, 16, 17, 100, 256, 1234])
def test_activation_quantization_is_identical_on_every_isa(isa, block, k, rng):
    x = (rng.standard_normal(k) * rng.choice([1e-3, 1.0, 50.0], k)).astype(np.float32)
    x[rng.random(k) < 0.1] = 0.0
    x[: min(k, block)] = np.round(x[: min(k, block)] * 4) / 4  # exact halves: ties must round to even
    q, q16, scale, total = K.quant_quantize(isa, x, block, 0.5)
    nb = -(-k // block)
    xp = np.zeros(nb * block, dtype=np.float32)
    xp[:k] = x
    blocks = xp.reshape(nb, block)
    amax = np.abs(blocks).max(axis=1)
    inv = np.where(amax > 0, np.float32(127.0) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    ref = np.clip(np.rint(blocks * inv[:, None]), -127, 127).astype(np.int32)
    np.testing.assert_array_equal(q.reshape(nb, block), ref)
    np.testing.assert_array_equal(q16, q)
    np.testing.assert_array_equal(total, ref.sum(axis=1))
    np.testing.assert_array_equal(scale, (amax / np.float32(127.0) * np.float32(0.5)).astype(np.float32))


@pytest.mark.parametrize("isa", ISAS)
def test_activation_quantization_marks_nonfinite_blocks(isa):
    x = np.ones(64, dtype=np.float32)
    x[3], x[40] = np.nan, np.inf
    q, _, scale, total = K.quant_quantize(isa, x, 32)
    assert np.all(np.isnan(scale)) and np.all(q == 0) and np.all(total == 0)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("block", [16, 32, 64, 128])
@pytest.mark.parametrize("zero_points", [False, True])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 17])
def test_prefill_matches_scalar(isa, bits, block, zero_points, m, rng):
    k, n = 203, 321
    b, scales, zp = make_weights(rng, k, n, bits, block, zero_points)
    kwargs = dict(max_panel=192, prefill_min_tokens=1)
    got_q = K.QuantMatMul(b, scales, zp, k, n, bits, block, isa=isa, **kwargs)
    ref_q = K.QuantMatMul(b, scales, zp, k, n, bits, block, isa="scalar", **kwargs)
    w = dequantize(b, scales, zp, k, n, bits, block)
    x = rng.standard_normal((m, k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    out = np.full((m, n), np.nan, dtype=np.float32)
    got_q(x, bias=bias, out=out)
    ref = ref_q(x, bias=bias)
    assert_within(out, ref, fp32_bound(x, w))
    assert_within(ref, gated_reference(x, w, None, bias=bias), int8_bound(x, w, block) + fp32_bound(x, w))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bits", [4, 8])
def test_prefill_128_tokens_wide_panels(isa, bits, rng):
    k, n, block, m = 576, 1000, 32, 128
    b, scales, zp = make_weights(rng, k, n, bits, block, True)
    q = K.QuantMatMul(b, scales, zp, k, n, bits, block, isa=isa)
    ref_q = K.QuantMatMul(b, scales, zp, k, n, bits, block, isa="scalar")
    w = dequantize(b, scales, zp, k, n, bits, block)
    x = rng.standard_normal((m, k)).astype(np.float32)
    out = np.full((m, n), np.nan, dtype=np.float32)
    q(x, out=out)
    assert_within(out, ref_q(x), fp32_bound(x, w))


@pytest.mark.parametrize("isa", ISAS)
def test_mixed_call_dense_tokens_prefill_gated_tokens_decode(isa, rng):
    k, n, bits, block, m = 96, 130, 8, 16, 9
    b, scales, zp = make_weights(rng, k, n, bits, block, True)
    q = K.QuantMatMul(b, scales, zp, k, n, bits, block, isa=isa, prefill_min_tokens=4)
    w = dequantize(b, scales, zp, k, n, bits, block)
    x = rng.standard_normal((m, k)).astype(np.float32)
    rows = [None if t % 2 == 0 else np.flatnonzero(rng.random(k) < 0.5).astype(np.int32) for t in range(m)]
    scale = rng.uniform(0.5, 2.0, m).astype(np.float32)
    got = q(x, rows, scale=scale)
    ref = gated_reference(x, w, rows, scale)
    dense = [t for t in range(m) if rows[t] is None]
    gated = [t for t in range(m) if rows[t] is not None]
    bound = fp32_bound(x, w) * scale[:, None]
    assert_within(got[gated], ref[gated], bound[gated])
    assert_within(got[dense], ref[dense], (int8_bound(x, w, block) * scale[:, None] + bound)[dense])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", [1, 2, 6, 40])
@pytest.mark.parametrize("parallel_min_bytes", [0, 1 << 20])  # decode tasks on two threads / on the caller (small)
def test_two_threads_give_the_serial_result(isa, m, parallel_min_bytes, rng):
    # Tasks write disjoint partial sums that are added in a fixed order: bit-identical results,
    # whichever thread runs them.
    k, n, bits, block = 1100, 700, 4, 32
    b, scales, zp = make_weights(rng, k, n, bits, block, True)
    q = K.QuantMatMul(b, scales, zp, k, n, bits, block, isa=isa, decode_min_chunk_rows=64,
                      decode_parallel_min_bytes=parallel_min_bytes, decode_dispatch="pool")
    x = rng.standard_normal((m, k)).astype(np.float32)
    rows = [None if t % 3 == 0 else np.flatnonzero(rng.random(k) < 0.6).astype(np.int32) for t in range(m)]
    for r in (None, rows):
        np.testing.assert_array_equal(q(x, r, threads=2), q(x, r))


def test_nonfinite_inputs_give_nan_not_garbage(rng):
    k, n, bits, block = 64, 64, 4, 32
    b, scales, zp = make_weights(rng, k, n, bits, block, False)
    for min_tokens in (1, NO_PREFILL):
        q = K.QuantMatMul(b, scales, zp, k, n, bits, block, prefill_min_tokens=min_tokens)
        x = rng.standard_normal((4, k)).astype(np.float32)
        x[1, 3] = np.nan
        x[2, 40] = np.inf
        y = q(x)
        assert np.all(np.isfinite(y[[0, 3]]))
        assert np.all(~np.isfinite(y[1])) and np.all(~np.isfinite(y[2]))


# ---------------------------------------------------------------------------------------------
# Against ONNX Runtime's MatMulNBits, over the grid of its own matmul_nbits tests
# ---------------------------------------------------------------------------------------------

def matmulnbits_session(b, scales, zp, k, n, bits, block, accuracy_level, bias=None):
    inputs = [helper.make_tensor_value_info("A", TensorProto.FLOAT, [None, k])]
    inits = [helper.make_tensor("B", TensorProto.UINT8, b.shape, b.tobytes(), raw=True),
             helper.make_tensor("scales", TensorProto.FLOAT, scales.shape, scales.tobytes(), raw=True)]
    names = ["A", "B", "scales"]
    if zp is not None:
        inits.append(helper.make_tensor("zp", TensorProto.UINT8, zp.shape, zp.tobytes(), raw=True))
        names.append("zp")
    if bias is not None:
        names += [""] * (4 - len(names)) + ["", "bias"]
        inits.append(helper.make_tensor("bias", TensorProto.FLOAT, bias.shape, bias.tobytes(), raw=True))
    node = helper.make_node("MatMulNBits", names, ["Y"], domain="com.microsoft", K=k, N=n, bits=bits,
                            block_size=block, accuracy_level=accuracy_level)
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, n])],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


# (N, K, block) of onnxruntime/test/contrib_ops/matmul_4bits_test.cc (float32, accuracy 0 and 4),
# each run at 4 and 8 bits, with and without zero points, at M = 1, 2 and 100.
ORT_GRID = [(1, 16, 16), (2, 16, 16), (32, 16, 16), (32, 32, 16), (32, 16, 128), (288, 16, 16),
            (288, 1024, 16), (288, 1024, 128), (288, 93, 32), (288, 93, 128), (288, 1234, 16), (288, 192, 64)]


@pytest.mark.parametrize("n, k, block", ORT_GRID)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("zero_points", [False, True])
def test_decode_matches_matmulnbits_accuracy0(n, k, block, bits, zero_points, rng):
    b, scales, zp = make_weights(rng, k, n, bits, block, zero_points)
    bias = rng.uniform(1.0, 5.0, n).astype(np.float32)
    sess = matmulnbits_session(b, scales, zp, k, n, bits, block, 0, bias)
    q = K.QuantMatMul(b, scales, zp, k, n, bits, block, prefill_min_tokens=NO_PREFILL)
    w = dequantize(b, scales, zp, k, n, bits, block)
    for m in (1, 2, 100):
        x = (rng.standard_normal((m, k)) * 0.25).astype(np.float32)
        (ort_y,) = sess.run(None, {"A": x})
        assert_within(q(x, bias=bias), ort_y, fp32_bound(x, w) + 1e-6 * np.abs(bias))


@pytest.mark.parametrize("n, k, block", ORT_GRID)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("zero_points", [False, True])
def test_prefill_matches_matmulnbits_accuracy4(n, k, block, bits, zero_points, rng):
    b, scales, zp = make_weights(rng, k, n, bits, block, zero_points)
    sess = matmulnbits_session(b, scales, zp, k, n, bits, block, 4)
    q = K.QuantMatMul(b, scales, zp, k, n, bits, block, prefill_min_tokens=1)
    w = dequantize(b, scales, zp, k, n, bits, block)
    for m in (1, 2, 100):
        x = (rng.standard_normal((m, k)) * 0.25).astype(np.float32)
        (ort_y,) = sess.run(None, {"A": x})
        ours = q(x)
        slack = fp32_bound(x, w)
        assert_within(ours, gated_reference(x, w, None), int8_bound(x, w, block) + slack)
        assert_within(ours, ort_y, 2 * int8_bound(x, w, block) + slack)


@pytest.mark.parametrize("n, k, block", ORT_GRID)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("zero_points", [False, True])
def test_int8_decode_matches_matmulnbits_accuracy4(n, k, block, bits, zero_points, rng):
    b, scales, zp = make_weights(rng, k, n, bits, block, zero_points)
    sess = matmulnbits_session(b, scales, zp, k, n, bits, block, 4)
    q = K.QuantMatMul(b, scales, zp, k, n, bits, block, prefill_min_tokens=NO_PREFILL, accuracy_level=4)
    w = dequantize(b, scales, zp, k, n, bits, block)
    for m in (1, 3):
        x = (rng.standard_normal((m, k)) * 0.25).astype(np.float32)
        (ort_y,) = sess.run(None, {"A": x})
        ours = q(x)
        slack = fp32_bound(x, w)
        assert_within(ours, gated_reference(x, w, None), int8_bound(x, w, block) + slack)
        assert_within(ours, ort_y, 2 * int8_bound(x, w, block) + slack)


# ---------------------------------------------------------------------------------------------
# Bad input: one clear error naming the input and the values
# ---------------------------------------------------------------------------------------------

def _build(b, scales, zp, k, n, bits, block):
    return K.QuantMatMul(b, scales, zp, k, n, bits, block)


@pytest.mark.parametrize("change, message", [
    (dict(bits=3), "bits=3 is not supported"),
    (dict(bits=2), "bits=2 is not supported"),
    (dict(block=8), "block_size=8 is not supported"),
    (dict(block=48), "block_size=48 is not supported"),
    (dict(block=256), "block_size=256 is not supported"),
    (dict(k=0), "K=0"),
    (dict(k=129), "input B has shape [64, 4, 16]"),
    (dict(n=65), "input B has shape [64, 4, 16]"),
    (dict(scales_shape=(64, 3)), "input scales has shape [64, 3]"),
    (dict(scales_shape=(4, 64)), "input scales has shape [4, 64]"),
    (dict(zp_shape=(64, 4)), "input zero_points has shape [64, 4]"),
    (dict(zp_float=True), "input zero_points is a float tensor"),
])
def test_bad_weights_are_refused_with_a_clear_error(change, message, rng):
    k, n, bits, block = 128, 64, 4, 32
    b, scales, zp = make_weights(rng, k, n, bits, block, True)
    if "scales_shape" in change:
        scales = np.zeros(change["scales_shape"], dtype=np.float32)
    if "zp_shape" in change:
        zp = np.zeros(change["zp_shape"], dtype=np.uint8)
    if change.get("zp_float"):
        zp = np.zeros((n, 4), dtype=np.float32)
    args = dict(k=change.get("k", k), n=change.get("n", n), bits=change.get("bits", bits),
                block=change.get("block", block))
    with pytest.raises(K.Error) as info:
        _build(b, scales, zp, args["k"], args["n"], args["bits"], args["block"])
    assert message in str(info.value)
