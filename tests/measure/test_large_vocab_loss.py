"""The loss of a 262,144-token vocabulary in bounded memory (issue 29: a float64 log softmax over
(4095, 262144) took ~30 GB): the rows are scored a block at a time, equal to a whole float64
reference, and the harness's own allocations stay near one block whatever the vocabulary."""
import tracemalloc

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from ortsparse.measure import perplexity as perplexity_module
from ortsparse.measure.perplexity import log_softmax_blocks, perplexity, score_logits

VOCAB = 262_144  # Gemma-3's
MB = 1 << 20


def reference(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    rows = logits.astype(np.float64)
    rows = rows - rows.max(-1, keepdims=True)
    logp = rows - np.log(np.exp(rows).sum(-1, keepdims=True))
    return -logp[np.arange(len(targets)), targets]


def test_blocks_equal_the_whole_float64_reference():
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((37, 1000)) * 4).astype(np.float32)
    targets = rng.integers(0, 1000, 37)
    for chunk_bytes in (1, 8 * 1000 * 5, 1 << 30):  # one row a block, 5 rows (a short last block), all
        nll, top = score_logits(logits, targets, chunk_bytes=chunk_bytes)
        np.testing.assert_allclose(nll, reference(logits, targets), rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(top, logits.argmax(-1))
        blocks = list(log_softmax_blocks(logits, chunk_bytes=chunk_bytes))
        assert blocks[0][0] == 0 and blocks[-1][1] == 37
        whole = np.concatenate([block for _, _, block in blocks])
        np.testing.assert_allclose(-whole[np.arange(37), targets], reference(logits, targets), rtol=1e-12)


def peak_bytes(function, *args, **kwargs) -> tuple[object, int]:
    """(result, peak bytes of the allocations ``function`` makes: numpy reports its buffers to tracemalloc)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        result = function(*args, **kwargs)
        return result, tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def test_score_logits_memory_does_not_grow_with_the_vocabulary():
    rows = 64
    logits = np.random.default_rng(1).standard_normal((rows, VOCAB), dtype=np.float32)  # 64 MB
    targets = np.arange(rows) * 4000
    (nll, _), peak = peak_bytes(score_logits, logits, targets)
    # One float64 block (CHUNK_BYTES) and per-row vectors; a whole float64 copy alone would be 128 MB.
    assert peak < perplexity_module.CHUNK_BYTES + 8 * MB, peak / MB
    np.testing.assert_allclose(nll[:4], reference(logits[:4], targets[:4]), rtol=1e-12)


def linear_lm(vocab: int) -> onnx.ModelProto:
    """logits[0, t, v] = input_ids[t] * slope[v] + bias[v]: a full-sequence 'LM' with ``vocab`` outputs."""
    rng = np.random.default_rng(2)
    slope = numpy_helper.from_array((rng.standard_normal(vocab) * 4 / vocab).astype(np.float32), "slope")
    bias = numpy_helper.from_array((rng.standard_normal(vocab) * 3).astype(np.float32), "bias")
    axes = numpy_helper.from_array(np.array([-1], np.int64), "axes")
    nodes = [helper.make_node("Cast", ["input_ids"], ["ids_f"], to=TensorProto.FLOAT),
             helper.make_node("Unsqueeze", ["ids_f", "axes"], ["ids_col"]),
             helper.make_node("Mul", ["ids_col", "slope"], ["scaled"]),
             helper.make_node("Add", ["scaled", "bias"], ["logits"])]
    graph = helper.make_graph(
        nodes, "linear_lm",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "sequence"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [1, "sequence"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "sequence", vocab])],
        [slope, bias, axes])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def linear_lm_nll(model: onnx.ModelProto, windows: np.ndarray, first: int) -> float:
    slope, bias = (numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer[:2])
    total, count = 0.0, 0
    for window in windows:
        logits = (window[:, None].astype(np.float32) * slope.astype(np.float32)
                  + bias.astype(np.float32)).astype(np.float32)[first:-1]
        total += reference(logits, window[first + 1:]).sum()
        count += len(window) - 1 - first
    return total / count


@pytest.mark.parametrize("bos", [None, 5])
def test_perplexity_of_a_262k_vocabulary_in_bounded_memory(bos):
    model = linear_lm(VOCAB)
    window_len = 96
    tokens = np.random.default_rng(3).integers(0, VOCAB, 2 * window_len)
    result, peak = peak_bytes(perplexity, model, tokens, windows=2, window_len=window_len, bos=bos)
    from ortsparse.measure.corpus import first_scored, lm_windows

    windows = lm_windows(tokens, 2, window_len, bos=bos)
    assert result["nll"] == pytest.approx(linear_lm_nll(model, windows, first_scored(bos)), rel=1e-6)
    # The model's own float32 output (96 x 262144 x 4 = 96 MB) may count once; on top of it one
    # float64 block. The whole float64 log softmax the harness used to make: 2 x 190 MB.
    logits_bytes = window_len * VOCAB * 4
    assert peak < logits_bytes + perplexity_module.CHUNK_BYTES + 16 * MB, peak / MB
