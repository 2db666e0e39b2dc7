"""Model files built the way a hostile or careless user would: external data that points outside
the model's folder, offsets past the end, duplicate initializers, contrib ops."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import tiny_graphs


def external_model(folder: Path, name: str = "model.onnx", location: str = "model.weights") -> Path:
    """A small Llama-like model with its weights in external data (``location`` in ``folder``)."""
    folder.mkdir(parents=True, exist_ok=True)
    proto = tiny_graphs.llama_like()
    path = folder / name
    onnx.save(proto, path, save_as_external_data=True, location=location, size_threshold=1024)
    return path


def set_external_fields(path: Path, **fields: str) -> None:
    """Rewrites ``location`` / ``offset`` / ``length`` of the first external initializer."""
    proto = onnx.load(path, load_external_data=False)
    tensor = next(t for t in proto.graph.initializer if t.data_location == TensorProto.EXTERNAL)
    entries = {e.key: e for e in tensor.external_data}
    for key, value in fields.items():
        if key in entries:
            entries[key].value = str(value)
        else:
            tensor.external_data.add(key=key, value=str(value))
    onnx.save(proto, path)


def redirect_all_external(path: Path, location: str) -> None:
    """Points every external initializer at ``location`` (same offsets)."""
    proto = onnx.load(path, load_external_data=False)
    for tensor in proto.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = location
    onnx.save(proto, path)


def duplicate_initializer_model(path: Path) -> Path:
    """A tiny model whose first weight is given twice with different values (onnx.checker refuses)."""
    proto = tiny_graphs.gpt2_like()
    first = proto.graph.initializer[0]
    other = numpy_helper.from_array(np.full(list(first.dims), 7.0, dtype=np.float32), first.name)
    proto.graph.initializer.append(other)
    onnx.save(proto, path)
    return path


def contrib_op_model(path: Path) -> Path:
    """A tiny Llama-like model with one com.microsoft node (FastGelu on its output), like the
    contrib ops of onnxruntime-genai exports."""
    proto = tiny_graphs.llama_like()
    graph = proto.graph
    source = graph.output[0]
    graph.node.append(helper.make_node("FastGelu", [source.name], ["contrib_out"], domain="com.microsoft",
                                       name="contrib_gelu"))
    extra = graph.output.add()
    extra.CopyFrom(source)
    extra.name = "contrib_out"
    proto.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    onnx.save(proto, path)
    return path


def wide_linear_model(path: Path, k: int, n: int = 2) -> Path:
    """Relu(X @ W1) @ W2 with an MLP-like shape and a wide K (K > 65536 blocks of 1 row)."""
    rng = np.random.default_rng(0)
    w_up = rng.standard_normal((8, k)).astype(np.float32)
    w_down = rng.standard_normal((k, n)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["X", "up.weight"], ["h"], name="/mlp/up_proj/MatMul"),
             helper.make_node("Relu", ["h"], ["a"], name="/mlp/act"),
             helper.make_node("MatMul", ["a", "down.weight"], ["Y"], name="/mlp/down_proj/MatMul")]
    graph = helper.make_graph(nodes, "wide", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 8])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, n])],
                              [numpy_helper.from_array(w_up, "up.weight"), numpy_helper.from_array(w_down, "down.weight")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), path)
    return path


def snapshot(folder: Path) -> dict[str, bytes | str]:
    """Every entry under ``folder``: file bytes, or the kind of a non-regular entry."""
    result: dict[str, bytes | str] = {}
    for entry in sorted(folder.rglob("*")):
        key = str(entry.relative_to(folder))
        if entry.is_symlink():
            result[key] = "symlink -> " + os.readlink(entry)
        elif entry.is_file():
            result[key] = entry.read_bytes()
        else:
            result[key] = "dir" if entry.is_dir() else "special"
    return result


def damage(folder: Path, how: str) -> Path:
    """Damages the model in ``folder`` (a genai folder or a model with external data) as a careless
    copy or a full disk would, and returns what a command is given: ``truncated-data`` (the external
    data cut short), ``corrupt-model`` (the graph file's bytes garbled), ``text-as-model`` (a text
    file in place of the graph)."""
    model = folder / "model.onnx"
    if how == "truncated-data":
        data = next(p for p in folder.iterdir() if p.suffix in (".data", ".weights"))
        data.write_bytes(data.read_bytes()[:1000])
    elif how == "corrupt-model":
        raw = bytearray(model.read_bytes())
        raw[len(raw) // 3: len(raw) // 3 + 64] = b"\xff" * 64
        model.write_bytes(bytes(raw))
    else:
        model.write_text("the quick brown fox, not an ONNX model\n")
    return folder
