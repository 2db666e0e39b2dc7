"""ortsparse: ONNX Runtime custom ops (domain ``ai.ortsparse``) that skip or approximate work in
exported transformer models on CPUs, and the rewriters that put them into a model.

Apps need three things: :func:`get_library_path` (hand it to ORT), :func:`session_options`
(an ``onnxruntime.SessionOptions`` with the library registered) and :func:`metrics`.
"""
from __future__ import annotations

import os as _os

if _os.environ.get("ORTSPARSE_KERNELS_MODULE"):
    # Test hook (scripts/sanitize.sh): the raw-kernel module from another build, e.g. with ASan.
    import importlib.util as _util
    import sys as _sys

    _spec = _util.spec_from_file_location("ortsparse._kernels", _os.environ["ORTSPARSE_KERNELS_MODULE"])
    _sys.modules["ortsparse._kernels"] = _kernels = _util.module_from_spec(_spec)
    _spec.loader.exec_module(_kernels)

from ._library import (
    DOMAIN,
    get_library_path,
    inference_session,
    metrics,
    reset_metrics,
    session_options,
)

__version__ = "0.1.0"

__all__ = [
    "DOMAIN",
    "__version__",
    "get_library_path",
    "inference_session",
    "metrics",
    "reset_metrics",
    "session_options",
]
