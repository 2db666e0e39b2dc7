"""Proc-sparse quality sweep: per fanout (and target / block / base_scale / score), SmolLM2 dppl and
top-1 agreement on the full-sequence export, MiniLM sentence-embedding cosine, memory of the
targeted layers, and optionally decode speed on the KV export. Writes JSON, markdown and a PNG
(dppl and cosine vs fanout; speedup vs dppl when --speed).

Selection variants: --scores delta (||W_b - base_b||) and wanda
(||W_b - base_b|| * E||x_b||, E over calibration windows taken *after* the evaluation windows).

usage: python bench/sweep_proc.py --targets down --fanouts 0.9 0.75 --windows 2 [--minilm] [--speed]
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from ortsparse.benchmarking import command_line, machine_info, write_report
from ortsparse.graph_rewrite import RewriteConfig, rewrite_model
from ortsparse.graph_rewrite.layers import survey
from ortsparse.graph_rewrite.targets import target_includes
from ortsparse.graph_rewrite.techniques import ProcSettings, TechniqueChoice
from ortsparse.measure.corpus import lm_windows, load_corpus_tokens
from ortsparse.measure.embeddings import compare_embeddings
from ortsparse.zoo.models import model_path
from ortsparse.measure.perplexity import perplexity
from ortsparse.measure.speed import decode_speed
from ortsparse.runtime import lm_feeds, open_session, with_outputs


def proc_config(point: dict[str, Any]):
    settings = ProcSettings(fanout_frac=point["fanout"], block=point["block"], base_scale=point["base_scale"],
                            shed_eps=point["shed_eps"], watermark=0, score=point["score"],
                            delta_dtype=point["delta_dtype"])
    return RewriteConfig(techniques={"proc": TechniqueChoice(settings, enabled=True, target=point["target"])})


def label(p: dict[str, Any]) -> str:
    extra = (f" base={p['base_scale']:g}" if p["base_scale"] else "") + (f" shed={p['shed_eps']:g}" if p["shed_eps"] else "")
    return f"{p['target']} f={p['fanout']:g} b={p['block']} {p['score']}{extra}"


def layer_inputs(model: onnx.ModelProto, target: str) -> dict[str, str]:
    """Layer (node) name -> name of its input X, for the layers `target` selects."""
    found = survey(ir.from_proto(model))
    return {layer.name: layer.operands.x.name for layer in found.layers
            if layer.rule is not None and target_includes(target, layer.layer_class, layer.role)}


def calibration_inputs(model: onnx.ModelProto, tokens: np.ndarray, names: dict[str, str], *, windows: int,
                       window_len: int, offset: int, rows: int = 256) -> dict[str, np.ndarray]:
    """X [rows, K] of each layer on calibration windows (random rows of the windows' tokens)."""
    wanted = sorted(set(names.values()))
    session = open_session(with_outputs(model, wanted), {"intra_op_num_threads": 1})
    batch = lm_windows(tokens, windows, window_len, offset)
    collected: dict[str, list[np.ndarray]] = {x: [] for x in wanted}
    for i in range(windows):
        values = session.run(wanted, lm_feeds(session.get_inputs(), batch[i]))
        for x, v in zip(wanted, values):
            collected[x].append(np.asarray(v, np.float32).reshape(-1, v.shape[-1]))
    rng = np.random.default_rng(0)
    out = {}
    for layer, x in names.items():
        allx = np.concatenate(collected[x])
        out[layer] = allx[rng.choice(len(allx), size=min(rows, len(allx)), replace=False)]
    return out


def packed_memory(model: onnx.ModelProto) -> tuple[float, int]:
    """(packed bytes / dense bytes over the ProcSparseMatMul layers, number of such layers)."""
    sizes = {t.name: (t.dims, t.data_type) for t in model.graph.initializer}
    packed = dense = 0
    count = 0
    for node in model.graph.node:
        if node.op_type != "ProcSparseMatMul":
            continue
        a = {x.name: onnx.helper.get_attribute_value(x) for x in node.attribute}
        count += 1
        dense += a["K"] * a["N"] * 4
        for name, itemsize in ((node.input[1], 2), (node.input[2], None)):
            dims, dtype = sizes[name]
            size = 2 if dtype in (onnx.TensorProto.FLOAT16, onnx.TensorProto.UINT16) else 4
            packed += int(np.prod(dims)) * size
    return (packed / dense if dense else 1.0), count


def plot(results, path, title):
    import matplotlib  # the plot extra, heavy: only when a PNG is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    has_cos = any("cosine_mean" in r for r in results)
    has_speed = any("speedup" in r for r in results)
    panels = 1 + has_cos + has_speed
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.8))
    axes = np.atleast_1d(axes)
    groups = sorted({(r["target"], r["block"], r["score"], r["base_scale"], r["shed_eps"]) for r in results})
    for g in groups:
        pts = sorted([r for r in results if (r["target"], r["block"], r["score"], r["base_scale"], r["shed_eps"]) == g],
                     key=lambda r: r["fanout"])
        name = f"{g[0]} b{g[1]} {g[2]}" + (f" base {g[3]:g}" if g[3] else "") + (f" shed {g[4]:g}" if g[4] else "")
        axes[0].plot([r["fanout"] for r in pts], [100 * r["dppl"] for r in pts], marker="o", label=name)
        if has_cos:
            cp = [r for r in pts if "cosine_mean" in r]
            axes[1].plot([r["fanout"] for r in cp], [r["cosine_mean"] for r in cp], marker="o", label=name)
        if has_speed:
            sp = [r for r in pts if "speedup" in r]
            axes[-1].plot([100 * r["dppl"] for r in sp], [r["speedup"] for r in sp], marker="o", label=name)
    axes[0].axhline(2.0, color="grey", ls="--", lw=0.8)
    axes[0].set_yscale("symlog", linthresh=1.0)
    axes[0].set_ylim(bottom=min(-0.5, 1.2 * min(100 * r["dppl"] for r in results)))
    axes[0].set_xlabel("fanout (fraction of K-blocks kept per output unit)")
    axes[0].set_ylabel("SmolLM2 dppl (%) — symlog; dashed: 2% budget")
    axes[0].invert_xaxis()
    if has_cos:
        axes[1].set_xlabel("fanout")
        axes[1].set_ylabel("MiniLM embedding cosine (mean)")
        axes[1].invert_xaxis()
    if has_speed:
        axes[-1].set_xscale("symlog", linthresh=1.0)
        axes[-1].axvline(2.0, color="grey", ls="--", lw=0.8)
        axes[-1].axhline(1.0, color="black", lw=0.6)
        axes[-1].set_xlabel("dppl (%)")
        axes[-1].set_ylabel("decode speedup vs dense ORT (KV, 1 thread)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(results, command, png):
    lines = ["# ProcSparseMatMul quality sweep", "", f"Command: `{command}`", "", f"![sweep]({Path(png).name})", "",
             "| target | fanout | block | score | base | shed | mem (targeted) | dppl | top-1 agree | MiniLM cos mean / min | speedup |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        cos = f"{r['cosine_mean']:.4f} / {r['cosine_min']:.4f}" if "cosine_mean" in r else ""
        sp = f"{r['speedup']:.2f}" if "speedup" in r else ""
        lines.append(f"| {r['target']} | {r['fanout']:g} | {r['block']} | {r['score']} | {r['base_scale']:g} | "
                     f"{r['shed_eps']:g} | {r['mem_ratio']:.3f} | {r['dppl']:+.2%} | {r['top1_agreement']:.3f} | {cos} | {sp} |")
    return "\n".join(lines) + "\n"


def merge(paths, output, command) -> int:
    results, sources = [], []
    for path in paths:
        data = json.loads(Path(path).read_text())
        sources.append(f"{path}: `{data['command']}`")
        results += data["results"]
    png = output + ".png"
    plot(results, png, "ProcSparseMatMul on SmolLM2 / MiniLM (merged sweeps)")
    text = markdown(results, command, png) + "\nSources:\n\n" + "\n".join(f"- {s}" for s in sources) + "\n"
    paths_out = write_report(output, dict(command=command, sources=sources, results=results), text)
    print("wrote", *paths_out, png)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", nargs="+", default=["down", "mlp"])
    parser.add_argument("--fanouts", type=float, nargs="+", default=[1.0, 0.95, 0.9, 0.75, 0.5])
    parser.add_argument("--blocks", type=int, nargs="+", default=[32])
    parser.add_argument("--base-scales", type=float, nargs="+", default=[0.0])
    parser.add_argument("--shed-eps", type=float, nargs="+", default=[0.0])
    parser.add_argument("--scores", nargs="+", default=["delta"], choices=["delta", "wanda"])
    parser.add_argument("--delta-dtype", default="float16", choices=["float16", "float32"])
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--window-len", type=int, default=512)
    parser.add_argument("--calib-windows", type=int, default=2, help="windows for the wanda score (after the eval ones)")
    parser.add_argument("--minilm", action="store_true", help="also MiniLM embedding cosine per point")
    parser.add_argument("--speed", action="store_true", help="also decode speed on the KV export (lead's runs)")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32, help="timed steps of the real decode loop (--speed)")
    parser.add_argument("-o", "--output", default="reports/sweep_proc")
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="only combine earlier sweep reports (their JSON) into one table and PNG")
    args = parser.parse_args(argv)
    command = command_line("python bench/sweep_proc.py", argv)
    if args.merge:
        return merge(args.merge, args.output, command)

    opts = {"intra_op_num_threads": 1}
    full = onnx.load(str(model_path("smollm2", "full.torchscript")))
    tokens = load_corpus_tokens(None)
    t0 = time.time()
    dense = perplexity(full, tokens, args.windows, args.window_len, opts)
    print(f"dense ppl {dense['ppl']:.3f} ({args.windows}x{args.window_len}, {time.time() - t0:.0f}s)", flush=True)
    minilm = onnx.load(str(model_path("minilm", "torchscript"))) if args.minilm else None
    kv = onnx.load(str(model_path("smollm2", "kv.torchscript"))) if args.speed else None
    calib: dict[str, dict[str, np.ndarray]] = {}
    points = [dict(target=t, fanout=f, block=b, base_scale=s, shed_eps=e, score=c, delta_dtype=args.delta_dtype)
              for t, b, c, s, e, f in itertools.product(args.targets, args.blocks, args.scores, args.base_scales,
                                                        args.shed_eps, args.fanouts)]
    results = []
    for i, point in enumerate(points):
        t0 = time.time()
        config = proc_config(point)
        calibration = None
        if point["score"] == "wanda":
            if point["target"] not in calib:
                calib[point["target"]] = calibration_inputs(
                    full, tokens, layer_inputs(full, point["target"]), windows=args.calib_windows,
                    window_len=args.window_len, offset=args.windows * args.window_len)
            calibration = calib[point["target"]]
        rewritten, _ = rewrite_model(full, config, calibration=calibration)
        mem, layers = packed_memory(rewritten)
        got = perplexity(rewritten, tokens, args.windows, args.window_len, opts)
        row = dict(point, label=label(point), layers=layers, mem_ratio=mem, ppl=got["ppl"], ppl_dense=dense["ppl"],
                   dppl=got["ppl"] / dense["ppl"] - 1.0,
                   top1_agreement=float(np.mean(got["predictions"] == dense["predictions"])))
        del rewritten
        if minilm is not None and point["score"] == "delta":  # no MiniLM calibration: wanda would be delta
            rw, _ = rewrite_model(minilm, config)
            emb = compare_embeddings(minilm, rw, session_options=opts)
            row.update(cosine_mean=emb["cosine_mean"], cosine_min=emb["cosine_min"])
        if kv is not None:
            kv_rw, _ = rewrite_model(kv, config)
            speed = decode_speed({"dense": kv, "rewritten": kv_rw}, tokens, context=args.context, steps=args.steps)
            row.update(speedup=speed["rewritten"]["tokens_per_s"] / speed["dense"]["tokens_per_s"],
                       decode_tokens_per_s=speed["rewritten"]["tokens_per_s"],
                       dense_tokens_per_s=speed["dense"]["tokens_per_s"])
        results.append(row)
        cos = f" cos {row['cosine_mean']:.4f}/{row['cosine_min']:.4f}" if "cosine_mean" in row else ""
        sp = f" speedup x{row['speedup']:.2f}" if "speedup" in row else ""
        print(f"{i + 1}/{len(points)} {row['label']}: mem {mem:.3f} ({layers} layers) dppl {row['dppl']:+.2%} "
              f"agree {row['top1_agreement']:.3f}{cos}{sp} ({time.time() - t0:.0f}s)", flush=True)
    png = args.output + ".png"
    plot(results, png, f"ProcSparseMatMul on SmolLM2 ({args.windows}x{args.window_len} tokens) / MiniLM")
    payload = dict(machine=machine_info(), command=command, windows=args.windows,
                   window_len=args.window_len, results=results)
    paths = write_report(args.output, payload, markdown(results, command, png))
    print("wrote", *paths, png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
