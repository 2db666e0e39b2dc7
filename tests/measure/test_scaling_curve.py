"""bench/scaling_curve.py: the rows it derives from a bench report (worst round, bytes bound) and the
rewrite it asks for (every linear layer, the head included, at the keep)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "scaling_curve.py"
TINY_GENAI = Path(__file__).resolve().parents[2] / "models" / "tiny" / "llama_tiny_genai"


@pytest.fixture(scope="module")
def scaling():
    spec = importlib.util.spec_from_file_location("scaling_curve", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bench(keeps_speedups):
    """A bench report of the shape `ortsparse bench` writes: one input, variants with their rounds."""
    rows = [dict(threads=1, context=128, model=name, kv_mb=kv, kv_copy_mb=0.0)
            for name, kv in (("input", 10.0), *((name, 10.0) for name in keeps_speedups))]
    ratios = [dict(threads=1, context=128, model="input", tokens_per_s={"min": 50.0, "median": 52.0},
                   speedup={"min": 1.0, "median": 1.0, "rounds": 3})]
    ratios += [dict(threads=1, context=128, model=name, tokens_per_s={"min": 50.0 * low, "median": 52.0 * mid},
                    speedup={"min": low, "median": mid, "rounds": 3})
               for name, (low, mid) in keeps_speedups.items()]
    return {"rows": rows, "ratios": ratios}


def test_rows_take_the_worst_round_and_the_bytes_bound(scaling):
    bench = _bench({"keep0.5": (1.4, 1.6)})
    bytes_of = {"input": 90e6, "keep0.5": 40e6}  # + 10 MB of KV each: bound (90 + 10) / (40 + 10) = 2
    [row] = scaling.curve_rows("m", bench, bytes_of, {"keep0.5": 0.5}, "off")
    assert row["worst"] == 1.4 and row["median"] == 1.6 and row["keep"] == 0.5
    assert row["bound"] == pytest.approx(2.0)
    assert row["worst_over_bound"] == pytest.approx(0.7)
    assert row["input_tokens_per_s"] == 52.0


def test_the_gated_config_covers_the_head_at_the_keep(scaling):
    from ortsparse.graph_rewrite.targets import target_includes

    config = scaling.gated_config(0.6)
    choice = config.techniques["kwta"]
    assert choice.enabled and choice.target == "all"
    assert target_includes(choice.target, "head", "head")
    assert choice.settings.k_frac == pytest.approx(0.6)


def test_gated_weight_bytes_scale_only_the_quantized_rows(scaling, tmp_path):
    from ortsparse.graph_rewrite.genai import rewrite_genai_folder

    gated = rewrite_genai_folder(TINY_GENAI, tmp_path / "gated", scaling.gated_config(0.5)).folder
    full, half = scaling.weight_bytes(gated, 1.0), scaling.weight_bytes(gated, 0.5)
    assert 0 < half < full
    # Halving the keep halves the gateable bytes only: the rest (scales, bias) stays.
    assert full - half < full / 2 + 1e-6
    assert scaling.weight_bytes(TINY_GENAI, None) > 0


def test_pools_above_one_thread_only_for_the_spinning_pool(scaling, tmp_path):
    import argparse

    args = argparse.Namespace(threads=[1, 2], contexts=[128], rounds=3, steps=32)
    off = scaling.bench_command({"input": Path("a")}, args, "off", tmp_path / "s")
    spinning = scaling.bench_command({"input": Path("a")}, args, "default", tmp_path / "s")
    assert off[off.index("--threads") + 1:off.index("--rounds")] == ["1", "2"] and "--spinning" not in off
    assert spinning[spinning.index("--threads") + 1:spinning.index("--rounds")] == ["2"] and "--spinning" in spinning
