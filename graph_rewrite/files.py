"""File in, file out: load (external data too), check, rewrite, check, and write atomically.

Reading stays inside what the user named: the model file and the external data it references,
under ONNX Runtime's rule (relative locations inside the model's folder). Writing goes through
graph_rewrite/output_paths.py: no output may be an input, a device or a FIFO, and the outputs (model,
external data, report) appear together or not at all.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import onnx
import onnx_ir as ir

from ..runtime import ModelFileUnreadable, check_external_bytes, external_data_file
from .config import RewriteConfig
from .errors import ModelFileError
from .report import RewriteReport
from .rewrite import list_layers, rewrite_model
from .load_check import check_nodes_load
from .output_paths import Inputs, OutputFiles

# Protobuf cannot serialise a message over 2 GiB: bigger models must keep weights outside.
PROTOBUF_LIMIT = 2**31 - 1


@dataclasses.dataclass
class _ExternalSlot:
    """One external tensor of the model and how to put a replacement in its place."""

    tensor: ir.ExternalTensor
    owner: str  # "initializer 'w'" / "attribute 'value' of node 'c'", for messages
    replace: Callable[[ir.ExternalTensor], None]


def _external_slots(model: ir.Model) -> list[_ExternalSlot]:
    """Every external tensor: initializers and tensor attributes (Constant nodes), subgraphs too."""
    slots: list[_ExternalSlot] = []

    def visit(graph: ir.Graph) -> None:
        for value in graph.initializers.values():
            if isinstance(value.const_value, ir.ExternalTensor):
                slots.append(_ExternalSlot(value.const_value, f"initializer {value.name!r}",
                                           lambda t, v=value: setattr(v, "const_value", t)))
        for node in graph:
            for name, attribute in node.attributes.items():
                where = f"attribute {name!r} of node {node.name!r}"
                if attribute.type == ir.AttributeType.TENSOR and isinstance(attribute.value, ir.ExternalTensor):
                    slots.append(_ExternalSlot(attribute.value, where,
                                               lambda t, n=node, k=name: n.attributes.__setitem__(k, ir.AttrTensor(k, t))))
                elif attribute.type == ir.AttributeType.TENSORS and any(
                        isinstance(t, ir.ExternalTensor) for t in attribute.value):
                    raise ModelFileError(f"{where}: external data in a list of tensors is not supported")
                elif attribute.type == ir.AttributeType.GRAPH:
                    visit(attribute.value)
                elif attribute.type == ir.AttributeType.GRAPHS:
                    for subgraph in attribute.value:
                        visit(subgraph)

    visit(model.graph)
    return slots


def _external_tensors(model: ir.Model) -> list[ir.ExternalTensor]:
    return [slot.tensor for slot in _external_slots(model)]


def _external_files(model: ir.Model, base: Path) -> set[Path]:
    return {(Path(t.base_dir or base) / t.location).resolve() for t in _external_tensors(model)}


def _weight_bytes(model: ir.Model) -> int:
    return sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)


def needs_external_data(model: ir.Model, threshold: int = PROTOBUF_LIMIT) -> bool:
    """Whether a copy of ``model`` is saved with its weights as external data of its own: it read
    external data (after :func:`load_model` its tensors point at the input's files by absolute
    path, which the checker refuses and a moved copy loses), or its weights exceed ``threshold``
    bytes."""
    return bool(_external_tensors(model)) or _weight_bytes(model) > threshold


def pin_external_data(model: ir.Model, path: Path) -> None:
    """Checks every external tensor under ONNX Runtime's rule, so a model is never read beyond
    what its file names (:func:`ortsparse.runtime.external_data_file`: a relative location without
    ``..`` resolving to a regular file inside the model's folder, or inside the folder of the model
    file's own target when the model is a symlink — the Hugging Face cache layout, which ONNX
    Runtime accepts) and the tensor's bytes lie within that file. Then points each tensor at its
    checked file by absolute path, so reading does not depend on the working directory."""
    for slot in _external_slots(model):
        tensor = slot.tensor
        location = os.fspath(tensor.location)
        where = f"{path}: {slot.owner} has external data location {location!r}"
        offset = tensor.offset or 0
        try:
            real, size = external_data_file(path, location, where)
            check_external_bytes(where, real, size, offset, tensor.length, tensor.nbytes,
                                 f"{tensor.dtype.name} {list(tensor.shape)}")
        except ModelFileUnreadable as error:
            raise ModelFileError(str(error)) from None
        # An empty base folder turns off onnx_ir's own (stricter: no symlink may leave the
        # logical folder, no hard links) check, which this one replaces.
        slot.replace(ir.ExternalTensor(real, offset, tensor.length, tensor.dtype, shape=tensor.shape,
                                       name=tensor.name, doc_string=tensor.doc_string,
                                       metadata_props=dict(tensor.metadata_props), base_dir=""))


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _duplicate_names(graph: onnx.GraphProto) -> list[str]:
    """Initializer names given twice in ``graph`` or a subgraph (onnx_ir would keep only one)."""
    found: list[str] = []
    seen: set[str] = set()
    for tensor in [*graph.initializer, *(s.values for s in graph.sparse_initializer)]:
        if tensor.name in seen and tensor.name not in found:
            found.append(tensor.name)
        seen.add(tensor.name)
    for node in graph.node:
        for attribute in node.attribute:
            subgraphs = [*attribute.graphs, *([attribute.g] if attribute.HasField("g") else [])]
            for subgraph in subgraphs:
                found.extend(n for n in _duplicate_names(subgraph) if n not in found)
    return found


@functools.cache
def _ort_default_domain_ops() -> frozenset[str]:
    """Ops onnxruntime registers in the default ONNX domain without the ONNX standard knowing them
    (``SimplifiedLayerNormalization`` of onnxruntime-genai graphs)."""
    try:
        from onnxruntime.capi.onnxruntime_pybind11_state import get_all_operator_schema
    except ImportError:
        return frozenset()
    known = {schema.name for schema in onnx.defs.get_all_schemas_with_history() if schema.domain in ("", "ai.onnx")}
    return frozenset(schema.name for schema in get_all_operator_schema()
                     if schema.domain in ("", "ai.onnx") and schema.name not in known)


def _plain_check(model: str | os.PathLike | onnx.ModelProto) -> Exception | None:
    """``onnx.checker.check_model(full_check=False)``'s refusal, or None. Nodes of the default
    domain that only onnxruntime defines (its contrib ops there, as onnxruntime-genai writes them)
    are judged like contrib ops in their own domain: the checker skips their schema (by a second
    check of a copy of the proto where they carry a domain of their own; its external tensors are
    placeholders, as in :func:`_checker_error_without_external_files`: their files are checked by
    :func:`pin_external_data` on reading, and written by us on writing)."""
    try:
        onnx.checker.check_model(model if isinstance(model, onnx.ModelProto) else os.fspath(model), full_check=False)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as error:
        if "No Op registered for" not in str(error):
            return error
        refused = error
    else:
        return None
    ort_only = _ort_default_domain_ops()
    if isinstance(model, onnx.ModelProto):
        proto = onnx.ModelProto()
        proto.CopyFrom(model)
    else:
        proto = onnx.load(os.fspath(model), load_external_data=False)
    moved = [node for node in proto.graph.node if node.domain in ("", "ai.onnx") and node.op_type in ort_only]
    if not moved:
        return refused
    for node in moved:
        node.domain = _ORT_DEFAULT_DOMAIN_STAND_IN
    proto.opset_import.append(onnx.helper.make_opsetid(_ORT_DEFAULT_DOMAIN_STAND_IN, 1))
    _external_placeholders(proto)
    try:
        onnx.checker.check_model(proto, full_check=False)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as error:
        return error
    return None


_ORT_DEFAULT_DOMAIN_STAND_IN = "ortsparse.check.onnxruntime-default-domain"


def _checker_error(path: Path) -> Exception | None:
    """What ``onnx.checker.check_model`` says about the file, without its full check: strict shape
    inference cannot type contrib ops (onnxruntime-genai's com.microsoft nodes) and such models run
    fine. It checks graph structure, SSA form, unique initializer names, opset imports and
    external data references (:func:`_plain_check`). By path: the checker loads (and frees) its own
    copy before ours."""
    return _plain_check(path)


def _checker_error_without_external_files(proto: onnx.ModelProto) -> Exception | None:
    """The checker's verdict with external data left to :func:`pin_external_data` (ONNX
    Runtime's rule): the checker refuses any symlinked data file, which ONNX Runtime accepts when
    it stays inside the model's folder. Checks a copy whose external initializers are empty
    placeholders of the same name and type (the proto of a model with external data is small)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    _external_placeholders(copy)
    return _plain_check(copy)


def _external_placeholders(proto: onnx.ModelProto) -> None:
    """External initializers become empty tensors of the same name and type (in place)."""
    for tensor in proto.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            del tensor.external_data[:]
            tensor.data_location = onnx.TensorProto.DEFAULT
            del tensor.dims[:]
            tensor.dims.append(0)


def load_model(path: str | os.PathLike, *, check: bool = True) -> ir.Model:
    """Load an ONNX file (weights in external data stay on disk until needed). Refused with a
    ModelFileError: external data outside the model's folder (:func:`pin_external_data`),
    duplicate initializer names (one of two different weights would be silently dropped) and,
    with ``check``, whatever ``onnx.checker.check_model`` refuses (:func:`_checker_error`)."""
    path = Path(path)
    if not path.exists():
        raise ModelFileError(f"input model {path} does not exist")
    if not path.is_file():
        raise ModelFileError(f"input model {path} is not a regular file")
    if path.stat().st_size == 0:
        raise ModelFileError(f"input model {path} is empty (0 bytes)")
    checker_error = _checker_error(path) if check else None
    try:
        proto = onnx.load(os.fspath(path), load_external_data=False)
        model = ir.serde.deserialize_model(proto)
    except Exception as error:  # protobuf and onnx raise many types for a broken file
        raise ModelFileError(f"cannot read {path} as an ONNX model: {_first_line(error)}") from None
    pin_external_data(model, path)  # before the checker's verdict: its messages are clearer
    duplicates = _duplicate_names(proto.graph)
    if duplicates:
        raise ModelFileError(f"the input model {path} has several initializers named {', '.join(map(repr, duplicates))} "
                             "(onnx.checker refuses it: initializer names must be unique)")
    if checker_error is not None and _external_tensors(model):
        checker_error = _checker_error_without_external_files(proto)
    if checker_error is not None:
        raise ModelFileError(f"the input model {path} fails onnx.checker.check_model: {_first_line(checker_error)}")
    return model


def check_output(path: str | os.PathLike) -> None:
    """``onnx.checker.check_model(full_check=True)`` on a written file (by path, so external data
    and models over 2 GiB work). Custom-domain nodes pass when their opset is imported."""
    onnx.checker.check_model(os.fspath(path), full_check=True)


_CHECK_ERRORS = (onnx.checker.ValidationError, onnx.shape_inference.InferenceError)


def check_written(staged: Path, in_path: Path, notes: list[str]) -> None:
    """The output passes ``onnx.checker.check_model(full_check=True)`` — or, when the input itself
    fails the full check (its strict shape inference; the input passed the plain check on
    loading), the plain check, as the input did: a rewrite is held to the input's standard, and
    ``notes`` says so. Anything else is our bug."""
    try:
        check_output(staged)
        return
    except _CHECK_ERRORS as error:
        output_error = error
    try:
        check_output(in_path)
    except _CHECK_ERRORS as input_error:
        plain_error = _plain_check(staged)
        if plain_error is not None:
            output_error = plain_error
        else:
            notes.append(f"the input fails onnx.checker's full check ({_first_line(input_error)}); the output "
                         "passed the plain check, as the input did")
            return
    raise RuntimeError(f"ortsparse produced a model that fails the ONNX checker (a bug): {output_error}")


def _read_files(in_path: Path, model: ir.Model | None, also: Mapping[str | os.PathLike, str] | Inputs) -> Inputs:
    """What a rewrite reads: the model, its external data and the caller's other inputs."""
    files = Inputs(also)
    files.add_file(in_path, "the input file")
    if model is not None:
        for data in _external_files(model, in_path.absolute().parent):
            files.add_file(data, "the input's external data")
    return files


def save_model(model: ir.Model, outputs: OutputFiles, out_path: Path, data_path: Path | None) -> Path:
    """Stage ``model`` for ``out_path`` (+ external data at ``data_path``, same folder) in
    ``outputs``; returns the staged model file. Nothing is moved into place here."""
    def write(staged: Path) -> None:
        if data_path is not None:
            ir.save(model, staged, external_data=data_path.name)
        else:
            ir.save(model, staged)

    outputs.write(out_path, write)
    return outputs.staged(out_path)


def rewrite_file(
    in_path: str | os.PathLike,
    out_path: str | os.PathLike,
    config: RewriteConfig | None = None,
    progress: bool = True,
    *,
    external_data_threshold: int = PROTOBUF_LIMIT,
    check: bool = True,
    report_path: str | os.PathLike | None = None,
    inputs: Mapping[str | os.PathLike, str] | Inputs = {},  # noqa: B006 - read only
    fuse: bool = True,
    outputs: OutputFiles | None = None,
) -> RewriteReport:
    """Rewrite the model at ``in_path`` into ``out_path`` and return the report.

    The input file is never modified. The output is written atomically, with external data
    (``<out name>.data`` next to it) when the input had external data or its weights exceed
    ``external_data_threshold`` bytes. With ``check`` the output passes
    ``onnx.checker.check_model(full_check=True)`` (or the plain check, if the input fails the full
    one: :func:`check_written`) before it is moved into place. ``report_path``:
    also write the report (JSON), together with the model or not at all. ``inputs``: other files
    the caller read ({path: description}, e.g. a config file), which no output may replace.
    Every output path is checked (graph_rewrite/output_paths.py) before the model is even loaded.
    ``outputs``: stage the files there and let the caller commit them with its other outputs
    (default: committed here).
    """
    from tqdm.auto import tqdm

    in_path = Path(in_path)  # out_path as given: a trailing "/" (a folder, refused) must reach outputs.add
    if not in_path.exists():
        raise ModelFileError(f"input model {in_path} does not exist")
    if not in_path.is_file():
        raise ModelFileError(f"input model {in_path} is neither an ONNX file nor an onnxruntime-genai folder")
    own = outputs is None
    outputs = OutputFiles(_read_files(in_path, None, inputs)) if own else outputs
    stages = ["load", "analyse", "build", "fuse", "rewrite", "attention", "save"]
    try:
        outputs.read(_read_files(in_path, None, inputs))
        out_path = outputs.add(out_path, "output")  # fail before the slow part
        report_target = outputs.add(report_path, "report") if report_path is not None else None
        with tqdm(total=len(stages), desc="rewrite", unit="stage", disable=not progress, leave=False) as bar:
            def stage(name: str) -> None:
                bar.set_postfix_str(name)  # "build <layer>": one stage, one postfix per layer
                bar.update(max(0, stages.index(name.split(" ", 1)[0]) - bar.n))

            stage("load")
            model = load_model(in_path)
            outputs.read(_read_files(in_path, model, {}))
            external = needs_external_data(model, external_data_threshold)
            # Data is declared (and so moved into place) before the model: a reader never sees a
            # new model with missing data.
            data_path = outputs.add(out_path.with_name(f"{out_path.name}.data"), "output's external data",
                                    first=True) if external else None
            _, report = rewrite_model(model, config, on_stage=stage, fuse=fuse)
            if check:
                check_nodes_load(model)  # a node the op library refuses: exit 2, nothing written
            stage("save")
            staged = save_model(model, outputs, out_path, data_path)
            if check:
                check_written(staged, in_path, report.notes)
            if external:
                report.notes.append(f"weights written as external data to {out_path.name}.data")
            if report_target is not None:
                outputs.write_text(report_target, json.dumps(report.to_dict(), indent=2) + "\n")
            if own:
                outputs.commit()
            bar.update(len(stages) - bar.n)
    finally:
        if own:
            outputs.discard()
    return report


def list_file_layers(in_path: str | os.PathLike, config: RewriteConfig | None = None, *,
                     report_path: str | os.PathLike | None = None,
                     inputs: Mapping[str | os.PathLike, str] | Inputs = {},  # noqa: B006 - read only
                     ) -> RewriteReport:
    """The layer table of a model file; only ``report_path`` (the report as JSON) is written, if
    given, under the same rules as :func:`rewrite_file`."""
    in_path = Path(in_path)
    with OutputFiles(_read_files(in_path, None, inputs)) as outputs:
        target = outputs.add(report_path, "report") if report_path is not None else None
        model = load_model(in_path)
        outputs.read(_read_files(in_path, model, {}))
        report = list_layers(model, config)
        if target is not None:
            outputs.write_text(target, json.dumps(report.to_dict(), indent=2) + "\n")
            outputs.commit()
    return report
