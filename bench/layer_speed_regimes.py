"""Which layer-speed measurement matches a decode step: per speed class of a quantized model, the
time per unit of the input's layers and of ours at tune's keeps, measured three ways:

- profile: ORT's profiler inside real decode steps (context 128, the KV cache growing), the node
  times of the class's layers per layer (input form only: our op's keep in a real step depends on
  the tokens);
- flushed: each class alone, every run after a cache flush (tune's layer speed before 2026-11-28);
- rotation: every class's sessions in one rotation without a flush (tune's layer speed now).

usage: python bench/layer_speed_regimes.py GENAI_FOLDER [--seconds 3] [--threads 1] [-o reports/layer_speed_regimes]
"""
from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

import onnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import profile_decode  # noqa: E402

from ortsparse.benchmarking import command_line, machine_info, report_header, write_report  # noqa: E402
from ortsparse.graph_rewrite.genai import model_input  # noqa: E402
from ortsparse.calibration.allocation import gated_layers, units_of  # noqa: E402
from ortsparse.measure.corpus import load_corpus_tokens  # noqa: E402
from ortsparse.tuning import layer_speed  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="an onnxruntime-genai folder (or a decoder .onnx) with MatMulNBits layers")
    parser.add_argument("--seconds", type=float, default=layer_speed.SECONDS_PER_CLASS, help="rotation time per class")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("-o", "--output", default="reports/layer_speed_regimes")
    args = parser.parse_args(argv)
    model = onnx.load(str(model_input(args.model)))
    classes = list(layer_speed.speed_classes(model, units_of(gated_layers(model, "both"))).items())
    with tempfile.TemporaryDirectory() as tmp:
        _, _, per_node = profile_decode.profile(model, load_corpus_tokens(), 128, 9, f"{tmp}/p", warmup=12,
                                                threads=args.threads)
    flushed = [layer_speed.measure_classes(model, [c], threads=args.threads, seconds=args.seconds, flush=True)[0]
               for c in classes]
    rotation = layer_speed.measure_classes(model, classes, threads=args.threads, seconds=args.seconds, flush=False)
    keeps = sorted(layer_speed.KEEPS, reverse=True)
    rows = []
    for (signature, members), old, new in zip(classes, flushed, rotation):
        names = {re.sub(r"layers\.\d+", "layers.N", layer.name) for layer in members[0].layers}
        in_step = sum(per_node.get(name, 0.0) for name in names) / len(members)
        rows.append({"class": " + ".join(signature), "units": len(members), "profile_input_us": in_step,
                     "flushed": old.to_dict(), "rotation": new.to_dict()})
    command = command_line("python bench/layer_speed_regimes.py", argv)
    lines = report_header("Layer speed: which measurement matches a decode step", command, machine_info())
    lines += ["Microseconds per unit and decode row. profile: ORT's profiler in real decode steps at context 128 "
              "(median per node over 9 steps after 12), input form; flushed: each class alone, a cache flush before "
              "every run; rotation: every class's sessions in one rotation, no flush. ours at keep 1 / 0.75 / 0.5 / "
              "0.25.", "", "| class | profile, input | flushed: input | flushed: ours | rotation: input | "
              "rotation: ours |", "|---|---|---|---|---|---|"]
    for row in rows:
        cells = [f"{row['profile_input_us']:.1f}"]
        for regime in ("flushed", "rotation"):
            record = row[regime]
            cells += [f"{record['input_us']:.1f}",
                      " / ".join(f"{record['ours_us'][f'{k:g}']:.1f}" for k in keeps) + f" ({record['rounds']} rounds)"]
        lines.append(f"| {row['class']} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    write_report(args.output, {"rows": rows, "machine": machine_info(), "command": command}, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
