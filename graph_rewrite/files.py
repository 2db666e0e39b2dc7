"""File in, file out: load (external data too), rewrite, check, and write atomically."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import onnx
import onnx_ir as ir

from .config import RewriteConfig
from .errors import ModelFileError
from .report import RewriteReport
from .rewrite import list_layers, rewrite_model

# Protobuf cannot serialise a message over 2 GiB: bigger models must keep weights outside.
PROTOBUF_LIMIT = 2**31 - 1


def _external_files(model: ir.Model, base: Path) -> set[Path]:
    files = set()
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if isinstance(tensor, ir.ExternalTensor):
            files.add((Path(tensor.base_dir or base) / tensor.location).resolve())
    return files


def _weight_bytes(model: ir.Model) -> int:
    return sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)


def load_model(path: str | os.PathLike) -> ir.Model:
    """Load an ONNX file (weights in external data stay on disk until needed)."""
    path = Path(path)
    if not path.is_file():
        raise ModelFileError(f"input model {path} does not exist or is not a file")
    if path.stat().st_size == 0:
        raise ModelFileError(f"input model {path} is empty (0 bytes)")
    try:
        model = ir.load(path)
    except Exception as error:  # protobuf and onnx raise many types for a broken file
        raise ModelFileError(f"cannot read {path} as an ONNX model: {error}") from None
    missing = sorted(str(f) for f in _external_files(model, path.resolve().parent) if not f.is_file())
    if missing:
        raise ModelFileError(f"{path} refers to external data that is missing: {', '.join(missing)}")
    return model


def check_output(path: str | os.PathLike) -> None:
    """``onnx.checker.check_model(full_check=True)`` on a written file (by path, so external data
    and models over 2 GiB work). Custom-domain nodes pass when their opset is imported."""
    onnx.checker.check_model(os.fspath(path), full_check=True)


_CHECK_ERRORS = (onnx.checker.ValidationError, onnx.shape_inference.InferenceError)


def _check_failure(in_path: Path, error: Exception) -> Exception:
    """A user error if the input itself fails the checker, else our bug."""
    try:
        check_output(in_path)
    except _CHECK_ERRORS as input_error:
        return ModelFileError(f"the input model {in_path} already fails onnx.checker.check_model(full_check=True) "
                              f"({str(input_error).splitlines()[0]}); rerun without the check (--no-check)")
    return RuntimeError(f"ortsparse produced a model that fails the ONNX checker (a bug): {error}")


def _validate_paths(in_path: Path, out_path: Path) -> None:
    if not in_path.is_file():
        raise ModelFileError(f"input model {in_path} does not exist or is not a file")
    if in_path.resolve() == out_path.resolve() or (out_path.exists() and os.path.samefile(in_path, out_path)):
        raise ModelFileError(f"output {out_path} is the input file; write the rewritten model elsewhere "
                             "(the input is never modified)")
    out_dir = out_path.resolve().parent
    if not out_dir.is_dir():
        raise ModelFileError(f"output directory {out_dir} does not exist")
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise ModelFileError(f"output directory {out_dir} is not writable")
    if out_path.is_dir():
        raise ModelFileError(f"output {out_path} is a directory")


@contextlib.contextmanager
def _staging_dir(out_dir: Path) -> Iterator[Path]:
    # Same directory as the output, so os.replace is a rename on one file system.
    staging = Path(tempfile.mkdtemp(prefix=".ortsparse-rewrite-", dir=out_dir))
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def save_model_atomically(model: ir.Model, out_path: str | os.PathLike, *, external: bool,
                          check: bool = True, protected: set[Path] = frozenset()) -> None:
    """Write ``model`` to ``out_path`` (+ ``<name>.data`` when ``external``) through a staging
    directory; nothing appears at the destination unless saving and checking succeeded.

    ``protected`` lists files (the input's external data) that must never be replaced.
    """
    out_path = Path(out_path)
    out_dir = out_path.resolve().parent
    data_name = f"{out_path.name}.data"
    if external and (out_dir / data_name).resolve() in protected:
        raise ModelFileError(f"writing {out_dir / data_name} would overwrite the input's external data; "
                             "choose another output name")
    with _staging_dir(out_dir) as staging:
        staged = staging / out_path.name
        try:
            if external:
                ir.save(model, staged, external_data=data_name)
            else:
                ir.save(model, staged)
        except OSError as error:
            raise ModelFileError(f"cannot write {out_path}: {error.strerror or error}") from None
        if check:
            check_output(staged)
        if external:
            os.replace(staging / data_name, out_dir / data_name)
        # The model file goes last: a reader never sees a new model with missing data.
        os.replace(staged, out_path)


def rewrite_file(
    in_path: str | os.PathLike,
    out_path: str | os.PathLike,
    config: RewriteConfig | None = None,
    progress: bool = True,
    *,
    external_data_threshold: int = PROTOBUF_LIMIT,
    check: bool = True,
) -> RewriteReport:
    """Rewrite the model at ``in_path`` into ``out_path`` and return the report.

    The input file is never modified. The output is written atomically, with external data
    (``<out name>.data`` next to it) when the input had external data or its weights exceed
    ``external_data_threshold`` bytes. With ``check`` the output passes
    ``onnx.checker.check_model(full_check=True)`` before it is moved into place.
    """
    from tqdm.auto import tqdm

    in_path, out_path = Path(in_path), Path(out_path)
    _validate_paths(in_path, out_path)
    stages = ["load", "analyse", "build", "rewrite", "attention", "save"]
    with tqdm(total=len(stages), desc="rewrite", unit="stage", disable=not progress, leave=False) as bar:
        def stage(name: str) -> None:
            bar.set_postfix_str(name)  # "build <layer>": one stage, one postfix per layer
            bar.update(max(0, stages.index(name.split(" ", 1)[0]) - bar.n))

        stage("load")
        model = load_model(in_path)
        input_data = _external_files(model, in_path.resolve().parent)
        _, report = rewrite_model(model, config, on_stage=stage)
        stage("save")
        external = bool(input_data) or _weight_bytes(model) > external_data_threshold
        try:
            save_model_atomically(model, out_path, external=external, check=check, protected=input_data)
        except _CHECK_ERRORS as error:
            raise _check_failure(in_path, error) from error
        bar.update(len(stages) - bar.n)
    if external:
        report.notes.append(f"weights written as external data to {out_path.name}.data")
    return report


def list_file_layers(in_path: str | os.PathLike, config: RewriteConfig | None = None) -> RewriteReport:
    """The layer table of a model file, nothing written."""
    return list_layers(load_model(in_path), config)
