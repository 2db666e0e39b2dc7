"""Quality / sparsity frontier of calibrated KWTA gating on SmolLM2 (reports/frontier_smollm2.*).

Every point is an override file applied by the rewriter (KwtaBlockMatMul, threshold per layer,
block 1) and measured with ortsparse.measure.perplexity.compare_lm on the held-out windows (the
first half of the corpus, 8 x 512 tokens) — what `ortsparse quality MODEL --config FILE` runs.
The per-layer curves and probes come from ortsparse.calibration.allocation on the calibration half
(cached in ~/.cache/ortsparse/frontier). Points: uniform sparsity (every layer the same), the
Lagrangian allocation at several prices (score l2 and l2_weighted, head excluded / included), and
the library's own pick (`ortsparse calibrate --method allocated`, read from its report).

    python scripts/frontier.py [--pick reports/frontier_smollm2.config.report.json]
    python scripts/frontier.py --minilm     # reports/frontier_minilm.json (cosine instead of dppl)

MiniLM: the cache's 64 sentences, the first 32 held out, the last 32 for calibration; for each
mean-cosine budget, the library's allocation (`allocate_encoder`, margin 0.75) against the largest
uniform sparsity (0.025 steps) that meets the same calibration budget, both checked on the held-out
sentences through the rewritten graph (compare_embeddings, what `ortsparse quality` runs).
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
from pathlib import Path

import numpy as np
import onnx

from ortsparse.graph_rewrite.layer_settings import rewritten_with
from ortsparse.calibration import allocation
from ortsparse.measure.corpus import lm_windows, load_corpus_tokens
from ortsparse.zoo.models import model_path
from ortsparse.measure.perplexity import compare_lm

CACHE = Path(os.path.expanduser("~/.cache/ortsparse/frontier"))
POINTS = [("uniform", "l2", False, s) for s in (0.2, 0.225, 0.25, 0.275, 0.3)] + \
         [("allocated", "l2", False, mu) for mu in (0.3, 0.4, 0.5, 0.57, 0.65)] + \
         [("allocated", "l2_weighted", False, mu) for mu in (0.5, 0.6)] + \
         [("allocated", "l2", True, mu) for mu in (0.5, 0.8)]


def probed_units(model, layers, calib_tokens, score: str, log=print):
    """Curves + probes of every unit (the allocation's first two stages), cached per score."""
    path = CACHE / f"smollm2_probed_{score}_512_0.02.pkl"
    if path.exists():
        with open(path, "rb") as handle:
            return pickle.load(handle)
    windows = lm_windows(calib_tokens, 8, 512)
    units = allocation.units_of(layers)
    inputs_path = CACHE / "smollm2_inputs.pkl"  # scripts/frontier_rotation.py reads them too
    if inputs_path.exists():
        with open(inputs_path, "rb") as handle:
            inputs = pickle.load(handle)
    else:
        inputs = allocation.capture_inputs(model, units, list(windows))
        CACHE.mkdir(parents=True, exist_ok=True)
        with open(inputs_path, "wb") as handle:
            pickle.dump(inputs, handle)
    allocation.measure_curves(units, inputs, score)
    session = allocation.ProbeSession(model, layers, score)
    probe = allocation.LmLoss(session, lm_windows(calib_tokens, 1, 512, offset=8 * 512), keep_logprobs=True)
    allocation.probe_units(units, layers, probe.kl, level=0.02)
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:
        pickle.dump(units, handle)
    return units


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pick", help="report of `ortsparse calibrate --method allocated` to add as a point")
    parser.add_argument("--out", default=None)
    parser.add_argument("--minilm", action="store_true", help="the MiniLM frontier instead")
    args = parser.parse_args()
    if args.minilm:
        return minilm(args.out or "reports/frontier_minilm")
    args.out = args.out or "reports/frontier_smollm2"
    model_file = model_path("smollm2", "full.torchscript")
    model = onnx.load(str(model_file))
    eval_tokens, calib_tokens = np.split(load_corpus_tokens(), [len(load_corpus_tokens()) // 2])
    layers = allocation.gated_layers(model, "all")
    rows = []
    for method, score, head, value in POINTS:
        units = [u for u in probed_units(model, layers, calib_tokens, score) if head or u.layers[0].role != "head"]
        choice = allocation.allocate(units, value) if method == "allocated" else allocation.uniform_choice(units, value)
        found = allocation.Allocation(score, [layer for u in units for layer in u.layers], units, choice, 0.0, 0.0, [], {})
        result = compare_lm(model, rewritten_with(model, found.plan()), eval_tokens, 8, 512,
                            session_options={"intra_op_num_threads": 1})
        row = {"method": method, "score": score, "head": head, "price" if method == "allocated" else "sparsity": value,
               "dppl": result["dppl"], "top1_agreement": result["top1_agreement"],
               **allocation.bytes_summary(model, result["metrics"]), "sparsity_by_layer": found.sparsity()}
        rows.append(row)
        print(f"{method:9s} {score:11s} head={head!s:5s} {value:<5}: gated skipped {row['skipped_fraction_of_gated']:.1%}"
              f" (all {row['skipped_fraction_of_all']:.1%}), dppl {row['dppl']:+.2%}, top-1 {row['top1_agreement']:.3f}",
              flush=True)
    if args.pick:
        pick = json.loads(Path(args.pick).read_text())
        rows.append({"method": "library pick", "score": pick["allocation"]["score"], "head": pick["target"] == "all",
                     "command": pick["command"], "dppl": pick["held_out"]["dppl"],
                     "top1_agreement": pick["held_out"]["top1_agreement"], **pick["bytes"],
                     "calibration_dppl": pick["allocation"]["calibration_loss"],
                     "seconds": pick["allocation"]["seconds"]})
    report = {"model": str(model_file), "held_out": {"windows": 8, "window_len": 512, "offset": 0,
                                                     "tokens": "first half of the corpus"},
              "command": "python scripts/frontier.py " + " ".join(sys.argv[1:]), "points": rows}
    Path(args.out + ".json").write_text(json.dumps(report, indent=1, default=float) + "\n")
    plot(rows, args.out + ".png")
    print(f"wrote {args.out}.json and .png")
    return 0


def minilm(out: str) -> int:
    from ortsparse.measure.corpus import default_sentences, load_sentences, sentence_batches
    from ortsparse.measure.embeddings import compare_embeddings

    model_file = model_path("minilm", "torchscript")
    model = onnx.load(str(model_file))
    arrays = load_sentences(default_sentences())
    half = arrays["input_ids"].shape[0] // 2
    held = {k: v[:half] for k, v in arrays.items()}
    calib = sentence_batches({k: v[half:] for k, v in arrays.items()})
    rows = []

    def check(found, method, budget):
        result = compare_embeddings(model, rewritten_with(model, found.plan()), held)
        row = {"method": method, "score": found.score, "min_cosine": budget, "cosine_mean": result["cosine_mean"],
               "cosine_min": result["cosine_min"], **allocation.bytes_summary(model, result["metrics"]),
               "sparsity_by_layer": found.sparsity()}
        rows.append(row)
        print(f"cos >= {budget}: {method:9s} {found.score:11s} skipped {row['skipped_fraction_of_gated']:.1%} of gated "
              f"bytes, held-out cosine {row['cosine_mean']:.4f} (min {row['cosine_min']:.4f})", flush=True)

    for budget in (0.995, 0.99, 0.98):
        for score in allocation.SCORES:
            found = allocation.allocate_encoder(model, calib, budget, score=score, log=lambda *_: None)
            check(found, "allocated", budget)
            loss = allocation.EncoderLoss(allocation.ProbeSession(model, found.layers, score), calib)
            best = {}
            for sparsity in np.arange(0.025, 0.9, 0.025):
                choice = allocation.uniform_choice(found.units, sparsity)
                if loss.loss(allocation.thresholds_for(found.units, found.layers, choice)) > found.budget:
                    break
                best = choice
            check(allocation.Allocation(score, found.layers, found.units, best, found.budget, 0.0, [], {}), "uniform",
                  budget)
    report = {"model": str(model_file), "held_out": "sentences 0-31 of the cache's set (calibration: 32-63)",
              "command": "python scripts/frontier.py --minilm", "points": rows}
    Path(out + ".json").write_text(json.dumps(report, indent=1, default=float) + "\n")
    print(f"wrote {out}.json")
    return 0


def plot(rows, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    styles = {("uniform", "l2", False): ("o-", "uniform sparsity (TEAL-style)"),
              ("allocated", "l2", False): ("s-", "allocated, |x|"),
              ("allocated", "l2_weighted", False): ("^-", "allocated, |x|·||W|| (WINA)"),
              ("allocated", "l2", True): ("D-", "allocated, |x|, head gated too")}
    for key, (style, label) in styles.items():
        pts = sorted((r for r in rows if (r["method"], r["score"], r["head"]) == key),
                     key=lambda r: r["skipped_fraction_of_gated"])
        if pts:
            ax.plot([100 * r["dppl"] for r in pts], [100 * r["skipped_fraction_of_gated"] for r in pts], style,
                    label=label, ms=6)
    for r in rows:
        if r["method"] == "library pick":
            ax.scatter([100 * r["dppl"]], [100 * r["skipped_fraction_of_gated"]], marker="*", s=220, c="black",
                       label="library pick (calibrate --method allocated)", zorder=5)
    ax.axvline(2.0, color="grey", ls="--", lw=0.8)
    ax.axhline(30.0, color="grey", ls=":", lw=0.8)
    ax.text(2.05, ax.get_ylim()[0] + 0.3, " 2% budget", color="grey", fontsize=8)
    ax.set_xlabel("held-out perplexity increase dppl (%) — 8 x 512 tokens, real rewritten graph")
    ax.set_ylabel("gated weight bytes skipped (%) — op-measured keep ratios")
    ax.set_title("SmolLM2-135M: calibrated activation gating, quality vs bytes skipped", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
