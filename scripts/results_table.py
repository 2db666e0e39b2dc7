#!/usr/bin/env python3
"""The README's "what to expect" table and docs/results.md's results section, generated from the
measured reports under reports/.

Every number in them is read from a report JSON written by the command the report names
(`scripts/remeasure.sh headline` re-runs the README's rows), so the docs cannot drift from what was
measured: tests/test_readme.py checks that both sections equal this script's output.

usage: python scripts/results_table.py            # print both sections
       python scripts/results_table.py --write    # replace them in README.md and docs/results.md
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REPORTS = ROOT / "reports"
BEGIN, END = "<!-- results:begin (scripts/results_table.py) -->", "<!-- results:end -->"
EXPECT_BEGIN, EXPECT_END = "<!-- expect:begin (scripts/results_table.py) -->", "<!-- expect:end -->"
RESULTS_DOC = ROOT / "docs" / "results.md"
README = ROOT / "README.md"


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


_LINK_PREFIX = "../reports/"  # the results section lives in docs/


def _link(name: str, prefix: str | None = None) -> str:
    return f"[{name}]({_LINK_PREFIX if prefix is None else prefix}{name})"


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
             "kernel-level results: the sections below.", END]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The README's "what to expect": the headline rows, each the worst round of a multi-round bench
# report (docs/measure.md), with its quality, CPU, date and command.
# ---------------------------------------------------------------------------------------------
# One headline run: `scripts/remeasure.sh headline` writes these into reports/headline/<date>-<cpu>/.
HEADLINE_FILES = dict(int8="bench_int8.json", int8_spinning="bench_int8_spinning.json", int4="bench_int4.json",
                      tune_int8="tune_int8.json", tune_int4="tune_int4.json", request="request_int4_attention.json",
                      frontier="answer_quality_int4.json")
# The first measurement of the rows (Intel Xeon, AVX-512), before remeasure.sh had a headline section.
FIRST_HEADLINE = dict(int8="bench_tune_int8_rotation_head.json",
                      int8_spinning="bench_tune_int8_rotation_head_spinning.json",
                      int4="bench_tune_int4_head_2026-11-28.json",
                      tune_int8="tune_genai_int8_python_docs_rotation_2026-11-28.json",
                      tune_int4="tune_genai_int4_python_docs_rotation_2026-11-28.json",
                      request="request_genai_int4_attention.json", frontier="answer_quality_frontier_int4_4k.json")


def _cpu_kind(reports: dict[str, str]) -> tuple[str, str] | None:
    payload = _load(reports["int8"])
    return None if payload is None else (payload["machine"]["cpu"], payload["machine"].get("isa", "?"))


def headline_runs() -> list[dict[str, str]]:
    """The report names of the newest headline run of each CPU kind (newest first), then the first
    measurement if no run of its CPU kind replaced it: the gain depends on the CPU (its ISA above all).
    A run's rows are those whose reports it has."""
    runs, seen = [], set()
    folders = sorted((REPORTS / "headline").glob("*/"), reverse=True) if (REPORTS / "headline").is_dir() else []
    for folder in [*(f"headline/{f.name}/" for f in folders), ""]:
        reports = ({key: folder + name for key, name in HEADLINE_FILES.items()} if folder
                   else dict(FIRST_HEADLINE))
        if not (REPORTS / reports["frontier"]).exists():  # quality, not speed: the newest one measured
            reports["frontier"] = FIRST_HEADLINE["frontier"]
        kind = _cpu_kind(reports)
        if kind is not None and kind not in seen:
            seen.add(kind)
            runs.append(reports)
    return runs


def _ratio(payload: dict, *, model: str, context: int, threads: int) -> dict | None:
    for ratio in payload["ratios"]:
        if (ratio["model"], ratio["context"], ratio["threads"]) == (model, context, threads):
            return ratio["speedup"]
    return None


def _request_ratio(payload: dict, *, model: str, request: str, threads: int) -> dict | None:
    for ratio in payload["ratios"]:
        if (ratio["model"], ratio["request"], ratio["threads"]) == (model, request, threads):
            return ratio["total_speedup"]
    return None


def _worst_median(speedups: list[dict | None]) -> str:
    if any(s is None for s in speedups):
        return "—"
    worst = " / ".join(f"{s['min']:.2f}x" for s in speedups)
    median = " / ".join(f"{s['median']:.2f}x" for s in speedups)
    return f"**{worst}** (median {median}, {speedups[0]['rounds']} rounds)"


def _when(payload: dict) -> str:
    machine = payload["machine"]
    isa = f" ({machine['isa'].upper().replace('AVX512', 'AVX-512')})" if machine.get("isa") else ""
    return f"{machine['cpu']}{isa}, {machine['cores']} cores; {machine['date'][:10]}"


def _command(payload: dict) -> str:
    """The report's command without its output stem, model paths cut to their folder names."""
    words = []
    for word in payload["command"].split(" -o ")[0].split():
        name, sep, path = word.partition("=")
        words.append(f"{name}={Path(path).name}" if sep and "/" in path else Path(word).name if word.startswith("/") else word)
    return " ".join(words)


def _tune_quality(name: str) -> str:
    report = _load(name)
    if report is None:
        return "—"
    held = report["held_out"]
    against = "fp32" if report.get("reference") else "its input"
    return (f"{_pct(held['dppl'])} vs {against} ({_pct(held['dppl_low'])} .. {_pct(held['dppl_high'])}), "
            f"top-1 {held['top1_agreement']:.3f}, {held['windows']} held-out windows of the tuning text; "
            f"{100 * report['gating']['skipped_fraction']:.1f}% of gated bytes skipped "
            f"([tune report](reports/{name[:-5]}.md))")


def _frontier_cells(name: str, setting: str) -> dict[int, str]:
    """prefix -> "+x% (low .. high), top-1 y (worst z), n windows" of a setting of an answer-quality
    frontier report (bench/answer_quality_frontier.py: windows of the text, answer steps only)."""
    report = _load(name)
    if report is None:
        return {}
    link = _link(name.replace(".json", ".md"), "reports/")
    return {row["prefix"]: (f"{_pct(row['dppl'])} ({_pct(row['dppl_low'])} .. {_pct(row['dppl_high'])}), top-1 "
                            f"{row['top1_agreement']:.3f} (worst window {row['top1_worst_window']:.3f}), "
                            f"{row['windows']} windows ({link})")
            for row in report["rows"] if row["setting"] == setting and row["dppl_low"] is not None}


def _attention_quality(name: str, frontier: str) -> str:
    """dppl of the selecting model vs exact attention and top-1 agreement between them, per context:
    from the answer-quality frontier (several windows) where it has the context, else from the
    one-window event-attention report."""
    report = _load(name)
    cells = dict(_frontier_cells(frontier, "recommended"))
    if report is not None:
        rows = {(row["model"], row["context"]): row for row in report["rows"]}
        for c in sorted(c for model, c in rows if model == "pages"):
            if c not in cells and ("input", c) in rows:
                cells[c] = (f"{_pct(rows[('pages', c)]['dppl_vs_input'])}, top-1 {rows[('input', c)]['top1_vs_pages']:.3f}, "
                            f"one 256-step window ({_link(name.replace('.json', '.md'), 'reports/')})")
    if not cells:
        return "—"
    return ("answer tokens after the prompt, where selection acts, vs exact attention: "
            + "; ".join(f"{c // 1024}k {cell}" for c, cell in sorted(cells.items())))


def _decode_rows(run: dict[str, str]) -> list[str]:
    decode = [("int8", run["int8"], 1, "1"), ("int8", run["int8_spinning"], 2, "2, ORT's default pool"),
              ("int8", run["int8"], 2, "2, `allow_spinning=0`"), ("int4", run["int4"], 1, "1")]
    lines = []
    for precision, name, threads, thread_label in decode:
        payload = _load(name)
        if payload is None:
            continue
        speed = _worst_median([_ratio(payload, model="tuned", context=c, threads=threads) for c in (128, 1024)])
        lines.append(f"| decode, context 128 / 1024 | SmolLM2-135M genai {precision}, `ortsparse tune` "
                     f"{'--reference fp32 ' if precision == 'int8' else ''}(budget 2%) | {thread_label} | {speed} | "
                     f"{_tune_quality(run['tune_' + precision])} | {_when(payload)} | `{_command(payload)}` "
                     f"({_link(name.replace('.json', '.md'), 'reports/')}) |")
    return lines


def _request_row(run: dict[str, str]) -> list[str]:
    payload = _load(run["request"])
    if payload is None:
        return []
    quality = "event_attention_genai_int4.json"  # one window per context; the frontier's windows replace it per context
    speed = _worst_median([_request_ratio(payload, model="int4+ortsparse", request=r, threads=1)
                           for r in ("4096+256", "7936+256")])
    return [f"| whole request, prompt + answer: 4k + 256 / 8k + 256 tokens | SmolLM2-135M genai int4, "
            f"`--attn=popcount` | 1 | {speed} | {_attention_quality(quality, run['frontier'])} | "
            f"{_when(payload)} | `{_command(payload)}` ({_link(run['request'].replace('.json', '.md'), 'reports/')}) |"]


def expect_rows() -> list[str]:
    lines = ["| workload | model, ortsparse setting | threads | speed vs the input model: worst round (median) | "
             "quality | CPU, date | command |", "|---|---|---|---|---|---|---|"]
    for run in headline_runs():
        lines += _decode_rows(run) + _request_row(run)
    return [EXPECT_BEGIN, *lines, EXPECT_END]


def expect_section() -> str:
    return "\n".join(expect_rows())


def replace_section(text: str, new: str, begin: str = BEGIN, end: str = END) -> str:
    start, stop = text.index(begin), text.index(end) + len(end)
    return text[:start] + new + text[stop:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="replace the sections in README.md and docs/results.md")
    args = parser.parse_args()
    targets = [(README, expect_section(), EXPECT_BEGIN, EXPECT_END), (RESULTS_DOC, section(), BEGIN, END)]
    if not args.write:
        print("\n\n".join(text for _, text, _, _ in targets))
        return 0
    for path, text, begin, end in targets:
        current = path.read_text()
        if begin not in current or end not in current:
            print(f"results_table.py: {path.name} has no '{begin}' ... '{end}' section", file=sys.stderr)
            return 2
    for path, text, begin, end in targets:
        path.write_text(replace_section(path.read_text(), text, begin, end))
    return 0


if __name__ == "__main__":
    sys.exit(main())
