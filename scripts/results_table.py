#!/usr/bin/env python3
"""The README's results section, generated from the measured reports under reports/.

Every number in it is read from a report JSON written by the command the report names
(scripts/remeasure.sh runs them all), so the README cannot drift from what was measured:
tests/test_readme.py checks that the README's section equals this script's output.

usage: python scripts/results_table.py            # print the section
       python scripts/results_table.py --write    # replace it in README.md (between the markers)
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REPORTS = ROOT / "reports"
BEGIN, END = "<!-- results:begin (scripts/results_table.py) -->", "<!-- results:end -->"


def _load(name: str) -> dict | None:
    path = REPORTS / name
    return json.loads(path.read_text()) if path.exists() else None


def _rows(payload: dict, *, threads: int, runner: str) -> dict[tuple[str, int], dict]:
    """(model, context) -> the row of the first run (bench reports may hold several runs)."""
    out: dict[tuple[str, int], dict] = {}
    for row in payload["rows"]:
        if row["threads"] == threads and row["runner"] == runner:
            out.setdefault((row["model"], row["context"]), row)
    return out


def _link(name: str) -> str:
    return f"[{name}](reports/{name})"


def _pct(fraction: float) -> str:
    value = round(100 * fraction, 2)
    return f"{value + 0.0:+.2f}%"  # + 0.0: no "-0.00%"


def _speed(before: float, after: float) -> str:
    return f"{before:.1f} -> {after:.1f} (**{after / before:.2f}x**)"


def baselines_table() -> list[str]:
    payload = _load("baselines.json")
    if payload is None:
        return []
    speed = payload["speed"]
    contexts = sorted({r["context"] for r in speed["rows"]})
    quality = {r["model"]: r for r in payload["quality"]["rows"]}
    lines = ["What a CPU user starts from: SmolLM2-135M decode, tokens/s, 1 thread, run as an app runs it "
             "(onnxruntime-genai `Generator`; our own fp32 export in an ORT session), dppl = perplexity change "
             f"vs fp32 ({_link('baselines.md')}, `{payload['command']}`):", "",
             "| model | dppl | " + " | ".join(f"ctx {c}" for c in contexts) + " |",
             "|---|---|" + "---|" * len(contexts)]
    for model, runner, label in (("genai-fp32", "og", "onnxruntime-genai fp32"),
                                 ("genai-int8", "og", "onnxruntime-genai int8"),
                                 ("genai-int4", "og", "onnxruntime-genai int4"),
                                 ("ours", "ort", "torch.onnx export, fp32 (ORT)")):
        rows = _rows(speed, threads=1, runner=runner)
        if model not in quality or not any((model, c) in rows for c in contexts):
            continue
        cells = [f"{rows[(model, c)]['tokens_per_s']:.1f}" if (model, c) in rows else "—" for c in contexts]
        lines.append(f"| {label} | {_pct(quality[model]['dppl'])} | " + " | ".join(cells) + " |")
    return lines + [""]


def _bench_pairs(payload: dict, precision: str):
    """(context, input row, rewritten row) of a bench report, 1 thread, through the Generator."""
    rows = _rows(payload, threads=1, runner="og")
    for context in sorted({c for _, c in rows}):
        base, new = rows.get((f"genai-{precision}", context)), rows.get((f"genai-{precision}+ortsparse", context))
        if base and new:
            yield context, base, new


def _row(workload: str, precision: str, technique: str, quality: str, speed: str, report: str) -> str:
    return f"| {workload} | genai {precision} | {technique} | {quality} | {speed} | {_link(report)} |"


def technique_rows() -> list[str]:
    lines = ["What ortsparse adds on top (same models, same loop; each row's two speeds come from one run, models "
             "alternating; quality is against the model ortsparse started from unless it says fp32):", "",
             "| workload | model | ortsparse | quality | decode tok/s, 1 thread | report |", "|---|---|---|---|---|---|"]
    found = False
    for precision in ("int4", "int8", "fp32"):  # long context: PopcountGroupQueryAttention
        payload = _load(f"bench_genai_{precision}_attention.json")
        if payload is None:
            continue
        quality = _load(f"quality_genai_{precision}_attention.json")
        dppl = ""
        if quality is not None:
            result = quality["result"]
            dppl = (f"dppl {_pct(result['dppl'])} on {result['windows']} x {result['window_len']} tokens "
                    f"({_link(f'quality_genai_{precision}_attention.json')}); ")
        for context, base, new in _bench_pairs(payload, precision):
            found = True
            lines.append(_row(f"decode at {context} tokens of context", precision, "`--attn=popcount`",
                              f"{dppl}top-1 agreement {new['top1_agreement']:.3f} over {new['steps']} steps",
                              _speed(base["tokens_per_s"], new["tokens_per_s"]), f"bench_genai_{precision}_attention.md"))
    for precision in ("int8", "int4"):  # gating on quantized weights, calibrated within 2% of fp32
        payload, calibration = _load(f"bench_genai_{precision}_gated.json"), \
            _load(f"smollm2_genai_{precision}_gated.report.json")
        if payload is None or calibration is None:
            continue
        held = calibration["held_out"]
        skipped = calibration["bytes"]["skipped_fraction_of_gated"]
        head = "; lm_head dense on our kernel" if calibration.get("allocation", {}).get("dense_on_ours") else ""
        for context, base, new in _bench_pairs(payload, precision):
            found = True
            lines.append(_row(f"decode at {context} tokens, quality budget 2%", precision,
                              f"calibrated gating ({100 * skipped:.0f}% of gated weight bytes skipped{head})",
                              f"dppl {_pct(held['dppl'])} vs {'fp32' if calibration.get('reference') else precision} "
                              "(held-out)",
                              _speed(base["tokens_per_s"], new["tokens_per_s"]), f"bench_genai_{precision}_gated.md"))
    # The int8 gating above with GroupQueryAttention on our kernel (exact below min_keys = 2048 keys).
    payload, composed, gated_only = (_load("bench_genai_int8_gated_attn.json"), _load("quality_genai_int8_gated_attn.json"),
                                     _load("quality_genai_int8_gated.json"))
    if payload is not None and composed is not None and gated_only is not None:
        result = composed["result"]
        quality = (f"dppl {_pct(result['dppl'])} vs fp32 on {result['windows']} x {result['window_len']} unseen tokens "
                   f"(gating alone {_pct(gated_only['result']['dppl'])}; {_link('quality_genai_int8_gated_attn.json')})")
        for context, base, new in _bench_pairs(payload, "int8"):
            found = True
            lines.append(_row(f"decode at {context} tokens, quality budget 2%", "int8",
                              "the calibrated gating + `--attn=popcount` (attention exact below 2048 keys, on our kernel)",
                              quality, _speed(base["tokens_per_s"], new["tokens_per_s"]),
                              "bench_genai_int8_gated_attn.md"))
    for precision in ("fp32", "int8"):  # the one-command path
        report = _load(f"tune_genai_{precision}.json")
        if report is None or not report.get("written"):
            continue
        speed = report.get("speed") or {}
        if "input" not in speed or "tuned" not in speed:
            continue
        found = True
        against = "vs fp32" if report.get("reference") else "vs input"
        lines.append(_row(f"`ortsparse tune`, unseen text, budget {100 * report['max_dppl']:.0f}%", precision,
                          f"gating, {100 * report['gating']['skipped_fraction']:.0f}% of gated bytes skipped",
                          f"dppl {_pct(report['held_out']['dppl'])} {against} (held-out)",
                          f"{_speed(speed['input']['tokens_per_s'], speed['tuned']['tokens_per_s'])} at "
                          f"{report['speed_context']}", f"tune_genai_{precision}.md"))
    return lines + [""] if found else []


def section() -> str:
    lines = [BEGIN, *baselines_table(), *technique_rows(),
             "Each report names its command and machine; `scripts/remeasure.sh` re-runs them all. Older and "
             "kernel-level results: [docs/results.md](docs/results.md).", END]
    return "\n".join(lines)


def replace_section(readme: str, new: str) -> str:
    start, stop = readme.index(BEGIN), readme.index(END) + len(END)
    return readme[:start] + new + readme[stop:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="replace the section in README.md")
    args = parser.parse_args()
    text = section()
    if not args.write:
        print(text)
        return 0
    readme = ROOT / "README.md"
    current = readme.read_text()
    if BEGIN not in current or END not in current:
        print(f"results_table.py: README.md has no '{BEGIN}' ... '{END}' section", file=sys.stderr)
        return 2
    readme.write_text(replace_section(current, text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
