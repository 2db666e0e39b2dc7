"""Input generation and error metrics of ortsparse.verify."""
from __future__ import annotations

import types

import numpy as np
import pytest

import tiny_graphs
from ortsparse.verify import (
    VerifyInputError, compare, make_inputs, parse_shape_overrides, resolve_dims, verify_models,
)


def spec(name, type_, shape):
    return types.SimpleNamespace(name=name, type=type_, shape=shape)


def test_parse_shape_overrides():
    assert parse_shape_overrides(["sequence=16,batch=2", "input_ids=1x4"]) == {
        "sequence": 16, "batch": 2, "input_ids": (1, 4)}
    assert parse_shape_overrides(None) == {}
    for bad in ("seq", "=3", "seq=x", "seq=-1"):
        with pytest.raises(VerifyInputError):
            parse_shape_overrides(bad)


def test_dims_defaults_totals_and_expressions():
    specs = [spec("input_ids", "tensor(int64)", ["batch", "seq"]),
             spec("attention_mask", "tensor(int64)", ["batch", "total_seq"]),
             spec("mask2", "tensor(int64)", ["batch", "past_seq + seq"]),
             spec("past", "tensor(float)", ["batch", 2, "past_seq", 4])]
    assert resolve_dims(specs, {}) == {"batch": 1, "seq": 8, "total_seq": 12, "past_seq + seq": 12, "past_seq": 4}
    assert resolve_dims(specs, {"seq": 3})["total_seq"] == 7


def test_generated_inputs_respect_vocab_masks_positions():
    specs = [spec("input_ids", "tensor(int64)", ["batch", "seq"]),
             spec("attention_mask", "tensor(int64)", ["batch", "seq"]),
             spec("position_ids", "tensor(int64)", ["batch", "seq"]),
             spec("token_type_ids", "tensor(int64)", ["batch", "seq"]),
             spec("x", "tensor(float)", [None, 3])]
    feeds = make_inputs(specs, {"input_ids": 5}, {"batch": 2, "input_ids": (2, 4)}, np.random.default_rng(0))
    assert feeds["input_ids"].shape == (2, 4) and feeds["input_ids"].max() < 5
    assert (feeds["attention_mask"] == 1).all() and feeds["attention_mask"].shape == (2, 4)
    assert feeds["position_ids"][1].tolist() == list(range(4))
    assert not feeds["token_type_ids"].any()
    assert feeds["x"].dtype == np.float32 and feeds["x"].shape == (1, 3)  # unnamed leading dim: batch 1
    with pytest.raises(VerifyInputError, match="rank"):
        make_inputs(specs, {}, {"input_ids": (4,)}, np.random.default_rng(0))


def test_compare():
    a = np.array([1.0, 2.0, np.nan])
    assert compare(a, a) == (0.0, 0.0)
    assert compare(a, np.array([1.0, 2.0, 3.0]))[1] == float("inf")
    max_abs, rel = compare(np.array([3.0, 4.0]), np.array([3.0, 4.5]))
    assert max_abs == pytest.approx(0.5) and rel == pytest.approx(0.1)


def test_verify_identical_models_pass():
    model = tiny_graphs.gpt2_like()
    result = verify_models(model, model, runs=2, budget=1e-6)
    assert result.passed and result.runs == 2
    assert result.outputs[0].name == "logits" and result.outputs[0].max_abs == 0.0
    assert "verify: PASSED" in result.format()
