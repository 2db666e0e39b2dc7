"""What ``tune`` tells the user: the summary it prints, the markdown report and the plot (drawn when
matplotlib is installed — the ``plot`` extra —, else skipped with a note: the model and the other
reports are written either way)."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..benchmarking import plot_skipped


def _pct(value: float) -> str:
    return f"{100 * value:+.2f}%"


def _speed_ratio(report: dict[str, Any]) -> tuple[float, float] | None:
    speed = report.get("speed") or {}
    if "input" in speed and "tuned" in speed:
        return speed["input"]["tokens_per_s"], speed["tuned"]["tokens_per_s"]
    return None


def summary(report: dict[str, Any]) -> str:
    """The lines tune prints when it wrote; the last one is the verdict (``last_line``)."""
    held = report["held_out"]
    gating = report["gating"]
    dense = gating.get("allocation", {}).get("dense_on_ours", [])
    gated = sum(1 for s in gating["sparsity"].values() if s > 0)
    lines = [f"tune: wrote {report['output']}",
             f"  layers gated: {gated}; gated weight bytes skipped (planned): {100 * gating['skipped_fraction']:.1f}%"
             + (f"; dense on our kernel: {', '.join(dense)}" if dense else ""),
             f"  calibration: dppl {_pct(gating['calibration_dppl'])}, bound {_pct(gating['bound'])} on "
             f"{report['calibration_windows']} windows",
             f"  held-out: dppl {_pct(held['dppl'])} ({_pct(held['dppl_low'])} .. {_pct(held['dppl_high'])}; budget "
             f"{100 * report['max_dppl']:.1f}%), top-1 agreement {held['top1_agreement']:.3f} on "
             f"{held['windows']} x {held['window_len']} tokens",
             f"  attention: {report['attention_note']}"]
    if report.get("max_gated_rows"):
        lines.append(f"  calls of more than {report['max_gated_rows']} rows (prompts) run dense in the written model")
    ratio = _speed_ratio(report)
    if ratio:
        a, b = ratio
        worst = (report["speed"].get("tuned") or {}).get("speedup")
        lines.append(f"  decode (real loop, context {report['speed_context']}, {report.get('speed_runner', 'ORT')}): "
                     f"{a:.1f} -> {b:.1f} tok/s (median {b / a:.2f}x"
                     + (f", worst of {report['speed']['tuned'].get('rounds')} rounds {worst:.2f}x)" if worst else ")"))
    request = (report.get("speed_request") or {}).get("tuned")
    if request:
        base = report["speed_request"]["input"]
        lines.append(f"  whole request ({request['request']} tokens, prompt + answer): {base['total_s']:.2f} -> "
                     f"{request['total_s']:.2f} s (worst round {request['speedup']:.2f}x; time to first token "
                     f"{base['ttft_s']:.2f} -> {request['ttft_s']:.2f} s)")
    elif "error" in (report.get("speed") or {}):
        lines.append(f"  decode: {report['speed']['error']}")
    if report.get("plot"):
        lines.append(f"  {report['plot']}")
    lines.append(f"  {report['seconds']:.0f} s")
    lines.append(report["last_line"])
    return "\n".join(lines)


def markdown(report: dict[str, Any]) -> str:
    held = report["held_out"]
    gating = report["gating"]
    lines = [f"# ortsparse tune: {Path(report['model']).name}", ""]
    if report.get("command"):
        lines += [f"Command: `{report['command']}`  "]
    against = f" vs {Path(report['reference']).name}" if report.get("reference") else ""
    lines += [f"Text: {report['tokens']} tokens; {report['calibration_windows']} calibration + "
              f"{report['check_windows']} check windows of {report['window_len']} ({report['windows_note']}); "
              f"budget {100 * report['max_dppl']:.1f}% dppl{against} on the check windows", "",
              "| | dppl (held-out) | top-1 agreement | gated bytes skipped | decode tok/s |", "|---|---|---|---|---|"]
    ratio = _speed_ratio(report)
    base, tuned = ratio if ratio else (None, None)
    own = "— | — |" if report.get("reference") else "0 | 1 |"  # vs a reference the input's own loss is not measured
    lines.append(f"| input | {own} 0 | {base:.1f} |" if base else f"| input | {own} 0 | — |")
    lines.append(f"| tuned | {_pct(held['dppl'])} ({_pct(held['dppl_low'])} .. {_pct(held['dppl_high'])}) | "
                 f"{held['top1_agreement']:.3f} | {100 * gating['skipped_fraction']:.1f}% | "
                 + (f"{tuned:.1f} ({tuned / base:.2f}x) |" if base and tuned else "— |"))
    lines += ["", f"Held-out: {held['measured_on']}; the interval is mean -/+ "
                  f"{report['selection']['z']} standard errors over the {held['windows']} check windows."]
    if base and tuned:
        lines.append(f"Decode: real loop at context {report['speed_context']}, {report.get('speed_runner', 'ORT')}, "
                     "models alternating.")
    lines += ["", f"Attention: {report['attention_note']}."]
    if report.get("held_out_long"):
        lines.append(f"Held-out at the full context: dppl {_pct(report['held_out_long']['dppl'])}.")
    lines += ["", "## What gating saves here", ""] + _layer_speed_lines(report)
    lines += ["", "## How far from the cliff", "",
              f"Choice rule: {report['selection']['rule']} (z = {report['selection']['z']}, "
              f"sqrt(1/n + 1/m) = {report['selection']['margin_factor']:.3f}).", "",
              "| gated bytes skipped | calibration dppl | monotone fit (5-95% bootstrap) | bound | held-out dppl |",
              "|---|---|---|---|---|"]
    held_by_skip = {round(h["skipped_fraction"], 6): h for h in report.get("held_out_curve", [])}
    for i, point in enumerate(report["calibration_curve"]):
        held_point = held_by_skip.get(round(point["skipped_fraction"], 6))
        mark = " **(chosen)**" if i == report["selection"]["index"] else ""
        lines.append(f"| {100 * point['skipped_fraction']:.1f}%{mark} | {_pct(point['dppl'])} | {_pct(point['trend'])} "
                     f"({_pct(point['band'][0])} .. {_pct(point['band'][1])}) | {_pct(point['bound'])} | "
                     + (f"{_pct(held_point['dppl'])} ({_pct(held_point['low'])} .. {_pct(held_point['high'])})"
                        if held_point else "—") + " |")
    lines += ["", "Held-out dppl in this table: the probe graph (the op's threshold rule in plain ONNX) on the check "
                  "windows, mean -/+ z standard errors; the chosen row's model as written is in the first table."]
    if report.get("plot"):
        lines += ["", report["plot"]]
    lines += ["", f"Exit status {report['exit_status']}: {report['last_line']}"]
    return "\n".join(lines) + "\n"


def _layer_speed_lines(report: dict[str, Any]) -> list[str]:
    speeds = report.get("layer_speed")
    if not isinstance(speeds, list):
        return [f"Layer speed {speeds or 'not measured'}."]
    lines = ["Per speed class (the units sharing ops and shapes), microseconds per unit and decode row, weights "
             "from memory (every class in one rotation), this machine at the run's threads; a unit is gated only where gating saves time:", "",
             "| class | units | input | ours, keep 1 / 0.75 / 0.5 / 0.25 | gating pays from |", "|---|---|---|---|---|"]
    for speed in speeds:
        if speed["input_us"] is None:
            lines.append(f"| {speed['signature']} | {speed['units']} | — | {speed['note']} | byte model |")
            continue
        ours = " / ".join(f"{speed['ours_us'][keep]:.1f}" if keep in speed["ours_us"] else "—"
                          for keep in ("1", "0.75", "0.5", "0.25"))
        even = speed["break_even"]
        lines.append(f"| {speed['signature']} | {speed['units']} | {speed['input_us']:.1f} | {ours} | "
                     + ("never" if even is None else f"{100 * even:.0f}%") + " |")
    return lines


def write_plot(report: dict[str, Any], write: Callable[[Callable[[Path], None]], None]) -> str | None:
    """Draws the plot through ``write(draw)`` (``draw(path)`` saves the PNG); without matplotlib
    nothing is written and the note returned says so."""
    note = plot_skipped()
    if note is None:
        write(lambda path: _draw(report, path))
    return note


def _draw(report: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.8))
    curve = report["calibration_curve"]
    x = [100 * p["skipped_fraction"] for p in curve]
    ax.fill_between(x, [100 * p["band"][0] for p in curve], [100 * p["band"][1] for p in curve], color="C0",
                    alpha=0.2, label="calibration: monotone fit, 5-95% bootstrap over windows")
    ax.plot(x, [100 * p["trend"] for p in curve], color="C0")
    ax.scatter(x, [100 * p["dppl"] for p in curve], color="C0", s=14, label="calibration: measured")
    ax.plot(x, [100 * p["bound"] for p in curve], color="C1", ls=":", label="bound the choice must meet")
    held = report.get("held_out_curve", [])
    if held:
        hx = [100 * h["skipped_fraction"] for h in held]
        hy = [100 * h["dppl"] for h in held]
        ax.errorbar(hx, hy, yerr=[[100 * (h["dppl"] - h["low"]) for h in held],
                                  [100 * (h["high"] - h["dppl"]) for h in held]],
                    fmt="s", color="C2", ms=4, capsize=3, label="held-out (probe graph), -/+ z s.e.")
    ax.scatter([100 * report["gating"]["skipped_fraction"]], [100 * report["held_out"]["dppl"]], marker="*", s=180,
               c="black", zorder=5, label="chosen, as written, held-out")
    ax.axhline(100 * report["max_dppl"], color="grey", ls="--", lw=0.8, label="budget")
    if report["selection"]["limit"] != report["max_dppl"]:
        ax.axhline(100 * report["selection"]["limit"], color="C1", ls="--", lw=0.8, label="--margin x budget")
    ax.set_xlabel("gated weight bytes skipped (%)")
    ax.set_ylabel("dppl (%)")
    ratio = _speed_ratio(report)
    if ratio:
        ax.set_title(f"decode {ratio[1] / ratio[0]:.2f}x at context {report['speed_context']}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)
