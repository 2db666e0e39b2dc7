"""The one place Python hands the native op library to ONNX Runtime."""
from __future__ import annotations

import ctypes
import json
import os
from pathlib import Path
from typing import Any

DOMAIN = "ai.ortsparse"
_LIBRARY_NAME = "libortsparse_ops.so"
_loaded: ctypes.CDLL | None = None


def get_library_path() -> str:
    """Absolute path of the custom-op library, for ``SessionOptions.register_custom_ops_library``.

    ``ORTSPARSE_LIBRARY`` overrides it (e.g. a sanitizer build).
    """
    override = os.environ.get("ORTSPARSE_LIBRARY")
    if override:
        path = Path(override)
    else:
        path = _installed_library()
    if not path.is_file():
        raise FileNotFoundError(
            f"ortsparse: native op library not found at {path}; reinstall the package "
            "(pip install .) or set ORTSPARSE_LIBRARY to a built libortsparse_ops.so"
        )
    return str(path)


def _installed_library() -> Path:
    # Next to the package, or (editable installs) next to the compiled _kernels module.
    here = Path(__file__).resolve().parent / _LIBRARY_NAME
    if here.is_file():
        return here
    import importlib.util

    spec = importlib.util.find_spec("ortsparse._kernels")
    if spec is not None and spec.origin:
        return Path(spec.origin).resolve().parent / _LIBRARY_NAME
    return here


def plain_session_options(
    *, intra_op_num_threads: int | None = None, allow_spinning: bool | None = None, **attrs: Any
):
    """:func:`session_options` without the op library (for models with no ortsparse op)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if intra_op_num_threads is not None:
        options.intra_op_num_threads = int(intra_op_num_threads)
    if allow_spinning is not None:
        options.add_session_config_entry("session.intra_op.allow_spinning", "1" if allow_spinning else "0")
    for name, value in attrs.items():
        if not hasattr(options, name):
            raise TypeError(f"onnxruntime.SessionOptions has no attribute {name!r}")
        setattr(options, name, value)
    return options


def session_options(
    *, intra_op_num_threads: int | None = None, allow_spinning: bool | None = None, **attrs: Any
):
    """An ``onnxruntime.SessionOptions`` with the ortsparse library registered.

    ``intra_op_num_threads`` and ``allow_spinning`` (``session.intra_op.allow_spinning``) are the
    two knobs benchmarks here care about; any other keyword is set as an attribute of the options
    (``graph_optimization_level=...``, ``log_severity_level=...``).
    """
    options = plain_session_options(intra_op_num_threads=intra_op_num_threads, allow_spinning=allow_spinning,
                                    **attrs)
    options.register_custom_ops_library(get_library_path())
    return options


def inference_session(model: Any, **options: Any):
    """Open a (rewritten) model as an ``onnxruntime.InferenceSession`` on the CPU with the library.

    ``model``: a path, serialized bytes or an ``onnx.ModelProto``; keywords go to :func:`session_options`.
    """
    import onnxruntime as ort

    return ort.InferenceSession(session_source(model), sess_options=session_options(**options),
                                providers=["CPUExecutionProvider"])


def session_source(model: Any) -> Any:
    """What ``onnxruntime.InferenceSession`` takes for a model given as a path (str or PathLike),
    serialized bytes (or bytearray) or an ``onnx.ModelProto``: a str path or bytes."""
    if hasattr(model, "SerializeToString"):
        return model.SerializeToString()
    if isinstance(model, os.PathLike):
        return os.fspath(model)
    if isinstance(model, bytearray):
        return bytes(model)
    return model


def _library() -> ctypes.CDLL:
    # dlopen of the same path returns the handle ORT uses, so counters are the ones the kernels bump.
    global _loaded
    if _loaded is None:
        lib = ctypes.CDLL(get_library_path())
        lib.OrtSparseMetricsJson.restype = ctypes.c_size_t
        lib.OrtSparseMetricsJson.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        lib.OrtSparseResetMetrics.restype = None
        lib.OrtSparseResetMetrics.argtypes = []
        _loaded = lib
    return _loaded


_metrics_capacity = 1 << 16  # grows to the largest snapshot seen, so later calls take one try


def metrics() -> dict[str, dict[str, Any]]:
    """One consistent snapshot of the counters of every live kernel plus a total per op type.

    Keys: ``"<op type>/<node name>"`` per node (``"KwtaBlockMatMul/ffn.up"``; the entry also holds
    ``"op"`` and ``"node"``) and ``"total/<op type>"`` (``"total/KwtaBlockMatMul"``). No op type is
    named ``total`` and none contains ``/``, so the text before the first ``/`` tells the two
    apart and no node name can collide with another entry. A node's entry goes when its last
    kernel (session) is destroyed; the total keeps its counts until :func:`reset_metrics`.
    Metric names follow the ops (``kwta.keep_ratio``...)."""
    global _metrics_capacity
    lib = _library()
    for _ in range(16):  # each retry is a new snapshot; the JSON only grows with new sessions
        buffer = ctypes.create_string_buffer(_metrics_capacity)
        length = lib.OrtSparseMetricsJson(buffer, _metrics_capacity)
        if length == ctypes.c_size_t(-1).value:
            raise MemoryError("ortsparse: the native library could not build the metrics snapshot")
        if length < _metrics_capacity:
            # Node names are bytes in the model; undecodable ones must not make metrics() fail.
            return json.loads(buffer.raw[:length].decode("utf-8", errors="replace"))
        _metrics_capacity = max(_metrics_capacity * 2, length + length // 4 + 1)
    raise RuntimeError("ortsparse: the metrics snapshot kept growing faster than it could be read")


def reset_metrics() -> None:
    """Zero every counter and the totals of destroyed kernels (live kernels stay listed)."""
    _library().OrtSparseResetMetrics()
