"""onnxruntime-genai folders with sliding-window layers (window-sized KV buffers): every Generator the
harness opens holds at least the window, since GroupQueryAttention refuses a KV capacity below
``local_window_size`` ("KV cache capacity (136) must be at least local_window_size (512)" on
Gemma-3-270M with a 128-token context)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnxruntime_genai")

GEMMA = Path(__file__).resolve().parents[2] / "models" / "tiny" / "gemma3_tiny_genai"  # window 8
PROMPT = [5, 9, 13]


def test_greedy_ids_on_a_folder_holds_the_window():
    from ortsparse.zoo.export_genai import generator_capacity, greedy_ids

    assert generator_capacity(GEMMA, 5) == 8 and generator_capacity(GEMMA, 20) == 20
    assert len(greedy_ids(GEMMA, PROMPT, 2)) == 2  # 5 positions < the window of 8


def test_the_bench_stepper_holds_the_window():
    from ortsparse.measure.decode import GenaiStepper

    stepper = GenaiStepper(GEMMA)
    assert stepper.window_size == 8
    stepper.reset(capacity=len(PROMPT) + 1)
    logits = stepper.advance(np.asarray(PROMPT))
    assert logits.ndim == 1 and np.isfinite(logits).all()
