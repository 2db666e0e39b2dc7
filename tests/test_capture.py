"""The one activation capture loop (ortsparse.runtime.captured_values) and its users: a KV-cache
decoder prefills from an empty past (the TT builder's capture did not: issue 37), and the TT
builder's rows are the ones the allocation's capture takes from the same windows."""
from pathlib import Path

import numpy as np
import onnx
import pytest

from ortsparse import tt
from ortsparse.calibration import allocation
from ortsparse.runtime import captured_values, lm_feeds, open_session, with_outputs

TINY = Path(__file__).resolve().parents[1] / "models" / "tiny"
FULL = TINY / "llama_tiny.torchscript.onnx"
KV = TINY / "llama_tiny_kv.torchscript.onnx"


def windows(count=2, length=24):
    rng = np.random.default_rng(3)
    return [rng.integers(1, 200, length).astype(np.int64) for _ in range(count)]


def first_unit(model):
    return allocation.units_of(allocation.gated_layers(model, "both"))[0]


def test_a_kv_decoder_is_captured_from_an_empty_past():
    model = onnx.load(str(KV))
    unit = first_unit(model)
    with pytest.raises(ValueError, match="looks like a KV cache"):  # what the TT builder's loop fed it
        lm_feeds(open_session(model), windows()[0])
    captured = list(captured_values(model, [unit.input_name, unit.input_name], windows()))
    assert len(captured) == 2 and all(len(values) == 1 for _, values in captured)  # a name once
    assert all(values[0].shape[:2] == (1, 24) for _, values in captured)


def test_tt_rows_are_the_allocations_rows_on_a_kv_decoder():
    model = onnx.load(str(KV))
    unit = first_unit(model)
    batches = windows()
    rows = tt.collect_matmul_inputs(model, [unit.input_name], batches, max_rows=10 ** 6)[unit.input_name]
    # The allocation keeps every row in order when max_rows exceeds them (its own, older loop).
    reference = allocation.capture_inputs(model, [unit], batches, max_rows=10 ** 6)[unit.input_name]
    assert rows.shape == (48, unit.layers[0].weight.shape[0])
    np.testing.assert_array_equal(rows, reference)


def test_the_full_sequence_graph_captures_as_before():
    """Same values as the session run by hand (no past: the feeds as given)."""
    model = onnx.load(str(FULL))
    unit = first_unit(model)
    batch = windows(1)[0]
    ((_, (value,)),) = list(captured_values(model, [unit.input_name], [batch]))
    session = open_session(with_outputs(model, [unit.input_name]))
    (expected,) = session.run([unit.input_name], lm_feeds(session, batch))
    np.testing.assert_array_equal(value, expected)
