"""Run original and rewritten models in onnxruntime on fixed inputs (shared by the tests)."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort

TINY_VOCAB = 40


def token_feeds(model: onnx.ModelProto, batch: int = 2, seq: int = 5, seed: int = 0, vocab: int = TINY_VOCAB):
    """Inputs for the tiny language models: ids, ones for masks, 0..S-1 positions, normal floats."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for graph_input in model.graph.input:
        name = graph_input.name
        elem = graph_input.type.tensor_type.elem_type
        dims = graph_input.type.tensor_type.shape.dim
        shape = [batch, seq, *[d.dim_value or 1 for d in dims[2:]]][: len(dims)]
        if elem == onnx.TensorProto.INT64:
            if "mask" in name:
                feeds[name] = np.ones(shape, np.int64)
            elif "position" in name:
                feeds[name] = np.broadcast_to(np.arange(seq, dtype=np.int64), shape).copy()
            else:
                feeds[name] = rng.integers(0, vocab, size=shape).astype(np.int64)
        elif elem == onnx.TensorProto.FLOAT16:
            feeds[name] = rng.standard_normal(shape).astype(np.float16)
        else:
            feeds[name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def run_reference(model: onnx.ModelProto, feeds) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def run_ortsparse(model: onnx.ModelProto, feeds) -> list[np.ndarray]:
    import ortsparse

    return ortsparse.inference_session(model).run(None, feeds)


def assert_same_outputs(reference: onnx.ModelProto, rewritten: onnx.ModelProto, feeds, rtol: float = 1e-4):
    expected = run_reference(reference, feeds)
    actual = run_ortsparse(rewritten, feeds)
    assert len(expected) == len(actual)
    for e, a in zip(expected, actual):
        scale = float(np.abs(e).max()) or 1.0
        np.testing.assert_allclose(a, e, rtol=rtol, atol=rtol * scale)


def relative_l2(reference: onnx.ModelProto, rewritten: onnx.ModelProto, feeds) -> float:
    e = run_reference(reference, feeds)[0].astype(np.float64)
    a = run_ortsparse(rewritten, feeds)[0].astype(np.float64)
    return float(np.linalg.norm(a - e) / np.linalg.norm(e))


def op_types(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def kwta_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == "KwtaBlockMatMul" and n.domain == "ai.ortsparse"]
