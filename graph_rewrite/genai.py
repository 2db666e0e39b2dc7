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

Files (graph_rewrite/output_paths.py, the policy of every command): every file of the source folder
is an input; the output folder may not be, lie inside or contain an input, and an existing one is
replaced only when ortsparse wrote it (or it is empty). A symlink in the source that resolves inside
it is written as a relative symlink to the same place in the new folder (sub-folders too); one that
leaves the folder, points nowhere or loops is refused (:func:`source_entries`, before the long
part) — copying it would read (and hand on) a file the user did not name. Everything is staged
beside the output and renamed into place at the end, with the user's umask; a write error (disk
full, quota, a file too large) is one line and leaves nothing. The source folder is never modified. Bad input — no genai_config.json, a config
that is not JSON or names a decoder file that is missing, a model that cannot be read or rewritten —
is a :class:`~ortsparse.graph_rewrite.errors.ModelFileError` with one line, and nothing is written.
"""
from __future__ import annotations

import dataclasses
import errno
import importlib.metadata
import json
import os
import shutil
import stat
from pathlib import Path

import onnx_ir as ir

from .._library import get_library_path
from ..digest import sha256
from ..runtime import (GENAI_CONFIG, GenaiConfigError, GenaiDecoder, ModelFileUnreadable, check_model_file,
                       genai_decoder, genai_folder, is_onnx_file, open_session, uses_ortsparse)
from .config import RewriteConfig
from .errors import ModelFileError
from .files import load_model
from .load_check import UnloadableOutputError, check_nodes_load
from .output_paths import _OLD_STAGING_PREFIXES, Inputs, OutputFiles, external_data_files
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
    """The ONNX file a command reads from ``path``: the file itself, or a genai folder's decoder,
    checked before any session opens it (:func:`ortsparse.runtime.check_model_file`). A file that
    is not an ONNX model (a text, a tokenizer), a damaged one or one whose external data is missing,
    short or outside its folder is a ModelFileError; a missing path is returned as is (the caller
    says it does not exist)."""
    path = Path(path)
    if path.is_dir():
        path = read_genai_folder(path).model_file
    elif path.is_file() and not is_onnx_file(path):
        raise ModelFileError(f"{path} is not an ONNX model or genai folder")
    if path.is_file():
        try:
            check_model_file(path)
        except ModelFileUnreadable as error:
            raise ModelFileError(str(error)) from None
    return path


def generated_input_sizes(folder: str | os.PathLike) -> dict[str, int]:
    """Sizes of the symbolic dimensions of a genai decoder's inputs for generated test inputs
    (ortsparse.verify): its K/V head size comes from its config, the lengths are small."""
    return {"kv_cache_dim": read_genai_folder(folder).head_size, "past_sequence_length": 4, "sequence_length": 8,
            "total_sequence_length": 12}


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


def _package_version() -> str:
    try:
        return importlib.metadata.version("ortsparse")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _written_by_us(folder: Path) -> bool:
    return (folder / RECORD_FILE).is_file() and (folder / GENAI_CONFIG).is_file()


def written_by_ortsparse(folder: Path) -> bool:
    """An output folder :func:`rewrite_genai_folder` may replace: one it wrote, or an empty one."""
    return _written_by_us(folder) or not any(folder.iterdir())


@dataclasses.dataclass(frozen=True)
class _Entry:
    """A file of a source folder to copy: its path, its place relative to the folder, where it
    resolves, and for a symlink the relative link to write (None: a regular file, copied)."""

    path: Path
    relative: Path
    resolved: Path
    link: str | None


def source_entries(source: str | os.PathLike) -> list[_Entry]:
    """Every file below the genai folder ``source`` that :func:`rewrite_genai_folder` copies as it
    is: not the decoder and its external data (written anew), ortsparse's record, nor the staging
    folders of a command running there. Checked before anything is read or written: a symlink must
    resolve to something that exists inside ``source`` (one that leaves it, points nowhere or
    loops is refused, as is any entry that is not a file or folder: ModelFileError). Commands that
    write a genai folder call this before their long part."""
    info = read_genai_folder(source)
    source = info.folder
    real_source = Path(os.path.realpath(source))
    rewritten = {Path(os.path.realpath(p)) for p in [info.model_file, *external_data_files(info.model_file),
                                                      source / RECORD_FILE]}
    entries = []
    for root, dirs, files in os.walk(real_source):  # symlinked sub-folders are listed in dirs, not entered
        dirs[:] = [d for d in dirs if not d.startswith(_OLD_STAGING_PREFIXES)]
        relative = Path(root).relative_to(real_source)
        for name in [*files, *dirs]:
            path = Path(root) / name
            shown = source / relative / name
            link = path.is_symlink()
            if not link and name in dirs:
                continue
            resolved = Path(os.path.realpath(path))
            if resolved in rewritten:
                continue
            if link:
                if not resolved.is_relative_to(real_source):
                    raise ModelFileError(f"{shown} is a symlink to {resolved}, outside the folder; ortsparse copies "
                                         "only what lies inside the folder you named (copy the file in, or remove "
                                         "the link)")
                try:
                    os.stat(path)
                except OSError as error:
                    problem = ("is a symlink loop" if error.errno == errno.ELOOP
                               else f"is a symlink to {resolved}, which does not exist")
                    raise ModelFileError(f"{shown} {problem}; remove the link") from None
                entries.append(_Entry(path, relative / name, resolved,
                                      os.path.relpath(resolved, os.path.realpath(root))))
                continue
            if not stat.S_ISREG(path.stat().st_mode):
                raise ModelFileError(f"{shown} is not a regular file (a FIFO, socket or device); a model folder "
                                     "holds files and folders only")
            entries.append(_Entry(path, relative / name, resolved, None))
    return entries


def _copy_folder(entries: list[_Entry], target: Path) -> None:
    """Copy ``entries`` (:func:`source_entries`) into ``target`` at the same relative paths: a file
    with its contents, a symlink as the same relative link."""
    for entry in entries:
        (target / entry.relative).parent.mkdir(parents=True, exist_ok=True)
        if entry.link is not None:
            os.symlink(entry.link, target / entry.relative)
        else:
            shutil.copy2(entry.path, target / entry.relative)


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
    return sha256(target)


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
                         *, check: bool = True, fuse: bool = True, outputs: OutputFiles | None = None) -> GenaiRewrite:
    """Rewrite the decoder of the genai folder ``source`` (the folder or its decoder file) into the new
    folder ``output`` (see the module docstring). With ``check`` the rewritten decoder is opened in
    an ONNX Runtime session (with the op library) before anything is moved into place: the ONNX
    checker cannot judge these graphs (they use ORT's contrib ops in the default domain).
    ``outputs``: stage the folder there (declared as an output folder; the source folder is added to
    its inputs) and let the caller commit it with its other outputs; default: committed here."""
    info = read_genai_folder(source)
    folder = info.folder
    own = outputs is None
    staging_outputs = OutputFiles() if own else outputs
    try:
        staging_outputs.read(folder, "the source folder")
        destination = staging_outputs.add_folder(output, "output", replaceable=written_by_ortsparse)
        entries = source_entries(folder)
        model = load_model(info.model_file)
        _, report = rewrite_model(model, config, fuse=fuse)
        if check:
            check_nodes_load(model)  # a node the op library refuses: exit 2 before anything is staged
        staging = staging_outputs.staged(destination)
        model_file = staging / info.model_file.relative_to(folder)
        with staging_outputs.writing(destination):
            _copy_folder(entries, staging)
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
                raise UnloadableOutputError(f"the rewritten decoder would not load in ONNX Runtime: "
                                            f"{str(error).splitlines()[0]}; nothing was written. This is a "
                                            f"rewriter bug (please report it)") from None
        record = {"written_by": f"ortsparse {_package_version()}", "source": str(folder.resolve()),
                  "decoder": info.model_file.name, "library": LIBRARY_FILE if uses_library else None,
                  "library_sha256": library_sha, "rewrite": report.to_dict()["counts"]}
        with staging_outputs.writing(destination):
            _write_json(staging / RECORD_FILE, record, indent=1)
        if own:
            staging_outputs.commit()
    finally:
        if own:
            staging_outputs.discard()
    if not uses_library:
        report.notes.append("nothing was rewritten: the folder needs no op library")
    output = Path(output)
    return GenaiRewrite(output, output / info.model_file.relative_to(folder),
                        output / LIBRARY_FILE if uses_library else None, report)


def _loaded_library(folder: Path, configured: str | None) -> tuple[Path | None, str | None]:
    """(the file onnxruntime-genai loads for ``custom_ops_library = configured``, or None; why it
    loads none). genai resolves a relative name against the model folder and refuses a path that
    leaves it (an absolute path elsewhere, ``..``)."""
    if not configured:
        return None, "not configured"
    # As a string: a Path drops a trailing "/", and "libortsparse_ops.so/" names no file genai can load.
    path = configured if os.path.isabs(configured) else os.path.join(folder, configured)
    inside = Path(os.path.normpath(os.path.abspath(path))).is_relative_to(Path(os.path.normpath(folder.absolute())))
    if not inside or ".." in Path(configured).parts:
        return None, f"custom_ops_library {configured!r} lies outside the folder (onnxruntime-genai refuses it)"
    if not os.path.isfile(path):
        return None, f"custom_ops_library {configured!r} is missing (or not a file)"
    return Path(path), None


def _same_file_content(path: Path, installed: Path) -> bool:
    return (path.is_file() and path.stat().st_size == installed.stat().st_size
            and sha256(path) == sha256(installed))


def library_state(folder: str | os.PathLike) -> dict:
    """How a genai folder's op library relates to the installed one, judged on the file
    onnxruntime-genai will load: ``needs_library`` (its decoder uses ortsparse ops),
    ``configured`` (the config's custom_ops_library), ``loads`` (the file that name resolves to
    inside the folder, or None), ``present`` (it exists), ``current`` (it is byte-identical to the
    installed library), ``problem`` (why not, in words), ``copy_current`` (the folder's
    libortsparse_ops.so is identical to the installed library)."""
    info = read_genai_folder(folder)
    needs = uses_ortsparse(info.model_file)
    configured = info.session_options.get("custom_ops_library")
    installed = Path(get_library_path())
    loads, problem = _loaded_library(info.folder, configured)
    current = loads is not None and _same_file_content(loads, installed)
    if loads is not None and not current:
        problem = f"{loads.name} differs from the installed library"
    return {"folder": str(info.folder), "needs_library": needs, "configured": configured,
            "loads": str(loads) if loads is not None else None, "present": loads is not None, "current": current,
            "problem": problem, "copy_current": _same_file_content(info.folder / LIBRARY_FILE, installed),
            "installed": str(installed)}


def _check_refreshable(info: GenaiDecoder) -> dict | None:
    """Everything :func:`refresh_genai_library` may change, checked before it changes anything: the
    library copy's place holds no folder or special file, the record (when present) is a JSON
    object, the folder is writable. Returns the record (None when there is none)."""
    copy = info.folder / LIBRARY_FILE
    if copy.is_symlink() or (copy.exists() and not copy.is_file()):
        raise ModelFileError(f"{copy} is not a regular file (a folder, link or device); remove it, then run "
                             "genai-config again")
    if not os.access(info.folder, os.W_OK | os.X_OK):
        raise ModelFileError(f"{info.folder} is not writable")
    record_path = info.folder / RECORD_FILE
    if not record_path.exists():
        return None
    try:
        record = json.loads(record_path.read_text(encoding="utf-8"))
    except RecursionError:
        record = None
    except (OSError, ValueError):
        raise ModelFileError(f"{record_path} cannot be read as JSON; fix or remove it, then run genai-config "
                             "again") from None
    if not isinstance(record, dict):
        raise ModelFileError(f"{record_path} is not a JSON object (as ortsparse writes it); fix or remove it, "
                             "then run genai-config again")
    return record


def refresh_genai_library(folder: str | os.PathLike) -> dict:
    """Bring a genai folder's op library up to date with the installed package: copy the installed
    library in (when the decoder uses ortsparse ops) and point ``custom_ops_library`` at it, or drop
    an entry of ours that is no longer needed. The folder is edited in place (the command's
    purpose); everything is checked before anything changes (:func:`_check_refreshable`), then the
    changed files are staged and moved into place together (library first), under
    graph_rewrite/output_paths.py's rules (the installed library is an input). Returns
    :func:`library_state` after the change, with ``changed``."""
    before = library_state(folder)
    info = read_genai_folder(folder)
    record = _check_refreshable(info)
    installed = Path(get_library_path())
    changed = False
    with OutputFiles(Inputs().add_file(installed, "the installed op library")) as outputs:
        if before["needs_library"] and not before["copy_current"]:
            copy = outputs.add(info.folder / LIBRARY_FILE, "op library copy")

            def write_copy(staged: Path) -> None:
                shutil.copyfile(installed, staged)
                os.chmod(staged, 0o755)

            outputs.write(copy, write_copy)
            sha = sha256(outputs.staged(copy))
            changed = True
            if record is not None:
                record.update(library=LIBRARY_FILE, library_sha256=sha, library_from=f"ortsparse {_package_version()}")
                outputs.write_text(outputs.add(info.folder / RECORD_FILE, "record"),
                                   json.dumps(record, indent=1, ensure_ascii=False) + "\n")
        wanted = LIBRARY_FILE if before["needs_library"] else None
        if before["configured"] != wanted and (wanted or before["configured"] == LIBRARY_FILE):
            config = json.loads(info.config_path.read_text(encoding="utf-8"))
            _set_library(config, bool(wanted))
            outputs.write_text(outputs.add(info.config_path, "genai config"),
                               json.dumps(config, indent=4, ensure_ascii=False) + "\n")
            changed = True
        outputs.commit()
    after = library_state(folder)
    after["changed"] = changed
    return after
