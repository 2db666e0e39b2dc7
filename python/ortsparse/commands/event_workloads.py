"""Workloads for EventDrivenMatMul with ``axis = call``: a model re-run on a slowly changing input,
where row t of a call is compared with row t of the previous call.

- ``search``: MiniLM re-encodes a query growing by one word per call (search-as-you-type), from the
  cache's MiniLM sentence set;
- ``edits``: MiniLM re-encodes a sentence under small edits (one word replaced, inserted or deleted
  per call);
- ``mlp``: a generated residual MLP fed a smooth synthetic stream (``[rows, d]`` per call).

Each stream starts from a reset (the harness adds a bool ``event_reset`` graph input wired to every
EventDrivenMatMul and feeds True on a stream's first call), so streams do not leak into each other
and an auto-disabled op re-arms. Quality is measured per call against the dense model on the same
input: MiniLM embedding cosine (mean-pooled last hidden state, as measure.embeddings) and the relative L2
gap of the model output. ``python -m ortsparse.commands.event_workloads --help`` runs the quality
part; bench/bench_event.py times the same streams against the dense model.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .. import flag_types
from .._library import DOMAIN, metrics, reset_metrics
from ..graph_rewrite import RewriteConfig
from ..graph_rewrite.techniques import EventSettings, KwtaSettings, TechniqueChoice
from ..measure.corpus import default_corpus, default_sentences, load_corpus_tokens
from ..measure.embeddings import mean_pool
from ..measure.perplexity import compare_lm
from ..runtime import open_session
from ..zoo.models import real_model_path
from .quality import rewrite_in_memory

RESET_INPUT = "event_reset"
WORKLOADS = ("search", "edits", "mlp")


# --------------------------------------------------------------------------- models

def add_reset_input(model: Any, name: str = RESET_INPUT):
    """A copy of ``model`` (ModelProto) with a bool scalar graph input ``name`` as the ``reset``
    input of every EventDrivenMatMul."""

    out = onnx.ModelProto()
    out.CopyFrom(model)
    nodes = [n for n in out.graph.node if n.op_type == "EventDrivenMatMul" and n.domain == DOMAIN]
    if not nodes:
        raise ValueError("the model has no EventDrivenMatMul node")
    for node in nodes:
        while len(node.input) < 3:
            node.input.append("")
        del node.input[3:]
        node.input.append(name)
    out.graph.input.append(helper.make_tensor_value_info(name, TensorProto.BOOL, []))
    return out


def event_config(target: str = "all", **settings):
    """A RewriteConfig with only the event technique on (axis call unless given)."""

    settings.setdefault("axis", "call")
    choice = TechniqueChoice(EventSettings(**settings), enabled=True, target=target)
    return RewriteConfig(techniques={"kwta": TechniqueChoice(KwtaSettings(), enabled=False), "event": choice})


def event_model(dense_model: Any, target: str = "all", **settings):
    """(rewritten ModelProto with the reset input, RewriteReport)."""

    rewritten, report = rewrite_in_memory(dense_model, event_config(target, **settings))
    return add_reset_input(rewritten), report


def mlp_model(d: int = 384, hidden: int = 1536, layers: int = 2, seed: int = 0):
    """A residual MLP ``y = x + sum_l relu(h_l W1 + b1) W2 + b2`` with X ``[rows, d]`` (He-scaled
    random weights): the generated model of the ``mlp`` workload."""

    rng = np.random.default_rng(seed)
    inits, nodes, h = [], [], "X"
    for layer in range(layers):
        w1 = (rng.standard_normal((d, hidden)) * np.sqrt(2.0 / d)).astype(np.float32)
        w2 = (rng.standard_normal((hidden, d)) * np.sqrt(1.0 / hidden)).astype(np.float32)
        b1 = (0.1 * rng.standard_normal(hidden)).astype(np.float32)
        b2 = (0.1 * rng.standard_normal(d)).astype(np.float32)
        p = f"mlp.{layer}"
        inits += [numpy_helper.from_array(a, f"{p}.{n}") for a, n in ((w1, "up.w"), (b1, "up.b"), (w2, "down.w"),
                                                                     (b2, "down.b"))]
        nodes += [
            helper.make_node("MatMul", [h, f"{p}.up.w"], [f"{p}.u"], name=f"{p}.up"),
            helper.make_node("Add", [f"{p}.u", f"{p}.up.b"], [f"{p}.ub"]),
            helper.make_node("Relu", [f"{p}.ub"], [f"{p}.a"]),
            helper.make_node("MatMul", [f"{p}.a", f"{p}.down.w"], [f"{p}.dn"], name=f"{p}.down"),
            helper.make_node("Add", [f"{p}.dn", f"{p}.down.b"], [f"{p}.db"]),
            helper.make_node("Add", [h, f"{p}.db"], [f"{p}.out"]),
        ]
        h = f"{p}.out"
    nodes.append(helper.make_node("Identity", [h], ["Y"]))
    graph = helper.make_graph(nodes, "smooth_mlp", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["rows", d])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["rows", d])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


# --------------------------------------------------------------------------- streams

def smooth_stream(d: int = 384, rows: int = 8, calls: int = 32, seed: int = 0, drift: float = 0.002,
                  jump_frac: float = 0.05, jump: float = 0.5) -> list[dict[str, np.ndarray]]:
    """A sensor-like stream: every feature drifts slowly (``drift`` · N(0, 1) per call) and a few
    (``jump_frac`` of them, different each call) move by ``jump`` · N(0, 1). Feeds ``{"X": [rows, d]}``."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, d)).astype(np.float32)
    feeds = []
    for _ in range(calls):
        feeds.append({"X": x.copy()})
        x = x + drift * rng.standard_normal(x.shape).astype(np.float32)
        mask = rng.random(x.shape) < jump_frac
        x[mask] += jump * rng.standard_normal(int(mask.sum())).astype(np.float32)
    return feeds


def minilm_texts(count: int | None = None) -> list[str]:
    with np.load(default_sentences()) as data:
        texts = [str(t) for t in data["text"]]
    return texts[:count] if count else texts


def search_as_you_type(texts: Iterable[str], min_words: int = 2, max_calls: int = 24) -> list[list[str]]:
    """Per text, its word prefixes of min_words.. words (one more word per call)."""
    streams = []
    for text in texts:
        words = text.split()
        prefixes = [" ".join(words[:i]) for i in range(min(min_words, len(words)), len(words) + 1)]
        if len(prefixes) > 1:
            streams.append(prefixes[:max_calls])
    return streams


def sentence_edits(texts: Iterable[str], edits: int = 12, seed: int = 0) -> list[list[str]]:
    """Per text, the text and ``edits`` successive small edits: one word replaced by a word of the
    vocabulary of all texts (60%), a word inserted (20%) or deleted (20%)."""
    rng = np.random.default_rng(seed)
    texts = list(texts)
    vocabulary = sorted({w for t in texts for w in t.split()})
    streams = []
    for text in texts:
        words = text.split()
        versions = [" ".join(words)]
        for _ in range(edits):
            roll = rng.random()
            pos = int(rng.integers(len(words)))
            if roll < 0.6 or len(words) < 4:
                words[pos] = vocabulary[int(rng.integers(len(vocabulary)))]
            elif roll < 0.8:
                words.insert(pos, vocabulary[int(rng.integers(len(vocabulary)))])
            else:
                del words[pos]
            versions.append(" ".join(words))
        streams.append(versions)
    return streams


class MiniLMEncoder:
    """Tokenizes texts into MiniLM feeds ``[1, S]`` (the cache's tokenizer.json)."""

    def __init__(self, max_length: int = 128) -> None:
        from tokenizers import Tokenizer  # the models extra (with transformers): only the MiniLM workloads

        self.tokenizer = Tokenizer.from_file(str(real_model_path("minilm", "tokenizer.json")))
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(max_length)

    def __call__(self, text: str) -> dict[str, np.ndarray]:
        enc = self.tokenizer.encode(text)
        ids = np.asarray([enc.ids], dtype=np.int64)
        return {"input_ids": ids, "attention_mask": np.ones_like(ids),
                "token_type_ids": np.zeros_like(ids)}


def text_streams(workload: str, count: int, encoder: MiniLMEncoder, seed: int = 0) -> list[list[dict]]:
    texts = minilm_texts(count)
    streams = search_as_you_type(texts) if workload == "search" else sentence_edits(texts, seed=seed)
    return [[encoder(t) for t in stream] for stream in streams]


def workload_streams(workload: str, count: int, seed: int = 0, mlp_d: int = 384, mlp_rows: int = 1,
                     calls: int = 32) -> list[list[dict]]:
    if workload == "mlp":
        return [smooth_stream(mlp_d, mlp_rows, calls, seed=seed + i) for i in range(count)]
    return text_streams(workload, count, MiniLMEncoder(), seed)


def dense_model_for(workload: str, mlp_d: int = 384, mlp_hidden: int = 1536, mlp_layers: int = 2):
    """The dense ModelProto / path a workload runs."""
    if workload == "mlp":
        return mlp_model(mlp_d, mlp_hidden, mlp_layers)

    return real_model_path("minilm", "torchscript.onnx")


# --------------------------------------------------------------------------- running

def _feeds(session: Any, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    names = {i.name for i in session.get_inputs()}
    return {k: v for k, v in feeds.items() if k in names}


def replay(session: Any, stream: Sequence[dict], reset: bool) -> list[np.ndarray]:
    """Runs one stream through a session; the first output of every call. ``reset``: the session
    has the event_reset input (True on the first call)."""
    outputs = []
    for i, feeds in enumerate(stream):
        f = _feeds(session, feeds)
        if reset:
            f[RESET_INPUT] = np.array(i == 0)
        outputs.append(session.run(None, f)[0])
    return outputs


def compare_streams(dense_session: Any, event_session: Any, streams: Sequence[Sequence[dict]],
                    embedding: bool) -> dict[str, Any]:
    """Per call: relative L2 gap of the output, and for embeddings the pooled cosine. The first
    call of each stream is a dense refresh (fresh rows); ``*_after_first`` excludes it."""
    gaps, cosines, first = [], [], []
    for stream in streams:
        dense = replay(dense_session, stream, reset=False)
        event = replay(event_session, stream, reset=True)
        for i, (feeds, d, e) in enumerate(zip(stream, dense, event)):
            gaps.append(float(np.linalg.norm(e.astype(np.float64) - d) / max(np.linalg.norm(d), 1e-30)))
            first.append(i == 0)
            if embedding:
                mask = feeds["attention_mask"]
                cosines.append(float(np.sum(mean_pool(d, mask) * mean_pool(e, mask))))
    gaps_a, first_a = np.array(gaps), np.array(first)
    out: dict[str, Any] = {
        "streams": len(streams), "calls": len(gaps),
        "gap_mean": float(gaps_a.mean()), "gap_max": float(gaps_a.max()),
        "gap_mean_after_first": float(gaps_a[~first_a].mean()) if (~first_a).any() else 0.0,
        "gap_p95": float(np.percentile(gaps_a, 95)),
    }
    if embedding:
        cos = np.array(cosines)
        out.update(cosine_mean=float(cos.mean()), cosine_min=float(cos.min()),
                   cosine_mean_after_first=float(cos[~first_a].mean()) if (~first_a).any() else 1.0)
    return out


def event_metrics_summary() -> dict[str, float]:
    """The total/EventDrivenMatMul metrics (refresh rate, stale %, gap checks, disables)."""

    total = metrics().get("total/EventDrivenMatMul", {})
    keys = ("event.topk_kept", "event.stale_pct", "event.quorum_hits", "event.budget_ms_used", "rows", "event_rows",
            "blocks_total", "blocks_refreshed", "gap_checks", "disables", "calls")
    return {k: total[k] for k in keys if k in total}


def evaluate(workload: str, count: int = 16, threads: int = 1, target: str = "all", seed: int = 0,
             mlp_rows: int = 1, **settings) -> dict[str, Any]:
    """Quality of one workload at one event setting (also rows refreshed, from the op metrics)."""

    dense_model = dense_model_for(workload)
    model, report = event_model(dense_model, target=target, **settings)
    streams = workload_streams(workload, count, seed, mlp_rows=mlp_rows)
    options = {"intra_op_num_threads": threads}
    dense_session = open_session(dense_model, options)
    event_session = open_session(model, options)
    reset_metrics()
    result = compare_streams(dense_session, event_session, streams, embedding=workload != "mlp")
    result.update(workload=workload, settings=dict(settings, target=target, mlp_rows=mlp_rows), rewritten_layers=len(report.rewritten),
                  metrics=event_metrics_summary())
    return result


def smollm2_sequence(windows: int = 2, window_len: int = 256, threads: int = 1, target: str = "both",
                     **settings) -> dict[str, Any]:
    """SmolLM2 (full-sequence export) with axis sequence: each window's tokens run as one stream, so
    every row after the first is gated against the previous token (decode order). Returns
    compare_lm's dppl / agreement and the refresh rate. Text changes ~110% per block between
    tokens (README, EventDrivenMatMul): expect a refresh rate near 1 at useful quality."""

    settings.setdefault("axis", "sequence")
    dense = real_model_path("smollm2", "full.torchscript.onnx")

    config = RewriteConfig(techniques={"event": TechniqueChoice(EventSettings(**settings), enabled=True, target=target)})
    rewritten, report = rewrite_in_memory(dense, config)
    reset_metrics()
    result = compare_lm(dense, rewritten, load_corpus_tokens(default_corpus()), windows, window_len,
                        session_options={"intra_op_num_threads": threads})
    return {"workload": "smollm2", "settings": dict(settings, target=target), "rewritten_layers": len(report.rewritten),
            "ppl_dense": result["ppl_dense"], "ppl_rewritten": result["ppl_rewritten"], "dppl": result["dppl"],
            "top1_agreement": result["top1_agreement"], "metrics": event_metrics_summary(),
            "windows": windows, "window_len": window_len}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=WORKLOADS + ("smollm2",), action="append",
                        help="(repeatable; default search, edits, mlp; smollm2 = axis sequence on text)")
    parser.add_argument("--windows", type=flag_types.positive_int, default=2, help="smollm2: windows (default 2)")
    parser.add_argument("--window-len", type=flag_types.window_len, default=256,
                        help="smollm2: tokens per window (default 256)")
    parser.add_argument("--count", type=flag_types.positive_int, default=16, help="streams per workload (default 16)")
    parser.add_argument("--topk", type=flag_types.fraction, nargs="+", default=[0.25],
                        help="event topk values to sweep")
    parser.add_argument("--delta-theta", type=flag_types.non_negative_float, nargs="+", default=[0.02])
    parser.add_argument("--gap-tol", type=flag_types.non_negative_float, default=0.03)
    parser.add_argument("--gap-every", type=flag_types.non_negative_int, default=0)
    parser.add_argument("--age-max", type=flag_types.non_negative_int, default=0)
    parser.add_argument("--block", type=flag_types.positive_int, default=1)
    parser.add_argument("--target", default="all")
    parser.add_argument("--mlp-rows", type=flag_types.positive_int, default=1,
                        help="mlp: rows of X per call (default 1)")
    parser.add_argument("--threads", type=flag_types.threads, default=1)
    parser.add_argument("-o", "--output", help="write the results as JSON")
    args = parser.parse_args(argv)
    results = []
    for workload in args.workload or WORKLOADS:  # noqa: PLR1702
        for topk in args.topk:
            for theta in args.delta_theta:
                if workload == "smollm2":
                    r = smollm2_sequence(args.windows, args.window_len, args.threads,
                                         "both" if args.target == "all" else args.target, topk=topk,
                                         delta_theta=theta, gap_tol=args.gap_tol, gap_every=args.gap_every,
                                         age_max=args.age_max, block=args.block)
                    results.append(r)
                    m = r["metrics"]
                    print(f"smollm2 topk {topk:<5g} theta {theta:<6g} refreshed {m.get('event.topk_kept', 1):.3f} "
                          f"ppl {r['ppl_dense']:.3f} -> {r['ppl_rewritten']:.3f} dppl {100 * r['dppl']:+.2f}% "
                          f"top1 {r['top1_agreement']:.3f} disables {m.get('disables', 0):g}", flush=True)
                    continue
                r = evaluate(workload, args.count, args.threads, args.target, mlp_rows=args.mlp_rows, topk=topk, delta_theta=theta,
                             gap_tol=args.gap_tol, gap_every=args.gap_every, age_max=args.age_max, block=args.block)
                results.append(r)
                m = r["metrics"]
                cos = f" cos mean {r['cosine_mean']:.5f} min {r['cosine_min']:.5f}" if "cosine_mean" in r else ""
                print(f"{workload:7s} topk {topk:<5g} theta {theta:<6g} refreshed {m.get('event.topk_kept', 1):.3f} "
                      f"gap mean {r['gap_mean']:.4f} p95 {r['gap_p95']:.4f} max {r['gap_max']:.4f}{cos} "
                      f"disables {m.get('disables', 0):g}", flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
