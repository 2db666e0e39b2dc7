"""The real decode loop every speed number comes from (docs/measure.md "Speed").

Real text, a KV cache that grows every step, every model on the same tokens:

1. the prompt is ``tokens[offset : offset + context]``, fed in chunks of ``prefill_chunk`` tokens
   (chunked prefill, the cache growing chunk by chunk);
2. then the corpus continuation is fed **teacher-forced**, one token per step: step i feeds
   ``tokens[offset + context + i]`` whatever the model predicted, so every model sees the same
   sequence and its prediction can be compared with the reference model's at every step;
3. the models are advanced **round-robin**, one chunk / one step each in turn, in one process, so
   machine noise spreads over all of them alike;
4. the first ``warmup`` decode steps are not timed; the step time is the median of the others.

A model is a :class:`Stepper`: :class:`OrtStepper` runs a KV-cache graph in an ONNX Runtime
session (our exports, ORT's MatMulNBits baselines, or an onnxruntime-genai graph run directly; the
present K/V are bound as the next step's past without copies, :class:`ortsparse.runtime.KVDecoder`),
:class:`GenaiStepper` runs an onnxruntime-genai model folder through ``onnxruntime_genai.Generator``
the way apps do (``append_tokens``; its past and present share one buffer sized for the whole
sequence). A step's time is the call that advances the model and returns the last token's logits;
the argmax is taken outside the timed region.
"""
from __future__ import annotations

import dataclasses
import gc
import json
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from .._library import metrics, reset_metrics
from ..benchmarking import SPINNING_SETTLE_S
from ..runtime import KVDecoder, genai_decoder, kv_layout, open_session, thread_options, uses_ortsparse
from ..zoo.export_corpus import fallback_corpus_text
from .corpus import load_corpus_tokens
from .text import check_vocabulary, text_tokens, tokenize_text, tokenizer_read

DEFAULT_TEXT = "Python's documentation (pydoc_data.topics)"


def loop_tokens(*, text: str | os.PathLike | None, corpus: str | os.PathLike | None, model: Any,
                tokenizer: str | os.PathLike | None, vocabulary: int | None) -> tuple[np.ndarray, str]:
    """(token ids, what they are) a decode loop reads: ``corpus`` ids (a .npy), ``text`` tokenized
    with ``model``'s tokenizer (or ``tokenizer``), or by default Python's documentation tokenized
    likewise — text every Python has, in the model's own vocabulary. Only a model without a
    tokenizer (the cache's research exports) falls back to the cache's SmolLM2 corpus. Ids past
    ``vocabulary`` are refused (one line)."""
    if corpus:
        return load_corpus_tokens(corpus, vocabulary), f"token ids {corpus}"
    if text:
        return text_tokens(text, model, tokenizer, vocabulary), f"text {text}"
    found = tokenizer_read(model, tokenizer)
    if found is None:
        return load_corpus_tokens(None, vocabulary), "the model cache's SmolLM2 corpus"
    tokens = tokenize_text(fallback_corpus_text(), found)
    check_vocabulary(tokens, vocabulary, tokenizer=found)
    return tokens, DEFAULT_TEXT


class Stepper(Protocol):
    """One model in the loop."""

    runner: str  # "ort" or "og"
    kv_bytes_per_position: int  # the K/V cache's bytes per token position (every layer's K and V)
    copies_cache: bool  # whether each step copies the past into a new present (separate buffers)

    def reset(self, capacity: int) -> None: ...  # noqa: E704 (protocol): a new sequence of <= capacity positions

    def advance(self, ids: np.ndarray) -> np.ndarray: ...  # noqa: E704 (protocol): last logits [vocab]


class OrtStepper:
    """A KV-cache decoder graph (path, ModelProto or bytes) in an ONNX Runtime session with the
    benchmark thread policy (:func:`ortsparse.runtime.thread_options`). ``layout_source``: the path
    that tells a symbolic head size (a graph inside an onnxruntime-genai folder), when ``source``
    is a proto."""

    runner = "ort"
    copies_cache = True  # the graph writes a new present (past + the new token) every step

    def __init__(self, source: Any, threads: int = 1, layout_source: Any = None, spinning: bool = False):
        self.session = open_session(source, thread_options(threads, spinning))
        layout = kv_layout(self.session, layout_source if layout_source is not None else source)
        if layout is None:
            raise ValueError("the decode loop needs a KV-cache decoder (past_key_values.* inputs); "
                             "this graph has none")
        self.layout = layout
        self.decoder = KVDecoder(self.session, layout)
        self.uses_library = uses_ortsparse(source)
        self.kv_bytes_per_position = layout.bytes_per_position()

    @property
    def max_positions(self) -> int | None:
        return self.layout.max_positions

    def reset(self, capacity: int = 0) -> None:
        self.decoder.reset()

    def advance(self, ids: np.ndarray) -> np.ndarray:
        return self.decoder.advance(ids)


def genai_session_options(threads: int, spinning: bool = False) -> dict[str, Any]:
    """The decoder session options that give an onnxruntime-genai model the benchmark thread policy:
    ``threads`` intra-op threads, and above one ``session.intra_op.allow_spinning`` 0 (genai passes
    unknown string keys on as session config entries) unless ``spinning`` (ORT's default)."""
    options: dict[str, Any] = {"intra_op_num_threads": int(threads)}
    if threads > 1 and not spinning:
        options["session.intra_op.allow_spinning"] = "0"
    return options


class GenaiStepper:
    """An onnxruntime-genai model folder run by ``onnxruntime_genai.Generator``, as an app runs it:
    the prompt and every teacher-forced token go in through ``append_tokens``, the logits come from
    ``get_logits``; the genai config's own settings (past/present share one buffer of ``max_length``
    positions) stay as they are, only the thread options are overlaid."""

    runner = "og"
    copies_cache = False  # past and present share one buffer

    def __init__(self, folder: str | os.PathLike, threads: int = 1, spinning: bool = False):
        import onnxruntime_genai as og  # optional: the models extra

        self.og = og
        self.info = genai_decoder(folder)
        config = og.Config(str(self.info.folder))
        options = genai_session_options(threads, spinning)
        config.overlay(json.dumps({"model": {"decoder": {"session_options": options}}}))
        self.model = og.Model(config)
        self.generator = None
        self.uses_library = bool(self.info.session_options.get("custom_ops_library"))
        # The CPU cache is float32 whatever the weights' precision; window-sized buffers (the
        # sliding-window layers the config lists) do not grow.
        window = self.info.config["model"]["decoder"].get("sliding_window")
        windowed = len(window.get("layers") or []) if isinstance(window, dict) else 0
        # GroupQueryAttention refuses window-sized buffers shorter than their window (Gemma-3: 512)
        self.window_size = int(window.get("window_size") or 0) if isinstance(window, dict) else 0
        self.kv_bytes_per_position = 2 * (self.info.layers - windowed) * self.info.kv_heads * self.info.head_size * 4

    @property
    def max_positions(self) -> int | None:
        return self.info.context_length

    def reset(self, capacity: int = 0) -> None:
        """A new Generator whose shared KV buffer holds ``capacity`` positions, at least the sliding
        window (default: the config's context length)."""
        self.generator = None  # release the old KV buffer before the next one is allocated
        params = self.og.GeneratorParams(self.model)
        limit = self.info.context_length
        capacity = min(capacity, limit) if capacity and limit else capacity or limit or 2048
        capacity = max(capacity, self.window_size)
        params.set_search_options(max_length=int(capacity), do_sample=False)
        self.generator = self.og.Generator(self.model, params)

    def advance(self, ids: np.ndarray) -> np.ndarray:
        self.generator.append_tokens(np.asarray(ids, dtype=np.int32).reshape(-1))
        logits = np.asarray(self.generator.get_logits())
        return logits.reshape(-1, logits.shape[-1])[-1].astype(np.float32, copy=False)


@dataclasses.dataclass
class LoopPlan:
    """Where the loop reads the corpus: the prompt ``tokens[offset : offset + prompt]``, then
    ``warmup + steps`` teacher-forced tokens."""

    offset: int
    prompt: int
    warmup: int
    steps: int

    @property
    def first_position(self) -> int:
        return self.prompt

    @property
    def last_position(self) -> int:
        return self.prompt + self.warmup + self.steps - 1

    @property
    def tokens_needed(self) -> int:
        return self.offset + self.prompt + self.warmup + self.steps + 1


def plan(context: int, steps: int, warmup: int, *, offset: int = 0, max_positions: int | None = None) -> LoopPlan:
    """The prompt fills ``context`` positions and the decode steps follow it; when that would pass
    the models' longest sequence (``max_positions``, e.g. 8192 for SmolLM2's genai models) the
    prompt is shortened so the last step lands on the last position."""
    if context < 1 or steps < 1 or warmup < 0:
        raise ValueError(f"need context >= 1, steps >= 1, warmup >= 0 (got {context}, {steps}, {warmup})")
    prompt = context
    if max_positions is not None and prompt + warmup + steps > max_positions:
        prompt = max_positions - warmup - steps
        if prompt < 1:
            raise ValueError(f"{warmup + steps} decode steps do not fit in the models' {max_positions} positions")
    return LoopPlan(offset, prompt, warmup, steps)


def decode_loop(steppers: Mapping[str, Stepper], tokens: Sequence[int] | np.ndarray, loop: LoopPlan, *,
                prefill_chunk: int = 512, reference: str | None = None,
                measure_metrics: bool = True, log: Callable[[str], None] | None = None,
                interleave: bool = True, settle_s: float = SPINNING_SETTLE_S) -> dict[str, dict]:
    """Run the loop over every stepper (reset first) and return per name: ``step_seconds`` (timed
    steps), ``median_s``, ``tokens_per_s``, ``p10_s`` / ``p90_s``, ``prefill_s`` and
    ``prefill_tokens_per_s``, ``predictions`` (argmax after each decode step, warm-up included),
    ``next_token_accuracy`` (predictions equal to the corpus's next token), ``mean_nll`` (mean
    negative log-likelihood of the corpus's next token over the decode steps) and, with a
    ``reference`` name, ``top1_agreement`` (predictions equal to the reference's) and
    ``dppl_vs_reference`` (exp of the mean NLL difference, minus 1: a perplexity change measured
    on decode steps, each seeing its own model's KV cache). Under ``_metrics``: the op library's
    counters of the decode steps (reset after the prefill); ``_prompt_metrics``: the prompt's.

    ``interleave`` (default): the models take turns chunk by chunk and step by step, so that each
    step of every model sees the same moment of the machine. Off: each model runs its whole loop in
    turn, ``settle_s`` after the previous one — for ORT's spinning pools, whose idle threads keep
    spinning on a core for milliseconds after a Run and would slow the next model's step."""
    if reference is not None and reference not in steppers:
        raise ValueError(f"reference {reference!r} is not one of the models ({', '.join(steppers)})")
    prompt, forced, following = _loop_slices(tokens, loop)
    names = list(steppers)
    prefill = {name: 0.0 for name in names}
    times, predictions, nll = ({name: [] for name in names} for _ in range(3))  # step s, argmax, next-token NLL
    say = log or (lambda text: None)
    gc_was_enabled = gc.isenabled()
    gc.disable()  # a collection in the middle of a timed step would land on one model only
    counters, prompt_counters = {}, {}  # the op counters of the decode steps, of the prompt (interleaved)

    def prefill_chunks(name, chunks):
        for begin in chunks:
            t0 = time.perf_counter()
            steppers[name].advance(prompt[begin:begin + chunk])
            prefill[name] += time.perf_counter() - t0

    def decode_step(name, step, ids):
        t0 = time.perf_counter()
        logits = steppers[name].advance(ids)
        elapsed = time.perf_counter() - t0
        if step >= loop.warmup:
            times[name].append(elapsed)
        predictions[name].append(int(np.argmax(logits)))
        nll[name].append(_next_token_nll(logits, int(following[step])))

    chunk = max(1, int(prefill_chunk))
    starts = range(0, loop.prompt, chunk)
    try:
        for name in names:
            steppers[name].reset(loop.last_position + 1)
        if interleave:
            for begin in starts:
                for name in names:
                    prefill_chunks(name, [begin])
            if measure_metrics:
                prompt_counters = metrics()
                reset_metrics()
            for step, token in enumerate(forced):
                for name in names:
                    decode_step(name, step, token.reshape(1))
            counters = metrics() if measure_metrics else {}
        else:
            for name in names:
                time.sleep(settle_s)
                prefill_chunks(name, starts)
                if measure_metrics:
                    reset_metrics()
                for step, token in enumerate(forced):
                    decode_step(name, step, token.reshape(1))
                if measure_metrics:  # this model's counters; the others' slots read 0 after the reset
                    counters.update({key: values for key, values in metrics().items()
                                     if values.get("calls") or key not in counters})
        say(f"  prefilled {loop.prompt} tokens: " + ", ".join(f"{n} {loop.prompt / prefill[n]:.0f} tok/s" for n in names))
    finally:
        if gc_was_enabled:
            gc.enable()
    result = {name: _loop_row(steppers[name].runner, times[name], prefill[name], loop.prompt, predictions[name],
                              nll[name], following, predictions.get(reference), nll.get(reference))
              for name in names}
    result["_metrics"], result["_prompt_metrics"] = counters, prompt_counters
    return result


def _loop_slices(tokens: Sequence[int] | np.ndarray, loop: LoopPlan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(prompt, teacher-forced tokens, the token after each forced one) of ``loop`` in ``tokens``."""
    tokens = np.asarray(tokens).reshape(-1)
    if tokens.size < loop.tokens_needed:
        raise ValueError(f"the loop needs {loop.tokens_needed} tokens (offset {loop.offset}, prompt {loop.prompt}, "
                         f"{loop.warmup}+{loop.steps} steps); the corpus has {tokens.size}")
    first, last = loop.offset + loop.prompt, loop.offset + loop.prompt + loop.warmup + loop.steps
    return (tokens[loop.offset:first].astype(np.int64), tokens[first:last].astype(np.int64),
            tokens[first + 1:last + 1])


def _loop_row(runner: str, steps: list[float], prefill_s: float, prompt: int, predicted: list[int], nll: list[float],
              following: np.ndarray, reference_predictions: list[int] | None,
              reference_nll: list[float] | None) -> dict[str, Any]:
    """One model's row of :func:`decode_loop`'s result from its timed steps, predictions and NLLs."""
    median = statistics.median(steps)
    predicted = np.asarray(predicted)
    row = {"runner": runner, "step_seconds": steps, "median_s": median,
           "tokens_per_s": 1.0 / median, "p10_s": float(np.percentile(steps, 10)),
           "p90_s": float(np.percentile(steps, 90)), "prefill_s": prefill_s,
           "prefill_tokens_per_s": prompt / prefill_s if prefill_s > 0 else float("nan"),
           "predictions": predicted.tolist(),
           "next_token_accuracy": float(np.mean(predicted == following)),
           "mean_nll": float(np.mean(nll))}
    if reference_predictions is not None:
        row["top1_agreement"] = float(np.mean(predicted == np.asarray(reference_predictions)))
        row["dppl_vs_reference"] = float(np.expm1(np.mean(nll) - np.mean(reference_nll)))
    return row


def _next_token_nll(logits: np.ndarray, token: int) -> float:
    """-log softmax(logits)[token], in float64."""
    x = np.asarray(logits, dtype=np.float64)
    top = x.max()
    return float(top + np.log(np.exp(x - top).sum()) - x[token])


def open_stepper(source: Any, runner: str, threads: int, *, layout_source: Any = None,
                 spinning: bool = False) -> Stepper:
    """An :class:`OrtStepper` (``runner="ort"``: a KV graph, or a genai folder's decoder graph) or
    a :class:`GenaiStepper` (``"og"``: a genai folder); ``spinning``: see :func:`thread_options`."""
    if runner == "og":
        return GenaiStepper(source, threads, spinning)
    if runner != "ort":
        raise ValueError(f"unknown runner {runner!r} (ort or og)")
    if isinstance(source, (str, os.PathLike)) and Path(source).is_dir():
        info = genai_decoder(source)
        return OrtStepper(info.model_file, threads, spinning=spinning)
    return OrtStepper(source, threads, layout_source, spinning)
