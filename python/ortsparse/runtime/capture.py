"""Activation capture: a model's inner values (a linear layer's input X) over calibration batches,
one dense pass per batch. The one capture loop of the package: the TT builder's calibration rows
(:func:`ortsparse.tt.collect_matmul_inputs`) and calibrate's quantiles read it; each caller samples
what it keeps from the values itself.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from .feeds import lm_feeds
from .kv_cache import kv_layout
from .model_files import with_outputs
from .sessions import open_session

Feeds = Callable[[Any, Any], Mapping[str, np.ndarray]]


def captured_values(model: Any, names: Sequence[str], batches: Iterable[Any], *, feeds: Feeds = lm_feeds,
                    session_options: Any = None) -> Iterator[tuple[Any, list[np.ndarray]]]:
    """``(batch, [value of each of names])`` for each batch: ``model`` (a proto) run in ONNX Runtime
    with ``names`` (duplicates dropped, order kept) added as graph outputs. ``feeds(session, batch)``
    makes a batch's inputs; with :func:`lm_feeds` (token windows or named sentence batches) a KV-cache
    decoder (an onnxruntime-genai graph) gets an empty past, so each window is one prefill of the
    graph that decodes, and the values are the ones that graph computes."""
    wanted = list(dict.fromkeys(names))
    session = open_session(with_outputs(model, wanted), session_options)
    if feeds is lm_feeds:
        kv = kv_layout(session, model)
        if kv is not None:
            feeds = lambda inputs, batch: lm_feeds(inputs, batch, kv)  # noqa: E731 - one binding
    for batch in batches:
        yield batch, session.run(wanted, feeds(session, batch))
