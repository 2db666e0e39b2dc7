"""The bitmap input gate (KwtaBlockMatMul pack_* attributes) against numpy."""
import math

import numpy as np
import pytest

import ortsparse

from .onnx_builders import kwta_model
from .reference import kwta_block_scores, kwta_keep_count, separated_input


_LAST_SESSION = []


def run(model, x):
    # The session is kept until the next run: its node's entry stays in ortsparse.metrics() (a
    # total shows the constants, e.g. pack.mode, of whichever live node of the op type came last).
    _LAST_SESSION[:] = [ortsparse.inference_session(model)]
    return _LAST_SESSION[0].run(None, {"X": x})[0]


def node_metrics(name):
    return ortsparse.metrics()[f"KwtaBlockMatMul/{name}"]


def active_blocks(row, block, eps):
    nb = math.ceil(len(row) / block)
    return np.array([b for b in range(nb) if np.any(~(np.abs(row[b * block:(b + 1) * block]) <= eps))], dtype=int)


def bitmap_reference(x, w, bias, *, block, eps, k_frac=1.0, renorm=False):
    """Y and active-block count: blocks with all |x| <= eps dropped; then (k_frac < 1) the kwta
    top-K by l2 among the active blocks (ties to the lower block); renorm by active / kept."""
    k = x.shape[1]
    nb = math.ceil(k / block)
    keep = kwta_keep_count(k, block, k_frac, 0)
    y = np.zeros((x.shape[0], w.shape[1]))
    active_total = 0
    for t, row in enumerate(x):
        act = active_blocks(row, block, eps)
        active_total += len(act)
        kept = act
        if keep < nb and len(act) > keep:
            scores = kwta_block_scores(row, block, "l2")[act]
            order = np.lexsort((act, -scores))
            kept = np.sort(act[order[:keep]])
        mask = np.zeros(k, dtype=bool)
        for b in kept:
            mask[b * block:(b + 1) * block] = True
        y[t] = (row * mask).astype(np.float64) @ w.astype(np.float64)
        if renorm and k_frac < 1 and len(kept):
            y[t] *= len(act) / len(kept)
    return y + (bias if bias is not None else 0), active_total


def sparse_input(rng, m, k, block, zero_frac):
    x = rng.standard_normal((m, k)).astype(np.float32)
    nb = math.ceil(k / block)
    for t in range(m):
        for b in np.flatnonzero(rng.random(nb) < zero_frac):
            x[t, b * block:(b + 1) * block] = 0.0
    return x


@pytest.mark.parametrize("block", [1, 3, 16])
@pytest.mark.parametrize("m", [1, 2, 5])
@pytest.mark.parametrize("mode", ["binary", "ternary"])
def test_eps_zero_is_exact(block, m, mode, rng):
    k, n = 100, 40
    w = rng.standard_normal((k, n)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    x = sparse_input(rng, m, k, block, 0.9)
    ortsparse.reset_metrics()
    y = run(kwta_model(w, b, node_name="bm", k_frac=1.0, block=block, pack_mode=mode, pack_eps=0.0,
                       pack_density_max=1.0), x)
    np.testing.assert_allclose(y, x.astype(np.float64) @ w + b, rtol=1e-4, atol=1e-4)
    _, active = bitmap_reference(x, w, b, block=block, eps=0.0)
    metrics = node_metrics("bm")
    nb = math.ceil(k / block)
    assert metrics["pack.density"] == pytest.approx(active / (m * nb))
    assert metrics["blocks_kept"] == active and metrics["pack.active"] == 1 and metrics["pack.enabled"] == 1
    assert metrics["pack.mode"] == {"binary": 2, "ternary": 3}[mode]


@pytest.mark.parametrize("block", [1, 4, 7])
def test_eps_drops_small_blocks(block, rng):
    k, n = 90, 24
    w = rng.standard_normal((k, n)).astype(np.float32)
    x = (rng.standard_normal((3, k)) * 0.3).astype(np.float32)
    x[:, ::5] *= 10  # a few large entries keep some blocks alive
    eps = 0.5
    expected, active = bitmap_reference(x, w, None, block=block, eps=eps)
    y = run(kwta_model(w, None, k_frac=1.0, block=block, pack_mode="binary", pack_eps=eps, pack_density_max=1.0), x)
    np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-4)
    assert active < 3 * math.ceil(k / block)  # something was dropped
    assert np.abs(y - x @ w).max() > 1e-3


@pytest.mark.parametrize("block", [1, 5])
@pytest.mark.parametrize("renorm", [0, 1])
def test_composed_with_kwta_on_the_survivors(block, renorm, rng):
    k, n, m = 80, 30, 4
    w = rng.standard_normal((k, n)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    x = separated_input(rng, m, k, block)
    nb = math.ceil(k / block)
    for t in range(m):  # zero some blocks, among them some that kwta alone would keep
        for blk in rng.choice(nb, size=nb // 3, replace=False):
            x[t, blk * block:(blk + 1) * block] = 0
    expected, _ = bitmap_reference(x, w, b, block=block, eps=0.0, k_frac=0.5, renorm=bool(renorm))
    y = run(kwta_model(w, b, k_frac=0.5, block=block, renorm=renorm, pack_mode="binary", pack_density_max=1.0), x)
    np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-3)


def test_density_auto_off(rng):
    k, n = 64, 16
    w = rng.standard_normal((k, n)).astype(np.float32)
    x = sparse_input(rng, 2, k, 1, 0.5)  # ~50% active > density_max 0.15 -> the kwta gate alone
    ortsparse.reset_metrics()
    y = run(kwta_model(w, None, node_name="off", k_frac=1.0, pack_mode="binary"), x)
    np.testing.assert_allclose(y, x @ w, rtol=1e-4, atol=1e-4)
    metrics = node_metrics("off")
    assert metrics["pack.active"] == 0 and metrics["pack.density"] > 0.3
    assert metrics["blocks_kept"] == metrics["blocks_total"]  # ran dense
    x2 = sparse_input(rng, 2, k, 1, 0.95)
    ortsparse.reset_metrics()
    run(kwta_model(w, None, node_name="on", k_frac=1.0, pack_mode="binary"), x2)
    assert node_metrics("on")["pack.active"] == 1


def test_max_gated_rows_bypasses_the_bitmap(rng):
    k, n = 32, 8
    w = rng.standard_normal((k, n)).astype(np.float32)
    x = sparse_input(rng, 4, k, 1, 0.9)
    ortsparse.reset_metrics()
    y = run(kwta_model(w, None, node_name="mgr", k_frac=1.0, pack_mode="binary", pack_density_max=1.0,
                       max_gated_rows=2), x)
    np.testing.assert_allclose(y, x @ w, rtol=1e-4, atol=1e-4)
    metrics = node_metrics("mgr")
    assert metrics["blocks_kept"] == metrics["blocks_total"] and metrics["pack.active"] == 0


def test_no_pack_metrics_without_pack_mode(rng):
    w = rng.standard_normal((8, 4)).astype(np.float32)
    ortsparse.reset_metrics()
    run(kwta_model(w, None, node_name="plain", k_frac=1.0), rng.standard_normal((1, 8)).astype(np.float32))
    assert not any(key.startswith("pack.") for key in node_metrics("plain"))


@pytest.mark.parametrize("attrs,message", [
    (dict(pack_mode="quad"), "pack_mode='quad' is not one of none, binary, ternary"),
    (dict(pack_mode="binary", pack_eps=-1.0), "pack_eps=-1"),
    (dict(pack_mode="binary", pack_density_max=0.0), "pack_density_max=0"),
    (dict(pack_mode="binary", duty=2), "duty=2 is not supported"),
])
def test_bad_pack_attributes(attrs, message, rng):
    w = rng.standard_normal((8, 4)).astype(np.float32)
    with pytest.raises(Exception) as err:
        ortsparse.inference_session(kwta_model(w, None, **attrs))
    assert message in str(err.value) and "KwtaBlockMatMul node" in str(err.value)
