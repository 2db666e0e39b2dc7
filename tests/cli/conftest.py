import sys
from pathlib import Path

import onnx
import pytest

# The tiny model builders live with the rewriter tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "graph_rewrite"))

import tiny_graphs  # noqa: E402


@pytest.fixture
def model_file(tmp_path):
    """Write a tiny model of a family to tmp_path and return its path."""
    def write(family: str = "llama") -> Path:
        builder = {"gpt2": tiny_graphs.gpt2_like, "bert": tiny_graphs.bert_like,
                   "llama": tiny_graphs.llama_like}[family]
        path = tmp_path / f"{family}.onnx"
        onnx.save(builder(), path)
        return path

    return write
