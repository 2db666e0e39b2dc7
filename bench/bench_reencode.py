"""Re-encoding (PopcountAttention reuse_rows=1) on MiniLM: a document of N tokens re-encoded while k
tokens change per call, and a window sliding over a token stream; the same rewritten model
(``rewrite-onnx --attn=none``: every attention core -> PopcountAttention select=none) with the
mode off (a full re-run) and on, in one process, models alternating.

Reports per workload and per tolerance (reuse_tol 0 = exact; > 0 = rows within the tolerance count
as unchanged): ms per call end to end and of the attention ops alone (ORT's per-node profile), the
ratio on/off, the rows reused / corrected / recomputed (the op's metrics), and the output error
against the full re-run (last_hidden_state max relative error, cosine of the sentence embeddings).

usage: python bench/bench_reencode.py [--tokens 256] [--calls 8] [--rounds 3] [-o reports/reencode]
"""
from __future__ import annotations

import argparse
import bisect
import json
import os
import sys
import tempfile
import time

import numpy as np
import onnx

import ortsparse
from ortsparse.benchmarking import machine_info, write_report
from ortsparse.graph_rewrite import config_from_flags, rewrite_model
from ortsparse.commands.event_workloads import minilm_texts
from ortsparse.zoo.export_minilm import embed
from ortsparse.zoo.models import real_model_path

FRACTIONS = [("1 token", None), ("2%", 0.02), ("10%", 0.10), ("50%", 0.50)]
TOLERANCES = [0.0, 1e-3, 1e-2]
WINDOW_STEP = 16


def tokenizer():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(real_model_path("minilm", "tokenizer.json")))
    tok.no_padding()
    tok.no_truncation()
    return tok


def token_stream(tok) -> np.ndarray:
    """The corpus's texts, tokenized and concatenated (no [CLS]/[SEP])."""
    ids = []
    for text in minilm_texts():
        ids.extend(tok.encode(text, add_special_tokens=False).ids)
    return np.asarray(ids, dtype=np.int64)


def with_specials(body: np.ndarray, cls: int, sep: int) -> dict[str, np.ndarray]:
    ids = np.concatenate([[cls], body, [sep]]).astype(np.int64)[None, :]
    return {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}


def edit_calls(stream, tokens, changed, calls, cls, sep, seed=0):
    """The document (the stream's first tokens) and `calls` edits of `changed` tokens each."""
    rng = np.random.default_rng(seed)
    body = stream[:tokens - 2].copy()
    out = [with_specials(body, cls, sep)]
    for _ in range(calls):
        body = body.copy()
        for position in rng.choice(len(body), changed, replace=False):
            while True:  # an edit that changes the token (common tokens would often replace themselves)
                token = stream[rng.integers(len(stream))]
                if token != body[position]:
                    break
            body[position] = token
        out.append(with_specials(body, cls, sep))
    return out


def window_calls(stream, tokens, calls, cls, sep):
    return [with_specials(stream[t:t + tokens - 2], cls, sep) for t in range(0, (calls + 1) * WINDOW_STEP, WINDOW_STEP)]


def reencoding(model: onnx.ModelProto, tol: float) -> onnx.ModelProto:
    """The rewritten model with its PopcountAttention ops in re-encoding mode (the attributes the
    rewriter's --event-axis call adds, graph_rewrite/attention_event.py)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for node in out.graph.node:
        if node.op_type == "PopcountAttention":
            node.attribute.extend([onnx.helper.make_attribute("reuse_rows", 1),
                                   onnx.helper.make_attribute("reuse_tol", float(tol))])
    return out


def open_session(model: onnx.ModelProto, profile_dir: str | None = None):
    import onnxruntime as ort

    options = ortsparse.session_options(intra_op_num_threads=1)
    options.inter_op_num_threads = 1
    if profile_dir:
        options.enable_profiling = True
        options.profile_file_prefix = profile_dir
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def attention_ms_per_run(profile_path: str) -> list[float]:
    """ms spent in the PopcountAttention kernels in each run of a profiled session (ORT's node
    profile; node events bucketed by the model_run event that contains them)."""
    with open(profile_path) as f:
        events = json.load(f)
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "model_run")
    totals = [0.0] * len(runs)
    starts = [r[0] for r in runs]
    for e in events:
        if (e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time")
                and e.get("args", {}).get("op_name") == "PopcountAttention"):
            at = bisect.bisect_right(starts, e["ts"]) - 1
            if at >= 0 and e["ts"] <= runs[at][1]:
                totals[at] += e["dur"] / 1000.0
    return totals


def replay(session, calls):
    return [session.run(None, feeds)[0] for feeds in calls]


def timed_replay(session, calls) -> list[float]:
    """ms of each call after the first (the first builds the state / is the unchanged document)."""
    session.run(None, calls[0])
    times = []
    for feeds in calls[1:]:
        t0 = time.perf_counter()
        session.run(None, feeds)
        times.append((time.perf_counter() - t0) * 1000.0)
    return times


def reencode_counts() -> dict[str, float]:
    rows = {"rows_reused": 0.0, "rows_corrected": 0.0, "rows_recomputed": 0.0}
    for key, values in ortsparse.metrics().items():
        if key.startswith("PopcountAttention.reencode/"):
            for name in rows:
                rows[name] += float(values.get(name, 0.0))
    return rows


def single_op_model(reuse_rows: int):
    """One PopcountAttention node (select none) on MiniLM's attention shapes, Q/K/V free."""
    attrs = {"select": "none"}
    if reuse_rows:
        attrs.update(reuse_rows=1, reuse_tol=0.0)
    node = onnx.helper.make_node("PopcountAttention", ["Q", "K", "V"], ["Y"], domain="ai.ortsparse",
                                 name=f"attn{reuse_rows}", **attrs)
    inputs = [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in ("Q", "K", "V")]
    graph = onnx.helper.make_graph([node], "op", inputs, [onnx.helper.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, None)])
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17),
                                                        onnx.helper.make_opsetid("ai.ortsparse", 1)], ir_version=9)


def op_level(tokens: int, calls: int, rounds: int, heads: int = 12, head_dim: int = 32):
    """The op alone: Q, K, V rows of `changed` tokens replaced per call (what MiniLM's first layer
    sees when tokens are edited), on vs off alternating; ms per call, min over rounds of medians."""
    rng = np.random.default_rng(0)
    rows = []
    for label, fraction in FRACTIONS:
        changed = 1 if fraction is None else max(1, round(fraction * tokens))
        qkv = [rng.standard_normal((1, heads, tokens, head_dim)).astype(np.float32) for _ in range(3)]
        sequence = [dict(zip("QKV", qkv))]
        for _ in range(calls):
            positions = rng.choice(tokens, changed, replace=False)
            qkv = [x.copy() for x in qkv]
            for x in qkv:
                x[:, :, positions] = rng.standard_normal((1, heads, changed, head_dim)).astype(np.float32)
            sequence.append(dict(zip("QKV", qkv)))
        off, on = open_session(single_op_model(0)), open_session(single_op_model(1))
        medians = {"off": [], "on": []}
        for _ in range(rounds):
            for name, session in (("off", off), ("on", on)):
                medians[name].append(float(np.median(timed_replay(session, sequence))))
        ortsparse.reset_metrics()
        replay(on, sequence)
        counts = reencode_counts()
        total = sum(counts.values()) or 1.0
        error = max(float(np.abs(a - b).max() / np.abs(b).max())
                    for a, b in zip(replay(on, sequence), replay(off, sequence)))
        rows.append({"workload": f"{label} ({changed} tokens)", "ms_off": min(medians["off"]), "ms_on": min(medians["on"]),
                     "speedup": min(medians["off"]) / min(medians["on"]), "round_medians": medians,
                     "rows": {k: v / total for k, v in counts.items()}, "max_rel_error": error})
        print(f"op {rows[-1]['workload']}: off {rows[-1]['ms_off']:.2f} ms, on {rows[-1]['ms_on']:.2f} ms "
              f"({rows[-1]['speedup']:.2f}x), err {error:.1e}", flush=True)
    return rows


def measure(base, on_model, calls, rounds):
    """ms per call, on vs off alternating per round: the minimum over rounds of each round's median
    (end to end from unprofiled sessions; the attention ops' share from a profiled pair replayed
    the same way); outputs, errors and row counts of one replay."""
    off, on = open_session(base), open_session(on_model)
    medians = {"off": [], "on": []}
    attention = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as folder:
        profiled = {"off": open_session(base, os.path.join(folder, "off")),
                    "on": open_session(on_model, os.path.join(folder, "on"))}
        for _ in range(rounds):
            for name, session in (("off", off), ("on", on)):
                medians[name].append(float(np.median(timed_replay(session, calls))))
            for name, session in profiled.items():
                replay(session, calls)
        for name, session in profiled.items():
            per_run = attention_ms_per_run(session.end_profiling())
            per_round = [per_run[i * len(calls):(i + 1) * len(calls)][1:] for i in range(rounds)]
            attention[name] = [float(np.median(r)) for r in per_round]
    ortsparse.reset_metrics()
    want, got = replay(off, calls), replay(on, calls)
    counts = reencode_counts()
    errors, cosines = [], []
    for feeds, w, g in zip(calls[1:], want[1:], got[1:]):
        errors.append(float(np.abs(g - w).max() / np.abs(w).max()))
        e_w, e_g = embed(w, feeds["attention_mask"]), embed(g, feeds["attention_mask"])
        cosines.append(float((e_w * e_g).sum()))
    total = sum(counts.values()) or 1.0
    ms_off, ms_on = min(medians["off"]), min(medians["on"])
    att_off, att_on = min(attention["off"]), min(attention["on"])
    return {
        "ms_off": ms_off, "ms_on": ms_on, "speedup": ms_off / ms_on, "round_medians": medians,
        "attention_ms_off": att_off, "attention_ms_on": att_on, "attention_speedup": att_off / att_on,
        "attention_round_medians": attention,
        "rows": {k: v / total for k, v in counts.items()},
        "max_rel_error": max(errors), "min_embedding_cosine": min(cosines),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256, help="document / window length in tokens (<= 512)")
    parser.add_argument("--calls", type=int, default=8, help="re-encodings per replay (after the first call)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tolerances", type=float, nargs="+", default=TOLERANCES)
    parser.add_argument("-o", "--output", default="reports/reencode")
    args = parser.parse_args(argv)
    if not 8 <= args.tokens <= 512:
        print("bench_reencode: --tokens must be in [8, 512]", file=sys.stderr)
        return 2
    source = real_model_path("minilm", "torchscript.onnx")
    if not source.exists():
        print(f"bench_reencode: {source} missing; run `ortsparse models minilm`", file=sys.stderr)
        return 2
    base, report = rewrite_model(onnx.load(str(source)), config_from_flags({"attn": "none"}))
    cores = sum(1 for r in report.attention if r.rewritten)
    tok = tokenizer()
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    stream = token_stream(tok)
    workloads = []
    for label, fraction in FRACTIONS:
        changed = 1 if fraction is None else max(1, round(fraction * (args.tokens - 2)))
        workloads.append((f"edit {label} ({changed} tokens)", edit_calls(stream, args.tokens, changed, args.calls, cls, sep)))
    workloads.append((f"sliding window (step {WINDOW_STEP})", window_calls(stream, args.tokens, args.calls, cls, sep)))
    started = time.time()
    op_rows = op_level(args.tokens, 4 * args.calls, args.rounds)
    results = []
    for tol in args.tolerances:
        on_model = reencoding(base, tol)
        for name, calls in workloads:
            row = {"workload": name, "reuse_tol": tol, **measure(base, on_model, calls, args.rounds)}
            results.append(row)
            print(f"tol={tol:g} {name}: off {row['ms_off']:.1f} ms, on {row['ms_on']:.1f} ms ({row['speedup']:.2f}x); "
                  f"attention {row['attention_ms_off']:.1f} -> {row['attention_ms_on']:.1f} ms; "
                  f"rows reused/corrected/recomputed {row['rows']['rows_reused']:.2f}/{row['rows']['rows_corrected']:.2f}/"
                  f"{row['rows']['rows_recomputed']:.2f}; err {row['max_rel_error']:.1e}, cos {row['min_embedding_cosine']:.6f}",
                  flush=True)
    command = "python bench/bench_reencode.py " + " ".join(argv if argv is not None else sys.argv[1:])
    payload = {"command": command.strip(), "machine": machine_info(), "tokens": args.tokens, "calls": args.calls,
               "rounds": args.rounds, "attention_cores": cores, "seconds": time.time() - started, "op_level": op_rows, "results": results}
    lines = [
        "# Re-encoding MiniLM with PopcountAttention reuse_rows=1",
        "",
        f"Command: `{payload['command']}` ({args.tokens} tokens, {args.calls} re-encodings per replay, "
        f"{args.rounds} rounds, 1 intra-op thread). Model: the MiniLM export rewritten with `--attn=none` "
        f"({cores} attention cores -> PopcountAttention select=none); on = the same model with reuse_rows=1, "
        "reuse_tol as listed. Timings taken under load (2 shared cores, other builds running): ms per call is the "
        "minimum over rounds of the per-round median, on and off alternating per round; attention ms: the same "
        "from a profiled pair of sessions replayed alongside (ORT node profile, PopcountAttention kernels only). Error: against the "
        "full re-run (mode off) of the same inputs.",
        "",
        "## The op alone (reuse_tol 0, exact)",
        "",
        f"One PopcountAttention node [1, 12, {args.tokens}, 32] (MiniLM's attention shapes), select none; per call the "
        f"Q, K, V rows of the changed tokens replaced (what MiniLM's first layer sees), {4 * args.calls} calls per "
        "replay, mode off vs on alternating.",
        "",
        "| changed | ms/call off | ms/call on | speedup | rows reused / corrected / recomputed | max rel. error |",
        "|---|---|---|---|---|---|",
        *[f"| {r['workload']} | {r['ms_off']:.2f} | {r['ms_on']:.2f} | {r['speedup']:.2f}x | "
          f"{r['rows']['rows_reused']:.2f} / {r['rows']['rows_corrected']:.2f} / {r['rows']['rows_recomputed']:.2f} | "
          f"{r['max_rel_error']:.1e} |" for r in op_rows],
        "",
        "## MiniLM end to end",
        "",
        "| reuse_tol | workload | ms/call off | ms/call on | end-to-end | attention ms off | attention ms on | "
        "attention | rows reused / corrected / recomputed | max rel. error | min emb. cosine |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        rows = r["rows"]
        lines.append(f"| {r['reuse_tol']:g} | {r['workload']} | {r['ms_off']:.1f} | {r['ms_on']:.1f} | {r['speedup']:.2f}x | "
                     f"{r['attention_ms_off']:.1f} | {r['attention_ms_on']:.1f} | "
                     f"{r['attention_speedup']:.2f}x | {rows['rows_reused']:.2f} / {rows['rows_corrected']:.2f} / "
                     f"{rows['rows_recomputed']:.2f} | {r['max_rel_error']:.1e} | {r['min_embedding_cosine']:.6f} |")
    write_report(args.output, payload, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
