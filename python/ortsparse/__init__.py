"""ortsparse: ONNX Runtime custom ops (domain ``ai.ortsparse``) that skip or approximate work in
exported transformer models on CPUs, and the rewriters that put them into a model.

Apps need three things: :func:`get_library_path` (hand it to ORT), :func:`session_options`
(an ``onnxruntime.SessionOptions`` with the library registered) and :func:`metrics`.
"""
from __future__ import annotations

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
