"""Running models in ONNX Runtime: model sources, CPU sessions with the right options, and feeds.

One module a subject (model_files > sessions > genai_config > kv_cache > feeds > capture, each
importing only the ones before it); this package re-exports their names, so ``from ortsparse.runtime import X`` reads
as before.

One place for what every measurement, benchmark and offline builder needs:

- model sources: :func:`load_proto` (a path, serialized bytes or an ``onnx.ModelProto``; external
  data read under ONNX Runtime's rule), :func:`check_model_file` (a damaged model is one line
  before any session opens it),
  :func:`opset_domains` / :func:`uses_ortsparse` (read from a file's top level only), and
  :func:`with_outputs` (a copy whose graph also outputs some inner values, e.g. a layer's X);
- sessions: :func:`open_session` registers the op library only when the model uses the
  ``ai.ortsparse`` domain (dense models run without it); :func:`thread_options` is the thread
  policy of every benchmark here (N intra-op threads; above one, ``session.intra_op.allow_spinning``
  off so idle pool threads do not steal the other candidate's core);
- feeds: :func:`lm_feeds` (one full-sequence window, or named sentence batches; a KV-cache
  decoder gets an empty past, so a decoder graph is scored on the graph that runs),
  :func:`decode_feeds` (one decoder step after a past of a given length, generated values),
  :func:`kv_step_feeds` (one real decode step: new ids, their positions and the past K/V);
- KV-cache decoders: :func:`kv_layout` (past/present names, heads, head size — a symbolic head
  size, as onnxruntime-genai's graphs declare it, is read from the folder's ``genai_config.json``
  or from the graph; window-sized buffers of sliding-window layers, GroupQueryAttention's
  ``sliding_window_cache=1``, from the graph), :func:`genai_decoder` (what a genai model folder's
  config says about its decoder), and :class:`KVDecoder`, which advances a decoder session step by step with the
  present K/V kept as ONNX Runtime values (IOBinding: the cache is never copied through numpy);
- activation capture: :func:`captured_values` (inner values over calibration batches, a decoder
  prefilling from an empty past).
"""
from __future__ import annotations

from .model_files import (ModelFileUnreadable, check_external_bytes, check_model_file, external_data_file, load_proto,
                          is_onnx_file, opset_domains, uses_ortsparse, with_outputs, with_weights)
from .sessions import thread_options, options_for, open_session
from .genai_config import GENAI_CONFIG, GenaiConfigError, GenaiDecoder, genai_folder, genai_decoder, context_length
from .kv_cache import past_inputs, KVLayout, GENAI_CPU_WINDOW_SLACK, window_capacities, kv_layout, KVDecoder
from .feeds import lm_feeds, named_feeds, decode_feeds, vocab_size, empty_past, kv_step_feeds
from .capture import captured_values

__all__ = [
    "GENAI_CONFIG", "GENAI_CPU_WINDOW_SLACK", "GenaiConfigError", "GenaiDecoder", "KVDecoder", "KVLayout",
    "ModelFileUnreadable", "captured_values", "check_external_bytes", "check_model_file", "context_length", "decode_feeds",
    "external_data_file", "empty_past", "genai_decoder", "genai_folder", "is_onnx_file",
    "kv_layout", "kv_step_feeds", "lm_feeds", "load_proto", "named_feeds", "open_session", "opset_domains",
    "options_for", "past_inputs", "thread_options", "uses_ortsparse", "vocab_size", "window_capacities",
    "with_outputs", "with_weights",
]
