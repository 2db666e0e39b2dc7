"""TTMatMul quality sweep on the real models: SmolLM2 dppl / top-1 agreement and MiniLM embedding
cosine per fixed rank and per autotune gap tolerance, plus a per-layer study (output gap vs rank of
plain SVD, activation-whitened SVD and a balanced d=3 TT-SVD at matched multiply-adds).

Calibration inputs come from windows taken from the END of the corpus (evaluation windows from the
start: no overlap), collected by running the dense model in ORT with the layers' X as extra outputs.

  python bench/sweep_tt.py --quick                       # smoke: layer 0's MLP, 1 rank, 1 gap, tiny windows (~4 min)
  python bench/sweep_tt.py                               # full: see --help (~25-40 min at 1 thread)
  python bench/sweep_tt.py --study-only --layers 0 14 29 # per-layer gap vs rank only (~3 min)

Writes <output>.json, .md and .png (dppl / 1-cosine vs rank; layers kept by the autotuner per gap).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

# One BLAS thread: on a shared 2-core machine OpenBLAS's second thread makes each SVD ~5x slower
# (measured: a 576 x 1536 whitened SVD 2.8 s at 1 thread, 13 s at 2 under load).
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402  (after the BLAS thread setting)
import onnx  # noqa: E402
import onnx_ir as ir  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))  # run from a checkout too

from ortsparse import tt  # noqa: E402
from ortsparse.benchmarking import command_line, machine_info, write_report  # noqa: E402
from ortsparse.graph_rewrite import RewriteConfig, rewrite_model  # noqa: E402
from ortsparse.graph_rewrite.config import parse_overrides  # noqa: E402
from ortsparse.graph_rewrite.layers import survey  # noqa: E402
from ortsparse.graph_rewrite.techniques import TechniqueChoice, TTSettings  # noqa: E402
from ortsparse.graph_rewrite.layer_settings import override_entries  # noqa: E402
from ortsparse.commands.calibrate import target_layers  # noqa: E402
from ortsparse.measure.corpus import encoder_batches, lm_windows, load_corpus_tokens  # noqa: E402
from ortsparse.measure.embeddings import compare_embeddings  # noqa: E402
from ortsparse.zoo.models import model_path  # noqa: E402
from ortsparse.measure.perplexity import perplexity  # noqa: E402
from ortsparse.measure.speed import decode_speed  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ONE_THREAD = {"intra_op_num_threads": 1}  # quality runs share the machine


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def calibration(model, layers, batches, max_rows: int) -> dict[str, np.ndarray]:
    """Node name -> X [rows, K] for the given layers (commands.calibrate.layer_calibration does this for
    a whole target)."""
    by_input = tt.collect_matmul_inputs(model, [layer.input_name for layer in layers], batches, max_rows=max_rows)
    return {layer.name: by_input[layer.input_name] for layer in layers}


def layer_weight(model, layer_name: str) -> tuple[np.ndarray, np.ndarray | None]:
    """W [K, N] (and bias) of a layer, as the rewriter sees it."""
    found = survey(ir.from_proto(model))
    for layer in found.layers:
        if layer.name == layer_name:
            return layer.operands.weight.matrix(), layer.operands.bias_vector()
    raise KeyError(layer_name)


def layer_study(model, layers, calib: dict[str, np.ndarray], ranks: list[int]) -> list[dict[str, Any]]:
    """Per layer and rank: gap (on held-out half of the calibration rows) of plain SVD, whitened SVD,
    and a d=3 balanced TT-SVD whose rank is chosen to use about the same multiply-adds."""
    rows = []
    for layer in layers:
        w, b = layer_weight(model, layer.name)
        x = calib[layer.name]
        fit, held = x[0::2], x[1::2]  # whitening fitted on half, gaps measured on the other half
        k, n = w.shape
        white = tt.WhitenedSVD(w, fit)
        u, s, vt = np.linalg.svd(w.astype(np.float64), full_matrices=False)
        in3, out3 = tt.choose_modes(k, n, 3, "balanced")
        for r in ranks:
            if r > min(k, n):
                continue
            lr_macs = r * (k + n)
            plain = [(u[:, :r] * s[:r]).reshape(1, k, 1, r), vt[:r].reshape(r, 1, n, 1)]
            # balanced TT rank with <= the low-rank layout's multiply-adds
            r3 = 1
            while tt.tt_macs(in3, out3, tt.uniform_ranks(3, r3 + 1, in3, out3)) <= lr_macs and r3 < 4096:
                r3 += 1
            cores3 = tt.tt_svd(w, in3, out3, max_rank=r3)
            row = dict(layer=layer.name, role=layer.role, k=k, n=n, rank=r, flop_ratio=k * n / lr_macs,
                       gap_svd=tt.gap(w, plain, held, b), gap_whitened=tt.gap(w, white.cores(r), held, b),
                       weight_err_svd=tt.weight_error(w, plain), weight_err_whitened=tt.weight_error(w, white.cores(r)),
                       tt3_modes=[in3, out3], tt3_rank=r3, tt3_flop_ratio=k * n / tt.tt_macs(in3, out3, tt.tt_ranks(cores3)),
                       gap_tt3=tt.gap(w, cores3, held, b))
            rows.append(row)
            log(f"study {layer.name} r={r}: gap svd {row['gap_svd']:.3f} whitened {row['gap_whitened']:.3f} "
                f"tt3(r={r3}) {row['gap_tt3']:.3f} (FLOP ratio {row['flop_ratio']:.2f})")
    return rows


def tt_config(target: str, **settings):
    return RewriteConfig(techniques={"tt": TechniqueChoice(TTSettings(**settings), enabled=True, target=target)})


def kept_layers(report) -> tuple[int, int, list[dict[str, Any]]]:
    candidates = [r for r in report.layers if r.rewritten or r.reason.startswith("tt:")]
    details = [{"layer": r.name, "tt": r.rewritten, "ranks": (r.attributes or {}).get("ranks"),
                "gap": (r.attributes or {}).get("gap"), "reason": r.reason if not r.rewritten else r.notes[0]}
               for r in candidates]
    return len(report.rewritten), len(candidates), details


def sweep_lm(args) -> dict[str, Any]:
    full_path = Path(args.full) if args.full else model_path("smollm2", "full.torchscript")
    log(f"LM: loading {full_path}")
    model = onnx.load(str(full_path))
    tokens = load_corpus_tokens(args.tokens)
    eval_tokens, calib_tokens = np.split(tokens, [len(tokens) // 2])
    layers = target_layers(model, args.target)
    if args.layers:
        wanted = set(args.layers)
        layers = [layer for layer in layers if _layer_index(layer.name) in wanted]
    log(f"LM: {len(layers)} {args.target} layers; calibration {args.calib_windows}x{args.window_len} tokens")
    calib = calibration(model, layers, lm_windows(calib_tokens, args.calib_windows, args.window_len, 0), args.max_rows)
    out: dict[str, Any] = {"model": str(full_path), "layers": len(layers)}
    if args.study:
        study_layers = layers if args.layers else [layers[i] for i in sorted({0, len(layers) // 2, len(layers) - 1})]
        out["study"] = layer_study(model, study_layers, calib, args.study_ranks)
    if args.study_only:
        return out
    dense = perplexity(model, eval_tokens, args.windows, args.window_len, ONE_THREAD)
    log(f"LM: dense ppl {dense['ppl']:.3f} on {args.windows}x{args.window_len}")
    points = []
    restrict = {layer.name for layer in layers}
    for kind, value in [("rank", r) for r in args.ranks] + [("gap", g) for g in args.gaps]:
        settings = dict(rank=int(value), gap=0.0, min_flop_ratio=0.0) if kind == "rank" else dict(rank=0, gap=float(value))
        config = tt_config(args.target, **settings)
        config = _restrict(config, restrict, model, args)
        started = time.time()
        rewritten, report = rewrite_model(model, config, calibration=calib)
        build_s = time.time() - started
        n_tt, n_cand, details = kept_layers(report)
        if n_tt:
            result = perplexity(rewritten, eval_tokens, args.windows, args.window_len, ONE_THREAD)
            dppl = result["ppl"] / dense["ppl"] - 1.0
            agree = float(np.mean(result["predictions"] == dense["predictions"]))
            ppl = result["ppl"]
        else:
            dppl, agree, ppl = 0.0, 1.0, dense["ppl"]
        gaps = [d["gap"] for d in details if d["tt"] and d["gap"] is not None]
        row = dict(kind=kind, value=value, tt_layers=n_tt, candidates=n_cand, dppl=dppl, ppl=ppl,
                   ppl_dense=dense["ppl"], top1_agreement=agree, mean_gap=float(np.mean(gaps)) if gaps else None,
                   build_s=build_s, layers_detail=details)
        points.append(row)
        log(f"LM {kind}={value}: {n_tt}/{n_cand} layers TT, dppl {dppl:+.2%}, agree {agree:.3f}, "
            f"mean gap {row['mean_gap']}, build {build_s:.0f}s")
        if args.bench and kind == "gap" and n_tt:
            row["bench"] = _bench(config, calib, args)
    out["points"] = points
    return out


def _layer_index(name: str) -> int | None:
    m = re.search(r"layers?\.(\d+)", name) or re.search(r"layer\.(\d+)", name)
    return int(m.group(1)) if m else None


def _restrict(config, names: set[str], model, args):
    """With --layers, an override turns TT off for every other layer."""
    if not args.layers:
        return config
    entries = override_entries("tt", [(n, {}) for n in sorted(names)])
    return dataclasses.replace(config, overrides=parse_overrides({"layers": entries}))


def _bench(config, calib, args) -> dict:
    kv = onnx.load(str(model_path("smollm2", "kv.torchscript")))
    rewritten, _ = rewrite_model(kv, config, calibration=calib)  # same node names as the full export
    return decode_speed({"dense": kv, "tt": rewritten}, load_corpus_tokens(args.tokens), context=128, steps=args.steps)


def sweep_encoder(args) -> dict[str, Any]:
    path = model_path("minilm", "torchscript")
    log(f"encoder: loading {path}")
    model = onnx.load(str(path))
    layers = target_layers(model, args.target)
    if args.layers:
        layers = [layer for layer in layers if _layer_index(layer.name) in set(args.layers)]
    batches = encoder_batches()
    calib_batches = batches[len(batches) // 2:]  # calibration from the second half of the sentences
    calib = calibration(model, layers, calib_batches, args.max_rows)
    points = []
    for kind, value in [("rank", r) for r in args.ranks] + [("gap", g) for g in args.gaps]:
        settings = dict(rank=int(value), gap=0.0, min_flop_ratio=0.0) if kind == "rank" else dict(rank=0, gap=float(value))
        config = _restrict(tt_config(args.target, **settings), {layer.name for layer in layers}, model, args)
        rewritten, report = rewrite_model(model, config, calibration=calib)
        n_tt, n_cand, details = kept_layers(report)
        res = compare_embeddings(model, rewritten, session_options=ONE_THREAD) if n_tt else {"cosine_mean": 1.0, "cosine_min": 1.0}
        points.append(dict(kind=kind, value=value, tt_layers=n_tt, candidates=n_cand, cosine_mean=res["cosine_mean"],
                           cosine_min=res["cosine_min"], layers_detail=details))
        log(f"encoder {kind}={value}: {n_tt}/{n_cand} layers TT, cosine mean {res['cosine_mean']:.4f} "
            f"min {res['cosine_min']:.4f}")
    return {"model": str(path), "layers": len(layers), "points": points}


def plot(payload: dict[str, Any], path: str) -> None:
    import matplotlib  # the plot extra, heavy: only when a PNG is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    lm = payload.get("lm", {})
    enc = payload.get("encoder", {})
    ax = axes[0]
    for name, res, key, fn in [("SmolLM2 dppl", lm, "dppl", lambda v: max(v, 1e-4)),
                               ("MiniLM 1 - cosine", enc, "cosine_mean", lambda v: max(1 - v, 1e-6))]:
        pts = [p for p in res.get("points", []) if p["kind"] == "rank"]
        if pts:
            ax.plot([p["value"] for p in pts], [fn(p[key]) for p in pts], "o-", label=name)
    ax.set_xlabel("uniform rank (every target layer, no gap check)")
    ax.set_ylabel("quality loss (log)")
    ax.set_yscale("log")
    ax.axhline(0.02, color="grey", ls="--", lw=0.8)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax.set_title("quality vs rank", fontsize=10)
    ax = axes[1]
    for name, res in [("SmolLM2", lm), ("MiniLM", enc)]:
        pts = [p for p in res.get("points", []) if p["kind"] == "gap"]
        if pts:
            ax.plot([p["value"] for p in pts], [p["tt_layers"] / max(1, p["candidates"]) for p in pts], "s-", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("autotune gap tolerance --tt-gap")
    ax.set_ylabel("fraction of target layers factored")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax.set_title("layers the autotuner factors", fontsize=10)
    ax = axes[2]
    study = lm.get("study", [])
    for layer in dict.fromkeys(r["layer"] for r in study):
        rows = [r for r in study if r["layer"] == layer]
        short = layer.replace("/model/layers.", "L").replace("/MatMul", "")
        ax.plot([r["flop_ratio"] for r in rows], [r["gap_whitened"] for r in rows], "o-", label=f"{short} whitened")
        ax.plot([r["flop_ratio"] for r in rows], [r["gap_svd"] for r in rows], "x--", label=f"{short} plain SVD")
        ax.plot([r["tt3_flop_ratio"] for r in rows], [r["gap_tt3"] for r in rows], "^:", label=f"{short} TT d=3")
    if study:
        ax.axhline(0.02, color="grey", ls="--", lw=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("FLOP ratio dense / factored")
        ax.set_ylabel("output gap on held-out calibration rows")
        ax.legend(fontsize=6)
        ax.grid(alpha=0.3)
        ax.set_title("per-layer gap vs FLOP ratio", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(payload: dict[str, Any], png: str) -> str:
    lines = ["# TTMatMul quality sweep", "", f"Command: `{payload['command']}`", "", f"![sweep]({Path(png).name})", ""]
    lm = payload.get("lm")
    if lm and lm.get("study"):
        lines += ["## Per-layer output gap (held-out calibration rows)", "",
                  "| layer | rank | FLOP ratio | gap plain SVD | gap whitened | weight err plain | weight err whitened | TT d=3 rank | TT3 FLOP ratio | gap TT3 |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in lm["study"]:
            lines.append(f"| {r['layer']} | {r['rank']} | {r['flop_ratio']:.2f} | {r['gap_svd']:.4f} | "
                         f"{r['gap_whitened']:.4f} | {r['weight_err_svd']:.4f} | {r['weight_err_whitened']:.4f} | "
                         f"{r['tt3_rank']} | {r['tt3_flop_ratio']:.2f} | {r['gap_tt3']:.4f} |")
        lines.append("")
    for title, res, cols in [("SmolLM2", lm, ("dppl", "top1_agreement")),
                             ("MiniLM", payload.get("encoder"), ("cosine_mean", "cosine_min"))]:
        if not res or not res.get("points"):
            continue
        lines += [f"## {title}", "", f"| point | TT layers | {cols[0]} | {cols[1]} |", "|---|---|---|---|"]
        for p in res["points"]:
            a = f"{p[cols[0]]:+.2%}" if cols[0] == "dppl" else f"{p[cols[0]]:.4f}"
            lines.append(f"| {p['kind']}={p['value']} | {p['tt_layers']}/{p['candidates']} | {a} | {p[cols[1]]:.4f} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2", "minilm"], choices=["smollm2", "minilm"])
    parser.add_argument("--full", help="SmolLM2 full-sequence export (default: cache)")
    parser.add_argument("--tokens", help="token ids .npy (default: cached britannica corpus)")
    parser.add_argument("--target", default="mlp", help="layers (mlp, attn, both, down, all)")
    parser.add_argument("--layers", type=int, nargs="*", help="only these decoder layer indices")
    parser.add_argument("--ranks", type=int, nargs="*", default=[32, 64, 128, 256, 384])
    parser.add_argument("--gaps", type=float, nargs="*", default=[0.02, 0.05, 0.1, 0.2])
    parser.add_argument("--study", action=argparse.BooleanOptionalAction, default=True, help="per-layer gap study")
    parser.add_argument("--study-only", action="store_true")
    parser.add_argument("--study-ranks", type=int, nargs="*", default=[16, 32, 64, 128, 192, 256, 384])
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--calib-windows", type=int, default=2)
    parser.add_argument("--window-len", type=int, default=512)
    parser.add_argument("--max-rows", type=int, default=2048, help="calibration rows kept per layer")
    parser.add_argument("--bench", action="store_true", help="decode tokens/s of each autotuned model (KV export)")
    parser.add_argument("--steps", type=int, default=32, help="timed steps of the real decode loop (--bench)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 layers, tiny windows, one point each")
    parser.add_argument("-o", "--output", default="reports/sweep_tt")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers = args.layers or [0]
        args.ranks, args.gaps = [64], [0.2]
        args.windows, args.calib_windows, args.window_len, args.max_rows = 1, 1, 128, 256
        args.study_ranks = [64]
        args.output = args.output if args.output != "reports/sweep_tt" else "reports/sweep_tt_quick"
    tt.enable_factor_cache()  # every point rebuilds the same layers: one whitened SVD per layer

    payload: dict[str, Any] = {"command": command_line("python bench/sweep_tt.py", argv),
                               "machine": machine_info(), "threads": 1}
    if "smollm2" in args.models:
        payload["lm"] = sweep_lm(args)
    if "minilm" in args.models and not args.study_only:
        payload["encoder"] = sweep_encoder(args)
    png = args.output + ".png"
    Path(png).parent.mkdir(parents=True, exist_ok=True)
    plot(payload, png)
    write_report(args.output, payload, markdown(payload, png))
    log(f"wrote {args.output}.json .md .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
