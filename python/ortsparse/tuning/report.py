"""What ``tune`` tells the user: the summary it prints, the markdown report and the plot (drawn when
matplotlib is installed — the ``plot`` extra —, else skipped with a note: the model and the other
reports are written either way)."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..benchmarking import plot_skipped
from .results import TuneResult


def _pct(value: float) -> str:
    return f"{100 * value:+.2f}%"


def summary(result: TuneResult) -> str:
    """The lines tune prints when it wrote; the last one is the verdict (``last_line``)."""
    held, choice, inputs, speed = result.held_out, result.choice, result.inputs, result.speed
    dense = choice.allocation.get("dense_on_ours", [])
    gated = sum(1 for s in choice.sparsity.values() if s > 0)
    lines = [f"tune: wrote {inputs.output}",
             f"  layers gated: {gated}; gated weight bytes skipped (planned): {100 * choice.point.skipped:.1f}%"
             + (f"; dense on our kernel: {', '.join(dense)}" if dense else ""),
             f"  calibration: dppl {_pct(choice.calibration_dppl)}, bound {_pct(choice.bound)} on "
             f"{result.windows.calibration} windows",
             f"  held-out: dppl {_pct(held.dppl)} (another part of the text: {_pct(held.dppl_low)} .. "
             f"{_pct(held.dppl_high)}; budget {100 * inputs.max_dppl:.1f}%), top-1 agreement "
             f"{held.top1_agreement:.3f} on {held.windows} x {held.window_len} tokens of {held.parts} held-out parts",
             f"  attention: {result.staged.attention_note}"]
    if result.answers is not None:
        lines.append(f"  long context: {_answers_line(result.answers)}")
    if result.staged.max_gated_rows:
        lines.append(f"  calls of more than {result.staged.max_gated_rows} rows (prompts) run dense in the written model")
    rates = speed.tokens_per_s() if speed is not None else None
    if rates:
        a, b = rates
        worst = (speed.decode.get("tuned") or {}).get("speedup")
        lines.append(f"  decode (real loop, context {speed.context}, {speed.runner}): "
                     f"{a:.1f} -> {b:.1f} tok/s (median {b / a:.2f}x"
                     + (f", worst of {speed.decode['tuned'].get('rounds')} rounds {worst:.2f}x)" if worst else ")"))
    request = (speed.request or {}).get("tuned") if speed is not None else None
    if request:
        base = speed.request["input"]
        lines.append(f"  whole request ({request['request']} tokens, prompt + answer): {base['total_s']:.2f} -> "
                     f"{request['total_s']:.2f} s (worst round {request['speedup']:.2f}x; time to first token "
                     f"{base['ttft_s']:.2f} -> {request['ttft_s']:.2f} s)")
    elif speed is not None and speed.error:
        lines.append(f"  decode: {speed.error}")
    if result.plot:
        lines.append(f"  {result.plot}")
    lines.append(f"  {result.seconds:.0f} s: {stage_times(result)}")
    lines.append(result.last_line)
    return "\n".join(lines)


def _answers_line(answers) -> str:
    summary = answers.summary
    interval = ("" if summary["dppl_low"] is None else
                f" ({_pct(summary['dppl_low'])} .. {_pct(summary['dppl_high'])}, "
                f"{summary['confidence']:.0%} over windows)")
    return (f"answer steps after {answers.prefix}-token prompts: dppl {_pct(answers.dppl)}{interval}, top-1 agreement "
            f"{summary['top1_agreement']:.3f} (worst window {summary['top1_worst_window']:.3f}) on "
            f"{summary['windows']} x {answers.answer} answer tokens of the held-out parts ({answers.note})")


def stage_times(result: TuneResult) -> str:
    """The seconds each stage took, in the order they ran."""
    return ", ".join(f"{stage} {seconds:.1f} s" for stage, seconds in result.stage_seconds.items())


def markdown(result: TuneResult) -> str:
    held, choice, inputs, windows, speed = result.held_out, result.choice, result.inputs, result.windows, result.speed
    lines = [f"# ortsparse tune: {inputs.source.path.name}", ""]
    if inputs.command:
        lines += [f"Command: `{inputs.command}`  "]
    against = f" vs {inputs.reference.path.name}" if inputs.reference is not None else ""
    lines += [f"Text: {inputs.tokens.size} tokens; {windows.calibration} calibration + "
              f"{windows.check} check windows of {windows.window_len} ({windows.plan.note}); "
              f"budget {100 * inputs.max_dppl:.1f}% dppl{against} on the check windows", "",
              f"Split: {windows.plan.split}.", "",
              "| | dppl (held-out) | top-1 agreement | gated bytes skipped | decode tok/s |", "|---|---|---|---|---|"]
    base, tuned = (speed.tokens_per_s() if speed is not None else None) or (None, None)
    own = "— | — |" if inputs.reference is not None else "0 | 1 |"  # vs a reference the input's own loss is not measured
    lines.append(f"| input | {own} 0 | {base:.1f} |" if base else f"| input | {own} 0 | — |")
    lines.append(f"| tuned | {_pct(held.dppl)} ({_pct(held.dppl_low)} .. {_pct(held.dppl_high)}) | "
                 f"{held.top1_agreement:.3f} | {100 * choice.point.skipped:.1f}% | "
                 + (f"{tuned:.1f} ({tuned / base:.2f}x) |" if base and tuned else "— |"))
    lines += ["", f"Held-out: {held.measured_on}, on {held.windows} check windows of {held.parts} held-out parts; "
                  f"the interval is {held.interval} (between-part sd {held.part_sd:.4f} nats)."]
    if base and tuned:
        lines.append(f"Decode: real loop at context {speed.context}, {speed.runner}, models alternating.")
    lines += ["", f"Attention: {result.staged.attention_note}."]
    if result.answers is not None:
        lines.append(f"Long context, {_answers_line(result.answers)}; MODEL (or the reference) and the written model "
                     f"each read every prompt in one call ({', '.join(sorted(set(result.answers.runners.values())))}).")
    lines += ["", "## What gating saves here", ""] + _layer_speed_lines(result)
    selection = choice.selection
    lines += ["", "## How far from the cliff", "",
              f"Choice rule: {inputs.selection_rule} (z = {selection.z}, sqrt(1/n + 1/m) = "
              f"{selection.margin_factor:.3f}, sqrt(1/c + 1/h) = {selection.part_factor:.3f} for "
              f"{selection.calibration_parts:.1f} calibration and {selection.check_parts:.1f} check parts).", "",
              "| gated bytes skipped | calibration dppl | monotone fit (5-95% bootstrap) | bound | held-out dppl |",
              "|---|---|---|---|---|"]
    held_by_skip = {round(h["skipped_fraction"], 6): h for h in result.probe_check.curve}
    for i, point in enumerate(choice.curve()):
        held_point = held_by_skip.get(round(point["skipped_fraction"], 6))
        mark = " **(chosen)**" if i == choice.index else ""
        lines.append(f"| {100 * point['skipped_fraction']:.1f}%{mark} | {_pct(point['dppl'])} | {_pct(point['trend'])} "
                     f"({_pct(point['band'][0])} .. {_pct(point['band'][1])}) | {_pct(point['bound'])} | "
                     + (f"{_pct(held_point['dppl'])} ({_pct(held_point['low'])} .. {_pct(held_point['high'])})"
                        if held_point else "—") + " |")
    lines += ["", "Held-out dppl in this table: the probe graph (the op's threshold rule in plain ONNX) on the check "
                  "windows, with the range one more part of the text is expected in; the chosen row's model as "
                  "written is in the first table."]
    if result.plot:
        lines += ["", result.plot]
    lines += ["", f"Time per stage: {stage_times(result)}."]
    lines += ["", f"Exit status {result.exit_status}: {result.last_line}"]
    return "\n".join(lines) + "\n"


def _layer_speed_lines(result: TuneResult) -> list[str]:
    if result.layer_speed is None:
        return [f"Layer speed {result.layer_speed_report()}."]
    lines = ["Per speed class (the units sharing ops and shapes), microseconds per unit and decode row, weights "
             "from memory (every class in one rotation), this machine at the run's threads; a unit is gated only where gating saves time:", "",
             "| class | units | input | ours, keep 1 / 0.75 / 0.5 / 0.25 | gating pays from |", "|---|---|---|---|---|"]
    for speed in result.layer_speed.records:
        if speed.input_us is None:
            lines.append(f"| {speed.signature} | {speed.units} | — | {speed.note} | byte model |")
            continue
        ours = " / ".join(f"{speed.ours_us[keep]:.1f}" if keep in speed.ours_us else "—" for keep in (1.0, 0.75, 0.5, 0.25))
        even = speed.break_even
        lines.append(f"| {speed.signature} | {speed.units} | {speed.input_us:.1f} | {ours} | "
                     + ("never" if even is None else f"{100 * even:.0f}%") + " |")
    return lines


def write_plot(result: TuneResult, write: Callable[[Callable[[Path], None]], None]) -> str | None:
    """Draws the plot through ``write(draw)`` (``draw(path)`` saves the PNG); without matplotlib
    nothing is written and the note returned says so."""
    note = plot_skipped()
    if note is None:
        write(lambda path: _draw(result, path))
    return note


def _draw(result: TuneResult, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.8))
    curve = result.choice.curve()
    x = [100 * p["skipped_fraction"] for p in curve]
    ax.fill_between(x, [100 * p["band"][0] for p in curve], [100 * p["band"][1] for p in curve], color="C0",
                    alpha=0.2, label="calibration: monotone fit, 5-95% bootstrap over windows")
    ax.plot(x, [100 * p["trend"] for p in curve], color="C0")
    ax.scatter(x, [100 * p["dppl"] for p in curve], color="C0", s=14, label="calibration: measured")
    ax.plot(x, [100 * p["bound"] for p in curve], color="C1", ls=":", label="bound the choice must meet")
    held = result.probe_check.curve
    if held:
        hx = [100 * h["skipped_fraction"] for h in held]
        hy = [100 * h["dppl"] for h in held]
        ax.errorbar(hx, hy, yerr=[[100 * (h["dppl"] - h["low"]) for h in held],
                                  [100 * (h["high"] - h["dppl"]) for h in held]],
                    fmt="s", color="C2", ms=4, capsize=3, label="held-out (probe graph): range of another part")
    ax.scatter([100 * result.choice.point.skipped], [100 * result.held_out.dppl], marker="*", s=180,
               c="black", zorder=5, label="chosen, as written, held-out")
    ax.axhline(100 * result.inputs.max_dppl, color="grey", ls="--", lw=0.8, label="budget")
    if result.inputs.limit != result.inputs.max_dppl:
        ax.axhline(100 * result.inputs.limit, color="C1", ls="--", lw=0.8, label="--margin x budget")
    ax.set_xlabel("gated weight bytes skipped (%)")
    ax.set_ylabel("dppl (%)")
    rates = result.speed.tokens_per_s() if result.speed is not None else None
    if rates:
        ax.set_title(f"decode {rates[1] / rates[0]:.2f}x at context {result.speed.context}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)
