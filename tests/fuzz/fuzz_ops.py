"""Fuzz the ortsparse ops through ONNX Runtime: random one-node models (op_cases.py) must either
load and run, or fail with a clear error — never a signal, never a hang.

    python tests/fuzz/fuzz_ops.py --cases 100000 --seed 1         # the documented long run
    python tests/fuzz/fuzz_ops.py --cases 500 --seed 0 --json out.json

Cases run in a worker process; the parent restarts it after a crash or a hang and records the case
(seed, index) that caused it, so one run finds every crasher in its range. Case i of seed s is
reproducible alone: ``--replay s:i`` runs it in this process and prints the model's node.
Outcomes: ok (ran), error_ours (our op refused it, message names op and node), error_ort (ONNX
Runtime refused it before our op, e.g. an input type the op does not declare), unclear (an error
naming neither: counted as a finding), crash, hang.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def case_rng(seed: int, index: int):
    import numpy as np

    return np.random.default_rng([seed, index])


def generate(seed: int, index: int, ops: list[str]):
    from op_cases import GENERATORS

    rng = case_rng(seed, index)
    return GENERATORS[ops[int(rng.integers(len(ops)))]](rng)


def run_case(seed: int, index: int, ops: list[str], session_options) -> tuple[str, str]:
    import onnxruntime as ort

    op_type, node_name, model, feeds = generate(seed, index, ops)
    try:
        session = ort.InferenceSession(model.SerializeToString(), session_options, providers=["CPUExecutionProvider"])
        outputs = session.run(None, feeds)
    except Exception as error:  # noqa: BLE001 - classifying every failure is the point
        text = str(error)
        if f"{op_type} node '{node_name}'" in text:
            return "error_ours", text
        if node_name in text or op_type in text or "[ONNXRuntimeError]" in text and (
                "type" in text.lower() or "shape" in text.lower() or "Invalid" in text):
            return "error_ort", text
        return "unclear", text
    for value in outputs:
        if value.dtype.name != "float32":
            return "unclear", f"output dtype {value.dtype}"
    return "ok", ""


def worker(seed: int, start: int, stop: int, ops: list[str], progress_path: str, result_path: str) -> None:
    import ortsparse

    options = ortsparse.session_options(intra_op_num_threads=int(os.environ.get("FUZZ_THREADS", "2")))
    options.log_severity_level = 4
    counts: Counter[str] = Counter()
    unclear: list[dict] = []
    samples: Counter[str] = Counter()
    with open(progress_path, "w") as progress:
        for index in range(start, stop):
            progress.seek(0)
            progress.write(f"{index:12d}\n")
            progress.flush()
            outcome, text = run_case(seed, index, ops, options)
            counts[outcome] += 1
            if outcome != "ok" and samples[outcome] < 3:
                samples[outcome] += 1
                unclear.append({"seed": seed, "index": index, "outcome": outcome, "message": text[:300]})
            elif outcome == "unclear" and len(unclear) < 20:
                unclear.append({"seed": seed, "index": index, "message": text[:400]})
    Path(result_path).write_text(json.dumps({"counts": counts, "unclear": unclear}))


def fuzz(cases: int, seed: int, ops: list[str], chunk: int = 5000, timeout: float = 600.0,
         say=print) -> dict:
    """Run cases [0, cases) of ``seed`` in worker processes; returns counts and findings."""
    import tempfile

    counts: Counter[str] = Counter()
    findings: list[dict] = []
    unclear: list[dict] = []
    index, started = 0, time.time()
    with tempfile.TemporaryDirectory() as tmp:
        progress, result = os.path.join(tmp, "progress"), os.path.join(tmp, "result")
        while index < cases:
            stop = min(cases, index + chunk)
            for path in (progress, result):
                if os.path.exists(path):
                    os.remove(path)
            command = [sys.executable, __file__, "--worker", str(seed), str(index), str(stop), ",".join(ops),
                       progress, result]
            try:
                proc = subprocess.run(command, timeout=timeout, capture_output=True, text=True)
                status = proc.returncode
                stderr = proc.stderr
            except subprocess.TimeoutExpired as expired:
                status, stderr = "hang", (expired.stderr or b"").decode(errors="replace") if isinstance(
                    expired.stderr, bytes) else (expired.stderr or "")
            if status == 0 and os.path.exists(result):
                data = json.loads(Path(result).read_text())
                counts.update(data["counts"])
                unclear.extend(data["unclear"])
                index = stop
            else:
                last = int(Path(progress).read_text().strip()) if os.path.exists(progress) else index
                kind = "hang" if status == "hang" else "crash"
                counts[kind] += 1
                findings.append({"seed": seed, "index": last, "kind": kind, "status": str(status),
                                 "stderr_tail": stderr[-800:]})
                say(f"{kind} at case {seed}:{last} (status {status}); replay with --replay {seed}:{last}")
                index = last + 1  # the cases before `last` in this chunk ran fine; their counts are lost
            say(f"{index}/{cases} cases, {time.time() - started:.0f} s, {dict(counts)}")
    # "samples": the first messages of each non-ok outcome (unclear ones are findings to read).
    return {"seed": seed, "cases": cases, "ops": ops, "counts": dict(counts), "findings": findings,
            "samples": unclear, "seconds": round(time.time() - started, 1)}


def available_ops() -> list[str]:
    from op_cases import GENERATORS

    import ortsparse

    registered = ortsparse.registered_ops() if hasattr(ortsparse, "registered_ops") else None
    return [op for op in GENERATORS if registered is None or op in registered]


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--worker":
        seed, start, stop, ops, progress, result = sys.argv[2:8]
        worker(int(seed), int(start), int(stop), ops.split(","), progress, result)
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ops", default="", help="comma-separated op types (default: all with a generator)")
    parser.add_argument("--chunk", type=int, default=5000, help="cases per worker process")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per chunk before it counts as a hang")
    parser.add_argument("--json", help="write the summary here")
    parser.add_argument("--replay", metavar="SEED:INDEX", help="run one case in this process and print it")
    args = parser.parse_args(argv)
    ops = [o for o in args.ops.split(",") if o] or available_ops()
    if args.replay:
        import ortsparse

        seed, index = (int(v) for v in args.replay.split(":"))
        op_type, name, model, feeds = generate(seed, index, ops)
        print(model.graph.node[0], {k: (v.dtype, v.shape) for k, v in feeds.items()})
        print([(t.name, t.data_type, list(t.dims)) for t in model.graph.initializer])
        print(run_case(seed, index, ops, ortsparse.session_options()))
        return 0
    summary = fuzz(args.cases, args.seed, ops, chunk=args.chunk, timeout=args.timeout)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: summary[k] for k in ("cases", "counts", "seconds")}))
    bad = summary["findings"] or summary["counts"].get("unclear", 0)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
