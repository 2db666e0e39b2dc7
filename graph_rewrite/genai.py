"""onnxruntime-genai model folders: rewrite the decoder of a folder into a new folder that
``onnxruntime_genai`` loads as it is (the input folder is never modified).

A genai folder holds ``genai_config.json``, the decoder (``model.decoder.filename``, e.g.
``model.onnx`` + ``model.onnx.data``), the tokenizer files and more. The rewritten folder is a copy
with the decoder replaced and, when the rewrite placed ortsparse ops, a copy of the ortsparse
op library inside the folder, named in the decoder's ``session_options.custom_ops_library``
(onnxruntime-genai loads a custom-op library only from inside the model folder).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from .config import RewriteConfig
from .errors import ModelFileError
from .files import rewrite_file
from .report import RewriteReport

CONFIG_NAME = "genai_config.json"
LIBRARY_NAME = "libortsparse_ops.so"


def is_genai_folder(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory holding a genai_config.json."""
    return (Path(path) / CONFIG_NAME).is_file()


def _decoder(config: dict, folder: Path) -> tuple[dict, str]:
    try:
        decoder = config["model"]["decoder"]
        filename = decoder["filename"]
    except (KeyError, TypeError):
        raise ModelFileError(f"{folder / CONFIG_NAME} has no model.decoder.filename") from None
    if not isinstance(filename, str) or Path(filename).name != filename:
        raise ModelFileError(f"{folder / CONFIG_NAME}: model.decoder.filename {filename!r} must be a file name "
                             "inside the folder")
    return decoder, filename


def rewrite_genai_folder(in_dir: str | os.PathLike, out_dir: str | os.PathLike, config: RewriteConfig | None = None,
                         *, progress: bool = False, check: bool = False,
                         library: str | os.PathLike | None = None) -> RewriteReport:
    """Rewrite the decoder of genai folder ``in_dir`` into the new folder ``out_dir`` (which must not
    exist or be empty) and return the report. ``library``: the op library to copy in (default:
    the one this ortsparse loads). ``check``: onnx.checker on the written decoder — off by default,
    since the model builder's decoders already fail it (SimplifiedLayerNormalization in the default
    domain is an onnxruntime-only op)."""
    in_dir, out_dir = Path(in_dir), Path(out_dir)
    if not is_genai_folder(in_dir):
        raise ModelFileError(f"{in_dir} is not an onnxruntime-genai folder (no {CONFIG_NAME})")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ModelFileError(f"output folder {out_dir} exists and is not empty")
    if out_dir.resolve() == in_dir.resolve():
        raise ModelFileError("the output folder must differ from the input folder")
    genai_config = json.loads((in_dir / CONFIG_NAME).read_text())
    decoder, filename = _decoder(genai_config, in_dir)
    decoder_files = {filename, f"{filename}.data"}
    out_dir.mkdir(parents=True, exist_ok=True)
    for entry in in_dir.iterdir():  # everything but the decoder (and its data) and the config
        if entry.name in decoder_files or entry.name == CONFIG_NAME or not entry.is_file():
            continue
        shutil.copy2(entry, out_dir / entry.name)
    report = rewrite_file(in_dir / filename, out_dir / filename, config, progress=progress, check=check)
    placed = report.rewritten or any(a.rewritten for a in report.attention)
    if placed:
        if library is None:
            from .._library import get_library_path

            library = get_library_path()
        shutil.copy2(library, out_dir / LIBRARY_NAME)
        options = decoder.setdefault("session_options", {})
        options["custom_ops_library"] = LIBRARY_NAME
    (out_dir / CONFIG_NAME).write_text(json.dumps(genai_config, indent=4) + "\n")
    return report
