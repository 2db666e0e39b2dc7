"""What an onnxruntime-genai model folder's ``genai_config.json`` says about its decoder
(:func:`genai_folder`, :func:`genai_decoder`, :func:`context_length`), checked value by value."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path


GENAI_CONFIG = "genai_config.json"


class GenaiConfigError(ValueError):
    """A folder that is not a usable onnxruntime-genai model folder (one-line reason)."""


@dataclasses.dataclass(frozen=True)
class GenaiDecoder:
    """What an onnxruntime-genai model folder's ``genai_config.json`` says about its decoder."""

    folder: Path
    config_path: Path
    config: dict
    model_file: Path
    head_size: int
    kv_heads: int
    layers: int
    context_length: int | None

    @property
    def session_options(self) -> dict:
        return self.config["model"]["decoder"].setdefault("session_options", {})


def genai_folder(path: str | os.PathLike) -> Path | None:
    """The onnxruntime-genai folder ``path`` is or belongs to: a folder holding ``genai_config.json``,
    or a file beside one (its model.onnx, the config itself); None otherwise."""
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    return folder if (folder / GENAI_CONFIG).is_file() else None


def _not_json_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _positive_int(section: dict, key: str, where: str) -> int | None:
    """``section[key]`` as a positive int (None when absent); anything else is a GenaiConfigError."""
    value = section.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise GenaiConfigError(f"{where}.{key} must be a positive integer, not {json.dumps(value)[:40]}")
    return value


def genai_decoder(path: str | os.PathLike) -> GenaiDecoder:
    """Read the genai folder ``path`` (or the folder of a file in it). Raises
    :class:`GenaiConfigError` naming the folder and the problem: a path that does not exist, no
    genai_config.json, a config that is not JSON (NaN / Infinity included) or not an object, lacks
    the decoder's filename / head_size / layers or gives them as something else than positive
    integers, session_options that is not an object, a decoder model file that is missing."""
    path = Path(path)
    if not path.exists():
        raise GenaiConfigError(f"{path} does not exist")
    folder = path if path.is_dir() else path.parent
    config_path = folder / GENAI_CONFIG
    if not config_path.is_file():
        raise GenaiConfigError(f"{folder} has no {GENAI_CONFIG}: not an onnxruntime-genai model folder")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"), parse_constant=_not_json_constant)
    except (OSError, UnicodeDecodeError) as error:
        raise GenaiConfigError(f"cannot read {config_path}: {getattr(error, 'strerror', None) or error}") from None
    except RecursionError:
        raise GenaiConfigError(f"{config_path} is nested too deeply to be a genai config") from None
    except ValueError as error:
        raise GenaiConfigError(f"{config_path} is not valid JSON ({error})") from None
    model = config.get("model") if isinstance(config, dict) else None
    decoder = model.get("decoder") if isinstance(model, dict) else None
    if not isinstance(decoder, dict):
        raise GenaiConfigError(f"{config_path} has no model.decoder section")
    filename = decoder.get("filename")
    if not isinstance(filename, str) or not filename:
        raise GenaiConfigError(f"{config_path}: model.decoder.filename is missing")
    if "\0" in filename:
        raise GenaiConfigError(f"{config_path}: decoder filename {filename!r} holds a NUL character")
    model_file = folder / filename
    if not model_file.resolve().is_relative_to(folder.resolve()):
        raise GenaiConfigError(f"{config_path}: decoder filename {filename!r} lies outside the folder")
    if not model_file.is_file():
        raise GenaiConfigError(f"{config_path} names the decoder model {filename}, which does not exist in {folder}")
    options = decoder.get("session_options", {})
    if not isinstance(options, dict):
        raise GenaiConfigError(f"{config_path}: model.decoder.session_options must be an object, not "
                               f"{type(options).__name__}")
    library = options.get("custom_ops_library")
    if library is not None and not (isinstance(library, str) and library and "\0" not in library):
        raise GenaiConfigError(f"{config_path}: session_options.custom_ops_library must be a file name, not "
                               f"{json.dumps(library)[:40]}")
    where = f"{config_path}: model.decoder"
    head_size = _positive_int(decoder, "head_size", where)
    kv_heads = _positive_int(decoder, "num_key_value_heads", where) or _positive_int(decoder, "num_attention_heads",
                                                                                      where)
    layers = _positive_int(decoder, "num_hidden_layers", where)
    for key, value in (("head_size", head_size), ("num_key_value_heads", kv_heads), ("num_hidden_layers", layers)):
        if value is None:
            raise GenaiConfigError(f"{where} lacks a usable '{key}' entry")
    context = model.get("context_length")
    return GenaiDecoder(folder, config_path, config, model_file, head_size, kv_heads, layers,
                        context if isinstance(context, int) and not isinstance(context, bool) and context > 0 else None)


def context_length(path: str | os.PathLike) -> int | None:
    """The longest sequence of the model at ``path`` (a file or folder), when its onnxruntime-genai
    config says (``context_length``); None otherwise."""
    folder = genai_folder(path)
    if folder is None:
        return None
    try:
        return genai_decoder(folder).context_length
    except GenaiConfigError:
        return None
