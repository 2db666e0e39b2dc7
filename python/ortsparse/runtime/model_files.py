"""Model sources: :func:`load_proto` (a path, serialized bytes or an ``onnx.ModelProto``),
:func:`opset_domains` / :func:`uses_ortsparse` / :func:`is_onnx_file` (read from a file's top level only,
by a minimal protobuf varint scan: no weights loaded), and :func:`with_outputs` (a copy whose graph also
outputs some inner values, e.g. a layer's X)."""
from __future__ import annotations

import mmap
import os
from collections.abc import Sequence
from typing import Any

import onnx

from .._library import DOMAIN


def load_proto(model: Any, load_weights: bool = False) -> onnx.ModelProto:
    """``model`` as an ``onnx.ModelProto``: a proto is returned as is, bytes are parsed, a path is
    loaded (external weights only when ``load_weights``)."""
    if isinstance(model, onnx.ModelProto):
        return model
    if isinstance(model, (bytes, bytearray)):
        return onnx.load_from_string(bytes(model))
    return onnx.load(os.fspath(model), load_external_data=load_weights)


def _varint(data: Any, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _scan_model_file(path: str) -> tuple[set[str], set[int]]:
    """(opset domains, top-level field numbers) of an ONNX file from the top level of its protobuf:
    the graph (field 7) is skipped over, so this costs microseconds on a 600 MB model. Raises
    ValueError / IndexError / OSError when the file is not a plain protobuf."""
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        domains, fields, pos = set(), set(), 0
        while pos < len(data):
            key, pos = _varint(data, pos)
            field, wire = key >> 3, key & 7
            fields.add(field)
            if wire == 0:
                _, pos = _varint(data, pos)
            elif wire == 1:
                pos += 8
            elif wire == 5:
                pos += 4
            elif wire == 2:
                length, pos = _varint(data, pos)
                if field == 8:  # ModelProto.opset_import
                    opset = onnx.OperatorSetIdProto()
                    opset.ParseFromString(data[pos:pos + length])
                    domains.add(opset.domain)
                pos += length
            else:
                raise ValueError(f"wire type {wire}")
        if pos != len(data):
            raise ValueError("truncated")
        return domains, fields


def _file_opset_domains(path: str) -> set[str]:
    """The opset domains of an ONNX file (:func:`_scan_model_file`)."""
    return _scan_model_file(path)[0]


def is_onnx_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a file whose top level parses as an ONNX ModelProto holding a graph
    (a text, a tokenizer or a weights file does not); the graph itself is not read."""
    try:
        return 7 in _scan_model_file(os.fspath(path))[1]  # ModelProto.graph
    except (OSError, ValueError, IndexError):
        return False


def opset_domains(model: Any) -> set[str]:
    """The opset domains a model imports (for a file, read from the top level of the protobuf)."""
    if isinstance(model, (str, os.PathLike)):
        try:
            return _file_opset_domains(os.fspath(model))
        except (OSError, ValueError, IndexError):
            pass  # not a plain protobuf file (or empty): let onnx.load explain
    return {o.domain for o in load_proto(model).opset_import}


def uses_ortsparse(model: Any) -> bool:
    return DOMAIN in opset_domains(model)


def with_outputs(model: onnx.ModelProto, names: Sequence[str]) -> onnx.ModelProto:
    """A copy of ``model`` whose graph also outputs the values ``names`` (those not already outputs),
    e.g. the inputs X of linear layers for calibration."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    existing = {o.name for o in probe.graph.output}
    for name in dict.fromkeys(names):
        if name not in existing:
            probe.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
    return probe
