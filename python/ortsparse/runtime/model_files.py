"""Model sources: :func:`load_proto` (a path, serialized bytes or an ``onnx.ModelProto``),
:func:`check_model_file` (a model file a command was given, read and checked before any session),
:func:`opset_domains` / :func:`uses_ortsparse` / :func:`is_onnx_file` (read from a file's top level only,
by a minimal protobuf varint scan: no weights loaded), and :func:`with_outputs` (a copy whose graph also
outputs some inner values, e.g. a layer's X).

External data is read under ONNX Runtime's rule (:func:`external_data_file`), not onnx's stricter
loader: a location relative to the model's folder, without ``..``, resolving (symlinks followed)
to a regular file inside that folder — or inside the folder of the model file's own target when the
model is a symlink (the Hugging Face cache layout) — with the tensor's bytes inside the file. onnx's
loader also refuses a symlinked or hard-linked data file, which ONNX Runtime runs (and which
``rewrite-onnx`` accepts), so a command would die on a model its own rewriter read.
"""
from __future__ import annotations

import math
import mmap
import os
import stat
from collections.abc import Iterator, Sequence
from typing import Any

import onnx
import onnx_ir as ir

from .._library import DOMAIN


class ModelFileUnreadable(ValueError):
    """A model file (or its external data) cannot be read: not ONNX, damaged, data missing, short or
    outside the model's folder. The message is one line naming the file."""


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def external_data_file(model_path: str | os.PathLike, location: str, where: str) -> tuple[str, int]:
    """(resolved path, size) of the external data file ``location`` of the model file
    ``model_path``, checked under ONNX Runtime's rule (module docstring); ``where`` starts each
    message (the model and the tensor). Raises :class:`ModelFileUnreadable`."""
    if not location or os.path.isabs(location) or location.startswith(("/", "\\")):
        raise ModelFileUnreadable(f"{where}: it must be a path relative to the model's folder "
                                  "(ONNX Runtime refuses this model too)")
    if ".." in location.replace("\\", "/").split("/"):
        raise ModelFileUnreadable(f"{where}: '..' is not allowed, the data must lie inside the model's folder "
                                  "(ONNX Runtime refuses this model too)")
    folder = os.path.dirname(os.path.abspath(model_path))
    real_folder = os.path.realpath(folder)
    real_model_folder = os.path.dirname(os.path.realpath(model_path))
    real = os.path.realpath(os.path.join(folder, location))
    if not _inside(real, real_folder) and not _inside(real, real_model_folder):
        raise ModelFileUnreadable(f"{where}: it resolves to {real}, outside the model's folder {real_folder} "
                                  "(a symlink?); ONNX Runtime refuses this model too")
    try:
        info = os.stat(real)
    except FileNotFoundError:
        raise ModelFileUnreadable(f"{model_path} refers to external data that is missing: {real}") from None
    except OSError as error:
        raise ModelFileUnreadable(f"{where}: cannot read {real}: {error.strerror or error}") from None
    if not stat.S_ISREG(info.st_mode):
        raise ModelFileUnreadable(f"{where}: {real} is not a regular file")
    return real, info.st_size


def check_external_bytes(where: str, real: str, size: int, offset: int, length: int | None, nbytes: int,
                         described: str) -> None:
    """The tensor's ``nbytes`` (``described``: its type and shape) lie in the data file ``real`` of
    ``size`` bytes at ``offset``, and its declared ``length`` (when given) is ``nbytes``."""
    if length is not None and length != nbytes:
        raise ModelFileUnreadable(f"{where}: length {length} does not match the tensor's {nbytes} bytes ({described})")
    if offset < 0:
        raise ModelFileUnreadable(f"{where}: cannot read {real} at the negative offset {offset}")
    if offset + nbytes > size:
        raise ModelFileUnreadable(f"{where}: bytes {offset}..{offset + nbytes} lie past the end of {real} "
                                  f"({size} bytes)")


def _tensors(graph: onnx.GraphProto) -> Iterator[tuple[onnx.TensorProto, str]]:
    """Every tensor of ``graph`` that may hold external data, with its owner for messages:
    initializers and tensor attributes, subgraphs too."""
    for tensor in graph.initializer:
        yield tensor, f"initializer {tensor.name!r}"
    for node in graph.node:
        for attribute in node.attribute:
            where = f"attribute {attribute.name!r} of node {node.name!r}"
            if attribute.HasField("t"):
                yield attribute.t, where
            for tensor in attribute.tensors:
                yield tensor, where
            for subgraph in [*attribute.graphs, *([attribute.g] if attribute.HasField("g") else [])]:
                yield from _tensors(subgraph)


def _external_fields(tensor: onnx.TensorProto, where: str) -> tuple[str, int, int | None]:
    """(location, offset, length or None) of an external tensor."""
    fields = {entry.key: entry.value for entry in tensor.external_data}
    try:
        return (fields.get("location", ""), int(fields.get("offset") or 0),
                int(fields["length"]) if fields.get("length") else None)
    except ValueError:
        raise ModelFileUnreadable(f"{where}: external data offset {fields.get('offset')!r} / length "
                                  f"{fields.get('length')!r} is not a whole number") from None


def _nbytes(tensor: onnx.TensorProto) -> int:
    return math.ceil(math.prod(tensor.dims) * ir.DataType(tensor.data_type).itemsize)


def _read_external_data(proto: onnx.ModelProto, path: str, load_weights: bool) -> None:
    """Checks every external tensor of ``proto`` (read from ``path``) under ONNX Runtime's rule;
    with ``load_weights`` its bytes are read into the tensor, as ``onnx.load`` would."""
    for tensor, owner in _tensors(proto.graph):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        location, offset, length = _external_fields(tensor, f"{path}: {owner}")
        where = f"{path}: {owner} has external data location {location!r}"
        real, size = external_data_file(path, location, where)
        try:
            nbytes = _nbytes(tensor)
        except ValueError:
            raise ModelFileUnreadable(f"{path}: {owner} has the unknown data type {tensor.data_type}") from None
        dims = list(tensor.dims)
        check_external_bytes(where, real, size, offset, length, nbytes,
                             f"{onnx.TensorProto.DataType.Name(tensor.data_type)} {dims}")
        if load_weights:
            try:
                with open(real, "rb") as handle:
                    handle.seek(offset)
                    tensor.raw_data = handle.read(nbytes)
            except OSError as error:
                raise ModelFileUnreadable(f"{where}: cannot read {real}: {error.strerror or error}") from None
            tensor.data_location = onnx.TensorProto.DEFAULT
            del tensor.external_data[:]


def load_proto(model: Any, load_weights: bool = False) -> onnx.ModelProto:
    """``model`` as an ``onnx.ModelProto``: a proto is returned as is, bytes are parsed, a path is
    loaded (external weights only when ``load_weights``; either way its external data is checked
    under ONNX Runtime's rule, module docstring). A file that cannot be read is a
    :class:`ModelFileUnreadable` naming it."""
    if isinstance(model, onnx.ModelProto):
        return model
    if isinstance(model, (bytes, bytearray)):
        return onnx.load_from_string(bytes(model))
    path = os.fspath(model)
    try:
        if not os.path.isfile(path):
            raise ModelFileUnreadable(f"model {path} " + ("is not a regular file" if os.path.exists(path)
                                                          else "does not exist"))
        proto = onnx.load(path, load_external_data=False)
    except OSError as error:
        raise ModelFileUnreadable(f"cannot read the model {path}: {error.strerror or error}") from None
    except ModelFileUnreadable:
        raise
    except Exception as error:  # noqa: BLE001 - protobuf and onnx raise many types for a damaged file
        raise ModelFileUnreadable(f"cannot read {path} as an ONNX model: {_first_line(error)}") from None
    _read_external_data(proto, path, load_weights)
    return proto


def with_weights(proto: onnx.ModelProto, path: str | os.PathLike) -> onnx.ModelProto:
    """A copy of ``proto`` — :func:`load_proto` of ``path`` without its weights — with its external
    weights read in (what ``load_proto(path, load_weights=True)`` returns, without parsing the file
    again)."""
    loaded = onnx.ModelProto()
    loaded.CopyFrom(proto)
    _read_external_data(loaded, os.fspath(path), load_weights=True)
    return loaded


def check_model_file(path: str | os.PathLike) -> None:
    """A model file a command was given, checked before any session opens it: it parses as an ONNX
    model and its external data is present, in bounds and inside its folder (the weights are not
    read). Raises :class:`ModelFileUnreadable` with one line naming the file."""
    load_proto(path)


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
