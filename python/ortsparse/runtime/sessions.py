"""CPU sessions with the right options: :func:`open_session` registers the op library only when the
model uses the ``ai.ortsparse`` domain (dense models run without it); :func:`thread_options` is the
thread policy of every benchmark here (N intra-op threads; above one, ``session.intra_op.allow_spinning``
off so idle pool threads do not steal the other candidate's core)."""
from __future__ import annotations

from typing import Any

import onnxruntime as ort

from .._library import plain_session_options, session_source
from .._library import session_options as library_session_options
from .model_files import uses_ortsparse


def thread_options(threads: int, spinning: bool = False) -> dict[str, Any]:
    """The benchmarks' thread settings for :func:`open_session`: ``threads`` intra-op threads, and
    with more than one ``allow_spinning`` off (ORT's spinning pool threads would steal the core the
    other alternated candidate needs; with one thread there is no pool and ORT's default stays).
    ``spinning``: ORT's default pool (spinning), what an app gets when it sets nothing — measured
    with the models in turn, not alternated step by step."""
    return {"intra_op_num_threads": int(threads), "allow_spinning": False if threads > 1 and not spinning else None}


def options_for(model: Any, session_options: Any = None) -> ort.SessionOptions:
    """The ``onnxruntime.SessionOptions`` :func:`open_session` uses for ``model``."""
    if isinstance(session_options, ort.SessionOptions):
        return session_options
    keywords = dict(session_options or {})
    if uses_ortsparse(model):
        return library_session_options(**keywords)
    return plain_session_options(**keywords)


def open_session(model: Any, session_options: Any = None) -> ort.InferenceSession:
    """An onnxruntime CPU session for a path / ModelProto / bytes. ``session_options``: None, a dict
    of keywords (``intra_op_num_threads``, ``allow_spinning`` — see :func:`thread_options` — or any
    ``SessionOptions`` attribute) or a ready ``onnxruntime.SessionOptions`` (used as given). The op
    library is registered only when the model uses the ``ai.ortsparse`` domain."""
    options = options_for(model, session_options)
    return ort.InferenceSession(session_source(model), sess_options=options, providers=["CPUExecutionProvider"])
