"""onnxruntime-genai model folders in, runnable rewritten folders out.

A genai folder holds ``genai_config.json`` (which names the decoder graph, usually ``model.onnx``
with weights in ``model.onnx.data``), the tokenizer files and whatever else the app needs.
:func:`rewrite_genai_folder` writes a **new** folder that ``onnxruntime_genai.Model(out)`` runs
unchanged:

- the decoder graph rewritten (:func:`ortsparse.graph_rewrite.rewrite_model`), weights as
  external data ``<filename>.data``;
- every other file of the source folder copied as is;
- when the rewritten graph uses ortsparse ops, a copy of the op library
  (``libortsparse_ops.so``) inside the folder and ``custom_ops_library: "libortsparse_ops.so"`` in
  the decoder's ``session_options``. onnxruntime-genai loads a custom-op library only from inside
  the model folder (an absolute path elsewhere is refused as "not within an allowed directory",
  ``..`` as path traversal) and resolves a relative path against the folder, so the folder is
  self-contained: moving it, or moving / uninstalling the Python package, changes nothing;
- ``ortsparse.json``: what wrote the folder (package version, the library copy's sha256, the source
  folder, the rewrite counts).

The copied library is the one the graph was written with. After an ortsparse update,
:func:`refresh_genai_library` (``ortsparse genai-config DIR``) replaces the copy with the installed
library and rewrites the config entry; ``--check`` only reports whether they differ.

Atomic: everything is written into a staging folder beside the output and renamed into place at the
end (an output folder written earlier by this function is replaced; any other existing path is
refused). The source folder is never modified. Bad input — no genai_config.json, a config that
is not JSON or names a decoder file that is missing, a model that cannot be read or rewritten — is
a :class:`~ortsparse.graph_rewrite.errors.ModelFileError` with one line, and nothing is written.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import onnx_ir as ir

from .._library import get_library_path
from ..runtime import (GENAI_CONFIG, GenaiConfigError, GenaiDecoder, genai_decoder, genai_folder, open_session,
                       uses_ortsparse)
from .config import RewriteConfig
from .errors import ModelFileError
from .files import _external_files, load_model
from .report import RewriteReport
from .rewrite import rewrite_model
from .rules import DOMAIN

LIBRARY_FILE = "libortsparse_ops.so"
RECORD_FILE = "ortsparse.json"


@dataclasses.dataclass
class GenaiRewrite:
    """What :func:`rewrite_genai_folder` wrote: the folder, its decoder graph, whether the op
    library was copied in (the graph uses ortsparse ops), and the rewrite report."""

    folder: Path
    model_file: Path
    library: Path | None
    report: RewriteReport


def read_genai_folder(path: str | os.PathLike) -> GenaiDecoder:
    """The genai folder ``path`` (or the folder of a file in it), as
    :func:`ortsparse.runtime.genai_decoder` reads it; problems are ModelFileError."""
    try:
        return genai_decoder(path)
    except GenaiConfigError as error:
        raise ModelFileError(str(error)) from None


def model_input(path: str | os.PathLike) -> Path:
    """The ONNX file a rewrite reads from ``path``: the file itself, or a genai folder's decoder."""
    path = Path(path)
    return read_genai_folder(path).model_file if path.is_dir() else path


def is_folder_rewrite(source: str | os.PathLike, output: str | os.PathLike | None) -> bool:
    """Whether ``rewrite-onnx SOURCE -o OUTPUT`` writes a genai folder: SOURCE is a folder, or
    the decoder graph of a genai folder while OUTPUT is not an ``.onnx`` file name."""
    source = Path(source)
    if source.is_dir():
        return True
    if output is None or str(output).endswith(".onnx"):
        return False
    folder = genai_folder(source)
    if folder is None:
        return False
    try:
        return genai_decoder(folder).model_file.resolve() == source.resolve()
    except GenaiConfigError:
        return False


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _package_version() -> str:
    try:
        return importlib.metadata.version("ortsparse")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _written_by_us(folder: Path) -> bool:
    return (folder / RECORD_FILE).is_file() and (folder / GENAI_CONFIG).is_file()


def check_folder_output(source: Path, output: Path) -> None:
    """Refuses an output folder that is, holds or lies in the source, or exists and is not ours."""
    resolved_source, resolved_output = source.resolve(), output.resolve()
    if resolved_output == resolved_source:
        raise ModelFileError(f"output {output} is the source folder; write the rewritten folder elsewhere "
                             "(the source is never modified)")
    if resolved_output.is_relative_to(resolved_source):
        raise ModelFileError(f"output {output} lies inside the source folder {source}; choose a folder outside it")
    if resolved_source.is_relative_to(resolved_output):
        raise ModelFileError(f"output {output} contains the source folder {source}; choose another folder")
    if output.exists() and not (output.is_dir() and (_written_by_us(output) or not any(output.iterdir()))):
        what = "a file" if not output.is_dir() else "a folder not written by ortsparse"
        raise ModelFileError(f"output {output} exists and is {what}; give a new folder (or one ortsparse wrote)")
    parent = resolved_output.parent
    if not parent.is_dir():
        raise ModelFileError(f"output directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ModelFileError(f"output directory {parent} is not writable")


@contextlib.contextmanager
def _staging_folder(parent: Path) -> Iterator[Path]:
    # Beside the output, so the final rename stays on one file system.
    staging = Path(tempfile.mkdtemp(prefix=".ortsparse-genai-", dir=parent))
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _copy_folder(source: Path, target: Path, skip: set[Path]) -> None:
    """Copy every file below ``source`` into ``target`` (same relative paths, contents not links),
    except ``skip`` and the staging folders of a rewrite running there."""
    for root, dirs, files in os.walk(source):
        dirs[:] = [d for d in dirs if not d.startswith(".ortsparse-genai-")]
        relative = Path(root).relative_to(source)
        for name in files:
            path = Path(root) / name
            if path.resolve() in skip or not path.is_file():
                continue
            (target / relative).mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target / relative / name)


def _replace_folder(staging: Path, output: Path) -> None:
    """Rename ``staging`` onto ``output``; an existing (ortsparse-written or empty) output is moved
    aside first and removed after, so a reader never sees a half folder."""
    if not output.exists():
        os.replace(staging, output)
        return
    aside = Path(tempfile.mkdtemp(prefix=".ortsparse-genai-old-", dir=output.resolve().parent))
    os.rmdir(aside)
    os.replace(output, aside)
    try:
        os.replace(staging, output)
    except BaseException:
        os.replace(aside, output)
        raise
    shutil.rmtree(aside, ignore_errors=True)


def _copy_library(folder: Path) -> str:
    """Copy the installed op library into ``folder`` (temporary name, then rename); its sha256."""
    installed = Path(get_library_path())
    target = folder / LIBRARY_FILE
    tmp = folder / f".{LIBRARY_FILE}.tmp{os.getpid()}"
    try:
        shutil.copyfile(installed, tmp)
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return _sha256(target)


def _write_json(path: Path, data: dict, indent: int = 4) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps(data, indent=indent, ensure_ascii=False) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _set_library(config: dict, use: bool) -> None:
    options = config["model"]["decoder"].setdefault("session_options", {})
    if use:
        options["custom_ops_library"] = LIBRARY_FILE
    elif options.get("custom_ops_library") == LIBRARY_FILE:
        del options["custom_ops_library"]


def rewrite_genai_folder(source: str | os.PathLike, output: str | os.PathLike, config: RewriteConfig | None = None,
                         *, check: bool = True, fuse: bool = True) -> GenaiRewrite:
    """Rewrite the decoder of the genai folder ``source`` (the folder or its decoder file) into the new
    folder ``output`` (see the module docstring). With ``check`` the rewritten decoder is opened in
    an ONNX Runtime session (with the op library) before anything is moved into place: the ONNX
    checker cannot judge these graphs (they use ORT's contrib ops in the default domain)."""
    output = Path(output)
    with staged_genai_folder(source, output, config, check=check, fuse=fuse) as staged:
        commit_genai_folder(staged, output)
    return dataclasses.replace(staged, folder=output, model_file=output / staged.model_file.relative_to(staged.folder),
                               library=output / LIBRARY_FILE if staged.library else None)


@contextlib.contextmanager
def staged_genai_folder(source: str | os.PathLike, output: str | os.PathLike, config: RewriteConfig | None = None,
                        *, check: bool = True, fuse: bool = True) -> Iterator[GenaiRewrite]:
    """The rewritten folder of :func:`rewrite_genai_folder`, written into a staging folder beside
    ``output`` and yielded (its ``folder`` is the staging folder, runnable as it is, e.g. to measure
    it); :func:`commit_genai_folder` inside the ``with`` moves it into place, leaving without
    removes it."""
    info = read_genai_folder(source)
    folder, output = info.folder, Path(output)
    check_folder_output(folder, output)
    model = load_model(info.model_file)
    input_data = _external_files(model, info.model_file.resolve().parent)
    _, report = rewrite_model(model, config, fuse=fuse)
    with _staging_folder(output.resolve().parent) as staging:
        _copy_folder(folder, staging, skip={info.model_file.resolve(), *input_data, (folder / RECORD_FILE).resolve()})
        model_file = staging / info.model_file.relative_to(folder)
        model_file.parent.mkdir(parents=True, exist_ok=True)
        ir.save(model, model_file, external_data=f"{model_file.name}.data")  # in the staging folder
        uses_library = DOMAIN in model.opset_imports
        library_sha = _copy_library(staging) if uses_library else None
        if not uses_library:
            (staging / LIBRARY_FILE).unlink(missing_ok=True)  # a stale copy from a rewritten source
        genai_config = json.loads(info.config_path.read_text(encoding="utf-8"))
        _set_library(genai_config, uses_library)
        _write_json(staging / GENAI_CONFIG, genai_config)
        if check:
            try:
                open_session(model_file)
            except Exception as error:  # onnxruntime raises its own types
                raise RuntimeError(f"ortsparse wrote a decoder ONNX Runtime cannot load (a bug): "
                                   f"{str(error).splitlines()[0]}") from None
        record = {"written_by": f"ortsparse {_package_version()}", "source": str(folder.resolve()),
                  "decoder": info.model_file.name, "library": LIBRARY_FILE if uses_library else None,
                  "library_sha256": library_sha, "rewrite": report.to_dict()["counts"]}
        _write_json(staging / RECORD_FILE, record, indent=1)
        if not uses_library:
            report.notes.append("nothing was rewritten: the folder needs no op library")
        yield GenaiRewrite(staging, model_file, staging / LIBRARY_FILE if uses_library else None, report)


def commit_genai_folder(staged: GenaiRewrite, output: str | os.PathLike) -> None:
    """Moves a folder staged by :func:`staged_genai_folder` onto ``output`` (checked again: the
    output may have changed since)."""
    source = json.loads((staged.folder / RECORD_FILE).read_text(encoding="utf-8"))["source"]
    check_folder_output(Path(source), Path(output))
    _replace_folder(staged.folder, Path(output))


def library_state(folder: str | os.PathLike) -> dict:
    """How a genai folder's op library relates to the installed one: ``needs_library`` (its decoder
    uses ortsparse ops), ``configured`` (the config's custom_ops_library), ``present`` (the copy
    exists), ``current`` (the copy is byte-identical to the installed library)."""
    info = read_genai_folder(folder)
    needs = uses_ortsparse(info.model_file)
    configured = info.session_options.get("custom_ops_library")
    copy = info.folder / LIBRARY_FILE
    installed = Path(get_library_path())
    return {"folder": str(info.folder), "needs_library": needs, "configured": configured,
            "present": copy.is_file(),
            "current": copy.is_file() and copy.stat().st_size == installed.stat().st_size
            and _sha256(copy) == _sha256(installed),
            "installed": str(installed)}


def refresh_genai_library(folder: str | os.PathLike) -> dict:
    """Bring a genai folder's op library up to date with the installed package: copy the installed
    library in (when the decoder uses ortsparse ops) and point ``custom_ops_library`` at it, or drop
    an entry of ours that is no longer needed. Each file is replaced atomically. Returns
    :func:`library_state` after the change, with ``changed``."""
    before = library_state(folder)
    info = read_genai_folder(folder)
    changed = False
    if before["needs_library"] and not before["current"]:
        sha = _copy_library(info.folder)
        changed = True
        record_path = info.folder / RECORD_FILE
        if record_path.is_file():
            try:
                record = json.loads(record_path.read_text(encoding="utf-8"))
            except ValueError:
                record = {}
            record.update(library=LIBRARY_FILE, library_sha256=sha, library_from=f"ortsparse {_package_version()}")
            _write_json(record_path, record, indent=1)
    wanted = LIBRARY_FILE if before["needs_library"] else None
    if before["configured"] != wanted and (wanted or before["configured"] == LIBRARY_FILE):
        config = json.loads(info.config_path.read_text(encoding="utf-8"))
        _set_library(config, bool(wanted))
        _write_json(info.config_path, config)
        changed = True
    after = library_state(folder)
    after["changed"] = changed
    return after

