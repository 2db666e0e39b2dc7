"""The TT builder (ortsparse.tt): exact recovery of known TT ranks, error vs rank, TT-cross with
maxvol against TT-SVD, the activation-aware gap, autotune's rank choice and dense fallback."""
import math

import numpy as np
import pytest

from ortsparse import tt


def known_tt(rng, in_modes, out_modes, ranks):
    cores = [rng.standard_normal((ranks[t], k, n, ranks[t + 1])) for t, (k, n) in enumerate(zip(in_modes, out_modes))]
    return tt.tt_full(cores)


def test_factorize_and_choose_modes():
    assert tt.factorize(576, 3) == [12, 8, 6] and math.prod(tt.factorize(1536, 3)) == 1536
    assert tt.factorize(97, 2) == [97, 1]  # prime: a mode of 1
    assert tt.choose_modes(576, 1536) == ([576, 1], [1, 1536])
    i, o = tt.choose_modes(576, 1536, 3, "balanced")
    assert math.prod(i) == 576 and math.prod(o) == 1536 and len(i) == len(o) == 3
    with pytest.raises(ValueError):
        tt.choose_modes(576, 1536, 3, "lowrank")


def test_tt_full_matches_definition(rng):
    cores = [rng.standard_normal(s) for s in [(1, 2, 3, 2), (2, 3, 2, 3), (3, 2, 2, 1)]]
    w = tt.tt_full(cores)
    assert w.shape == (12, 12)
    i, j = (1, 2, 0), (2, 1, 1)  # row = ravel(i, in_modes), col = ravel(j, out_modes)
    expected = cores[0][:, i[0], j[0], :] @ cores[1][:, i[1], j[1], :] @ cores[2][:, i[2], j[2], :]
    assert w[np.ravel_multi_index(i, (2, 3, 2)), np.ravel_multi_index(j, (3, 2, 2))] == pytest.approx(expected.item())


@pytest.mark.parametrize("in_modes,out_modes,ranks", [
    ([30, 1], [1, 40], [1, 5, 1]),
    ([4, 6, 8], [8, 6, 4], [1, 3, 5, 1]),
    ([3, 4, 2, 3], [2, 3, 4, 2], [1, 2, 4, 3, 1]),
])
def test_exact_recovery_of_known_tt_rank(in_modes, out_modes, ranks, rng):
    w = known_tt(rng, in_modes, out_modes, ranks)
    svd = tt.tt_svd(w, in_modes, out_modes, eps=1e-10)
    assert tt.tt_ranks(svd) == ranks  # rank revealed by the tolerance
    assert tt.weight_error(w, svd) < 1e-10
    capped = tt.tt_svd(w, in_modes, out_modes, max_rank=max(ranks))
    assert tt.weight_error(w, capped) < 1e-10
    for k in (0, 3):
        cross = tt.tt_cross_maxvol(w, in_modes, out_modes, rank=max(ranks), maxvol_k=k)
        assert tt.weight_error(w, cross) < 1e-8, k
        assert max(tt.tt_ranks(cross)) <= max(ranks)


def test_error_decreases_with_rank_on_random_matrices(rng):
    w = rng.standard_normal((64, 96))
    for in_modes, out_modes in [([64, 1], [1, 96]), ([8, 8], [8, 12]), ([4, 4, 4], [4, 4, 6])]:
        errors = [tt.weight_error(w, tt.tt_svd(w, in_modes, out_modes, max_rank=r)) for r in (1, 2, 4, 8, 16, 32, 64)]
        assert all(b < a for a, b in zip(errors, errors[1:]) if a > 1e-9), errors
        assert errors[0] > 0.5 and errors[-1] < 1e-9  # random: no low-rank shortcut; full rank exact


def test_cross_vs_svd_on_noisy_low_rank(rng):
    # low TT rank + 1e-3 noise: both land near the noise level; cross reads only its fibres
    in_modes, out_modes, ranks = [8, 8, 8], [8, 8, 8], [1, 4, 4, 1]
    w = known_tt(rng, in_modes, out_modes, ranks)
    noise = 1e-3 * np.linalg.norm(w) / math.sqrt(w.size) * rng.standard_normal(w.shape)
    noisy = w + noise
    level = np.linalg.norm(noise) / np.linalg.norm(noisy)
    svd = tt.weight_error(noisy, tt.tt_svd(noisy, in_modes, out_modes, max_rank=4))
    cross = tt.weight_error(noisy, tt.tt_cross_maxvol(noisy, in_modes, out_modes, rank=4, maxvol_k=4))
    assert svd <= level * 1.01
    assert cross <= level * 3, (cross, level)


def test_maxvol_dominance(rng):
    a = rng.standard_normal((200, 7))
    rows = tt.maxvol(a, tol=1.01)
    assert len(set(rows.tolist())) == 7
    b = a @ np.linalg.inv(a[rows])
    assert np.max(np.abs(b)) <= 1.01 + 1e-9


def test_pack_roundtrip_and_macs(rng):
    cores = [rng.standard_normal(s).astype(np.float32) for s in [(1, 4, 3, 2), (2, 5, 6, 1)]]
    packed = tt.concat_cores(cores)
    back = tt.split_cores(packed, [4, 5], [3, 6], [1, 2, 1])
    assert all(np.array_equal(a, b) for a, b in zip(cores, back))
    with pytest.raises(ValueError):
        tt.split_cores(packed[:-1], [4, 5], [3, 6], [1, 2, 1])
    assert tt.order_macs([576, 1], [1, 1536], [1, 64, 1], False) == 576 * 64 + 64 * 1536


def test_gap_is_activation_aware(rng):
    # inputs live in a 4-dim subspace: an approximation exact on that subspace has gap 0
    k, n = 40, 30
    w = rng.standard_normal((k, n))
    basis = np.linalg.qr(rng.standard_normal((k, 4)))[0]
    x = rng.standard_normal((500, 4)) @ basis.T
    proj = basis @ basis.T @ w  # rank 4, wrong off the subspace
    assert tt.gap(w, proj, x) < 1e-10
    assert tt.weight_error(w, [proj.reshape(1, k, 1, n)]) > 0.5
    assert tt.gap(w, w * 0.9, x) == pytest.approx(0.1, rel=1e-9)


def test_whitening_lowers_gap_at_equal_rank(rng):
    k, n = 64, 48
    w = rng.standard_normal((k, n))
    scales = np.exp(rng.standard_normal(k) * 1.5)  # outlier channels, as in trained models
    x = rng.standard_normal((2000, k)) * scales
    for rank in (4, 16):
        plain = tt.gap(w, tt.lowrank_svd(w, rank), x)
        white = tt.gap(w, tt.lowrank_whitened(w, x, rank), x)
        assert white < plain * 0.8, (rank, plain, white)


def test_autotune_picks_smallest_passing_rank(rng):
    k, n, true_rank = 96, 128, 6
    w = rng.standard_normal((k, true_rank)) @ rng.standard_normal((true_rank, n))
    w += 0.01 * rng.standard_normal((k, n))
    x = rng.standard_normal((400, k))
    result = tt.autotune(w, x, gap_tol=0.05, name="layer")
    assert result.decision == "tt" and result.ranks == [1, true_rank, 1]
    # the rank below does not pass, the chosen one does (whitening fitted on even rows, gap on odd)
    fit, held = tt.split_calibration(x)
    assert len(fit) == len(held) == 200 and np.array_equal(held, x[1::2])
    below = tt.gap(w, tt.lowrank_whitened(w, fit, true_rank - 1), held)
    assert below > 0.05 >= result.gap
    assert result.flop_ratio == pytest.approx(k * n / (true_rank * (k + n)))
    assert result.cores is not None and tt.gap(w, result.cores, held) == pytest.approx(result.gap)
    meta = result.metadata()
    assert meta["rank"] == true_rank and "cores" not in meta
    for method in ("svd", "cross"):
        other = tt.autotune(w, x, gap_tol=0.05, method=method)
        assert other.decision == "tt" and other.rank == true_rank, method


def test_autotune_balanced_tt(rng):
    in_modes, out_modes = tt.choose_modes(96, 144, 3, "balanced")
    w = known_tt(rng, in_modes, out_modes, [1, 3, 3, 1])
    x = rng.standard_normal((300, 96))
    result = tt.autotune(w, x, gap_tol=1e-6, layout="balanced", d=3)
    assert result.decision == "tt" and result.in_modes == in_modes and result.rank <= 3
    assert result.gap < 1e-6


def test_autotune_keeps_random_layers_dense_and_says_why(rng):
    w = rng.standard_normal((64, 64))
    x = rng.standard_normal((300, 64))
    result = tt.autotune(w, x, gap_tol=0.02)
    assert result.decision == "dense"
    assert "gap" in result.reason and "FLOP ratio" in result.reason
    assert result.gap > 0.02 and result.tried
    tiny = tt.autotune(np.eye(2), np.eye(2), gap_tol=0.02)
    assert tiny.decision == "dense" and "no rank" in tiny.reason


def test_autotune_layers_progress(rng):
    layers = [(f"l{i}", rng.standard_normal((32, 3)) @ rng.standard_normal((3, 40)), None, rng.standard_normal((100, 32)))
              for i in range(3)]
    results = tt.autotune_layers(layers, gap_tol=1e-6, progress=False)
    assert [r.name for r in results] == ["l0", "l1", "l2"] and all(r.rank == 3 for r in results)


def test_held_out_gap_is_not_fooled_by_few_calibration_rows(rng):
    # 200 calibration rows, rank 100 of a random 128 x 160 layer: fitting 100 whitened directions
    # reproduces the fit rows almost exactly, the held-out rows show the real error
    w = rng.standard_normal((128, 160))
    x = rng.standard_normal((200, 128))
    fit, held = tt.split_calibration(x)
    cores = tt.lowrank_whitened(w, fit, 100)
    assert tt.gap(w, cores, fit) < 1e-6 < 0.1 < tt.gap(w, cores, held)
    result = tt.build(w, 100, x=x, method="svd-whitened")
    assert result.gap == pytest.approx(tt.gap(w, cores, held))


def test_factored_gap_equals_dense_gap(rng):
    w = rng.standard_normal((30, 20))
    x = rng.standard_normal((50, 30))
    cores = tt.lowrank_svd(w, 5)
    assert tt.gap(w, cores, x) == pytest.approx(tt.gap(w, tt.tt_full(cores), x), rel=1e-10)


def test_factor_cache(rng):
    w = rng.standard_normal((40, 30))
    x = rng.standard_normal((100, 40))
    tt.enable_factor_cache()
    try:
        assert tt.whitened_svd(w, x) is tt.whitened_svd(w.copy(), x.copy())
    finally:
        tt.enable_factor_cache(False)
    assert tt.whitened_svd(w, x) is not tt.whitened_svd(w, x)
