"""Why gating costs more on one model than another: the inputs of every gateable linear layer,
captured on text windows (one dense pass of the decoder graph per window), summarised per layer
class (q/k/v, attention output, gate/up, down) and per part of the stack (first / middle / last third).

Per captured row (one token's input x to a layer, K channels):
- mass in the smallest 25% / 50% of channels: sum of the smallest |x_k| over sum |x_k| — what a
  gate that skips those rows leaves out, in |x| terms;
- energy share of the top 1% of channels (outlier concentration);
- the output error of skipping 25% / 50% of the rows at single-row granularity, ||x_skip W|| / ||x W||,
  with the rows chosen by |x| (the gate's score today) or by |x| * ||W_k,:|| (a weight-aware score),
  and at block 16 (contiguous blocks of 16 rows by block L2): how much granularity and score matter.
Means over rows, then over the layers of a class (a fused unit's layers share its x: their outputs
are concatenated).

usage: python bench/activation_stats.py smollm2=DIR gemma3=DIR [--text FILE] [--windows 4]
         [--window-len 512] [--rows 1024] -o reports/activation_stats
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict

import numpy as np

from ortsparse.benchmarking import check_report, command_line, machine_info, report_header, write_report
from ortsparse.calibration.allocation import (LmLoss, capture_inputs, gated_layers, prepare_lm, thresholds_for,
                                              uniform_choice, units_of)
from ortsparse.measure.decode import loop_tokens
from ortsparse.measure.source import open_model
from ortsparse.measure.text import resolve_bos
from ortsparse.runtime import lm_feeds

SPARSITIES = (0.25, 0.5)
ROLE_CLASS = {"q": "q/k/v", "k": "q/k/v", "v": "q/k/v", "qkv": "q/k/v", "out": "attn out", "o": "attn out",
              "up": "gate/up", "gate": "gate/up", "gate_up": "gate/up", "down": "down"}


def mass_shares(x: np.ndarray) -> dict[str, float]:
    """Mean over rows of the |x| mass in the smallest 25% / 50% of channels, and the energy share of
    the top 1% of channels."""
    a = np.sort(np.abs(x.astype(np.float64)), axis=1)
    k = a.shape[1]
    total = a.sum(axis=1) + 1e-30
    energy = (a ** 2).sum(axis=1) + 1e-30
    top = max(1, k // 100)
    return {"mass_low25": float(np.mean(a[:, : k // 4].sum(axis=1) / total)),
            "mass_low50": float(np.mean(a[:, : k // 2].sum(axis=1) / total)),
            "energy_top1pct": float(np.mean((a[:, -top:] ** 2).sum(axis=1) / energy))}


def skip_error(x: np.ndarray, w: np.ndarray, score: np.ndarray, sparsity: float, block: int = 1) -> float:
    """Mean over rows of ||x_skipped W|| / ||x W|| when the ``sparsity`` fraction of rows (or of
    blocks of ``block`` rows) with the smallest score is skipped."""
    x = x.astype(np.float64)
    k = x.shape[1]
    if block > 1:
        blocks = -(-k // block)
        padded = np.zeros((score.shape[0], blocks * block))
        padded[:, :k] = score
        block_score = np.sqrt((padded.reshape(score.shape[0], blocks, block) ** 2).sum(axis=2))
        drop_blocks = np.argsort(block_score, axis=1, kind="stable")[:, : int(round(sparsity * blocks))]
        mask = np.zeros((score.shape[0], blocks), bool)
        np.put_along_axis(mask, drop_blocks, True, axis=1)
        dropped = np.repeat(mask, block, axis=1)[:, :k]
    else:
        drop = np.argsort(score, axis=1, kind="stable")[:, : int(round(sparsity * k))]
        dropped = np.zeros_like(x, dtype=bool)
        np.put_along_axis(dropped, drop, True, axis=1)
    full = x @ w
    lost = np.where(dropped, x, 0.0) @ w
    return float(np.mean(np.linalg.norm(lost, axis=1) / (np.linalg.norm(full, axis=1) + 1e-30)))


def third(index: int | None, blocks: int) -> str:
    if index is None:
        return "?"
    return ("first", "middle", "last")[min(2, 3 * index // max(1, blocks))]


def sensitivity(source, batches: list[np.ndarray], rows: int) -> dict:
    """How much loss a unit of output error costs, per layer class: the allocation's probes (each unit
    gated alone where its output error first reaches 2%; KL(dense || gated) of the next-token
    distribution on the first window, nats), and the KL measured with every unit at one sparsity."""
    prepared = prepare_lm(source, np.stack(batches[1:]), np.stack(batches[:1]), target="both", max_rows=rows,
                          log=lambda line: None)
    loss = LmLoss(prepared.session, np.stack(batches[:1]), keep_logprobs=True)
    uniform = {f"kl_uniform_{int(100 * s)}": loss.kl(thresholds_for(prepared.units, prepared.layers,
                                                                   uniform_choice(prepared.units, s)))
               for s in SPARSITIES}
    per_class: dict[str, list] = defaultdict(list)
    for unit in prepared.units:
        per_class[ROLE_CLASS.get(unit.layers[0].role, unit.layers[0].role)].append(unit)
    classes = {role: {"units": len(units), "probe_kl": float(np.mean([u.probe["loss"] for u in units])),
                      "probe_sparsity": float(np.mean([u.probe["sparsity"] for u in units])),
                      "kl_per_error": float(np.mean([u.scale for u in units])),
                      "kl_per_error_max": float(np.max([u.scale for u in units]))}
               for role, units in sorted(per_class.items())}
    return {"classes": classes, **uniform}


def model_stats(path: str, text: str | None, windows: int, window_len: int, rows: int,
                with_sensitivity: bool = False) -> dict:
    source = open_model(path)
    tokens, described = loop_tokens(text=text, corpus=None, model=source.path, tokenizer=None,
                                    vocabulary=source.vocabulary)
    bos = resolve_bos("auto", source.path, None, source.vocabulary)
    length = window_len - (bos.id is not None)
    if tokens.size < windows * length:
        raise SystemExit(f"{described} has {tokens.size} tokens; {windows} windows of {length} need more")
    stride = tokens.size // windows
    batches = []
    for i in range(windows):
        window = tokens[i * stride: i * stride + length]
        batches.append(np.concatenate([[bos.id], window]) if bos.id is not None else window)
    layers = gated_layers(source, "both")
    units = units_of(layers)
    kv = source.kv_layout

    def feeds(session, batch):
        return lm_feeds(session, batch, kv(session))

    inputs = capture_inputs(source.weights, units, batches, max_rows=rows, feeds=feeds)
    blocks = 1 + max((layer.block_index or 0) for layer in layers)
    per_class: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for unit in units:
        x = inputs[unit.input_name]
        w = np.concatenate([layer.weight.astype(np.float64) for layer in unit.layers], axis=1)
        row_norms = np.linalg.norm(w, axis=1)
        record = mass_shares(x)
        for s in SPARSITIES:
            record[f"err{int(100 * s)}_abs"] = skip_error(x, w, np.abs(x), s)
            record[f"err{int(100 * s)}_wina"] = skip_error(x, w, np.abs(x) * row_norms, s)
            record[f"err{int(100 * s)}_block16"] = skip_error(x, w, np.abs(x), s, block=16)
        role = ROLE_CLASS.get(unit.layers[0].role, unit.layers[0].role)
        part = third(unit.layers[0].block_index, blocks)
        per_class[(role, "all")].append(record)
        per_class[(role, part)].append(record)
    summary = {f"{role}|{part}": {key: float(np.mean([r[key] for r in records])) for key in records[0]} | {
        "units": len(records)} for (role, part), records in sorted(per_class.items())}
    out = {"path": str(path), "text": described, "bos": bos.id, "windows": windows, "window_len": window_len,
           "rows_per_unit": rows, "blocks": blocks, "classes": summary}
    if with_sensitivity:
        del inputs
        out["sensitivity"] = sensitivity(source, batches, rows)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", metavar="NAME=DIR", help="fp32 genai folders (or KV decoder files)")
    parser.add_argument("--text", help="a UTF-8 text (default: Python's documentation)")
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--window-len", type=int, default=512)
    parser.add_argument("--rows", type=int, default=1024, help="rows sampled per layer input (default 1024)")
    parser.add_argument("--sensitivity", action="store_true",
                        help="also the loss per unit of output error per layer class (the allocation's probes) and "
                             "the KL with every layer at 25% / 50% sparsity")
    parser.add_argument("-o", "--output", required=True, metavar="STEM")
    args = parser.parse_args(argv)
    check_report(args.output)
    command = command_line("python bench/activation_stats.py", argv)
    info = machine_info()
    results = {}
    for spec in args.models:
        name, _, path = spec.partition("=")
        print(f"{name}: capturing {args.windows} windows of {args.window_len} tokens ...", flush=True)
        results[name] = model_stats(path, args.text, args.windows, args.window_len, args.rows, args.sensitivity)
    lines = report_header("Inputs of the gated linear layers, per layer class", command, info)
    first = next(iter(results.values()))
    lines += [f"Text: {first['text']}; {args.windows} windows of {args.window_len} tokens per model (BOS first "
              f"where the tokenizer adds one), {args.rows} sampled rows per layer input. Mass: share of sum |x| in "
              "the smallest 25% / 50% of channels (per token, mean). Top 1%: share of ||x||^2 in the largest 1% of "
              "channels. err: ||x_skipped W|| / ||x W|| when 25% / 50% of the rows are skipped, chosen by |x| (single "
              "rows), by |x| * ||W_row|| (single rows) and by block L2 (blocks of 16).", "",
              "| model | class | part | units | mass low 25% | mass low 50% | top 1% energy | err 25% |x| | err 25% "
              "|x|·‖W‖ | err 25% block 16 | err 50% |x| | err 50% |x|·‖W‖ | err 50% block 16 |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, result in results.items():
        for key, c in result["classes"].items():
            role, part = key.split("|")
            lines.append(f"| {name} | {role} | {part} | {c['units']} | {c['mass_low25']:.3f} | {c['mass_low50']:.3f} | "
                         f"{c['energy_top1pct']:.3f} | {c['err25_abs']:.3f} | {c['err25_wina']:.3f} | "
                         f"{c['err25_block16']:.3f} | {c['err50_abs']:.3f} | {c['err50_wina']:.3f} | "
                         f"{c['err50_block16']:.3f} |")
    if args.sensitivity:
        lines += ["", "Sensitivity (the allocation's probes on the first window; KL(dense || gated) of the next-token "
                  "distribution, nats): each unit gated alone where its output error first reaches 2%, and every unit "
                  "at one sparsity.", "",
                  "| model | class | units | probe KL (mean) | at sparsity (mean) | KL per unit error (mean / max) |",
                  "|---|---|---|---|---|---|"]
        for name, result in results.items():
            for role, c in result["sensitivity"]["classes"].items():
                lines.append(f"| {name} | {role} | {c['units']} | {c['probe_kl']:.5f} | {c['probe_sparsity']:.2f} | "
                             f"{c['kl_per_error']:.4f} / {c['kl_per_error_max']:.4f} |")
        lines += ["", "| model | KL, every unit at 25% | KL, every unit at 50% |", "|---|---|---|"]
        for name, result in results.items():
            sens = result["sensitivity"]
            lines.append(f"| {name} | {sens['kl_uniform_25']:.4f} | {sens['kl_uniform_50']:.4f} |")
    write_report(args.output, {"machine": info, "command": command, "models": results}, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
