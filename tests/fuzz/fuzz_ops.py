"""Fuzz the ortsparse ops through ONNX Runtime: random one-node models (op_cases.py) must either
load and run, or fail with a clear error — never a signal, never a hang.

    python tests/fuzz/fuzz_ops.py --cases 100000 --seed 1         # the documented long run
    python tests/fuzz/fuzz_ops.py --cases 500 --seed 0 --json out.json

Cases run in a worker process (address space capped at FUZZ_MEMORY_MB, default 4096, so a runaway
allocation fails instead of taking the machine; 0 = no cap, needed under ASan); the parent restarts
it after a crash or a hang and records the case (seed, index) that caused it, so one run finds every
crasher in its range. Case i of seed s is reproducible alone: ``--replay s:i`` runs it in this process
and prints the model's node.
Outcomes: ok (ran; where the settings are exact the output matched the numpy reference), error_ours
(our op refused it, message names op and node), error_ort (ONNX Runtime refused it before our op,
e.g. an input type the op does not declare). Findings: unclear (an error naming neither, or an
out-of-memory message), wrong (ran, but an exact setting's output differs from the reference:
finite values beyond the tolerance, or NaN / Inf at other positions),
accepted_invalid (ran although the op must refuse it: a list-valued, NaN or wrongly typed
attribute), crash, hang. Each finding carries the case's tags (op_cases.Case.tags).
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


FINDINGS = ("unclear", "wrong", "accepted_invalid", "crash", "hang", "fuzzer_error")


def generate(seed: int, index: int, ops: list[str]):
    from op_cases import GENERATORS

    rng = case_rng(seed, index)
    return GENERATORS[ops[int(rng.integers(len(ops)))]](rng)


def compare_with_reference(case, output) -> str | None:
    """None if ``output`` is within the case's tolerance of its reference, else what differs."""
    import numpy as np

    expected, magnitude = case.reference()
    if output.shape != expected.shape:
        return f"output shape {list(output.shape)}, reference {list(expected.shape)}"
    for name, test in (("NaN", np.isnan), ("+Inf", np.isposinf), ("-Inf", np.isneginf)):
        differ = test(output) != test(expected)  # non-finite outputs: the same positions
        if differ.any():
            at = tuple(int(i) for i in np.argwhere(differ)[0])
            return (f"{int(differ.sum())} of {differ.size} outputs differ from the reference in being {name}; "
                    f"at {list(at)} got {output[at]!r}, expected {expected[at]!r}")
    finite = np.isfinite(expected)
    error = np.abs(output.astype(np.float64) - np.where(finite, expected, 0.0))
    allowed = case.tolerance * np.asarray(magnitude) + 1e-30
    bad = finite & ~(error <= allowed)
    if not bad.any():
        return None
    at = np.unravel_index(int(np.argmax(np.where(bad, np.nan_to_num(error, nan=np.inf) / allowed, -1.0))), bad.shape)
    return (f"{int(bad.sum())} of {bad.size} outputs differ from the numpy reference; at {list(at)} "
            f"got {output[at]!r}, expected {expected[at]!r} (allowed error {float(np.broadcast_to(allowed, bad.shape)[at]):.3g})")


def run_case(seed: int, index: int, ops: list[str], session_options, case=None) -> tuple[str, str]:
    import onnxruntime as ort

    case = case or generate(seed, index, ops)
    op_type, node_name = case.op_type, case.node_name
    try:
        session = ort.InferenceSession(case.model.SerializeToString(), session_options,
                                       providers=["CPUExecutionProvider"])
        outputs = session.run(None, case.feeds)
    except Exception as error:  # noqa: BLE001 - classifying every failure is the point
        text = str(error)
        if "bad_alloc" in text:  # an allocation the op should have bounded and refused clearly
            return "unclear", text
        if f"{op_type} node '{node_name}'" in text:
            return "error_ours", text
        if node_name in text or op_type in text or "[ONNXRuntimeError]" in text and (
                "type" in text.lower() or "shape" in text.lower() or "Invalid" in text):
            return "error_ort", text
        return "unclear", text
    for value in outputs:
        if value.dtype.name != "float32":
            return "unclear", f"output dtype {value.dtype}"
    if case.must_refuse:
        return "accepted_invalid", f"ran although {case.must_refuse}"
    if case.reference is not None:
        try:
            mismatch = compare_with_reference(case, outputs[0])
        except Exception as error:  # noqa: BLE001 - a bug of the fuzzer's reference, not of the op
            return "fuzzer_error", f"reference failed: {type(error).__name__}: {error}"
        if mismatch:
            return "wrong", mismatch
    return "ok", ""


def _worker_env() -> dict[str, str]:
    """The worker's environment: under ASan the address-space cap cannot apply (shadow memory), so
    ASan itself caps single allocations (FUZZ_MEMORY_MB) and returns null instead of aborting."""
    env = dict(os.environ)
    if "asan" in env.get("LD_PRELOAD", ""):
        megabytes = int(env.get("FUZZ_MEMORY_MB", "4096")) or 4096
        env["ASAN_OPTIONS"] = ":".join(filter(None, [env.get("ASAN_OPTIONS", ""), f"max_allocation_size_mb={megabytes}",
                                                     "allocator_may_return_null=1"]))
    return env


def limit_memory() -> None:
    """Caps the worker's address space (FUZZ_MEMORY_MB, default 4096; 0 or a sanitizer: none)."""
    import resource

    megabytes = int(os.environ.get("FUZZ_MEMORY_MB", "4096"))
    if megabytes <= 0 or "san" in os.environ.get("LD_PRELOAD", ""):  # ASan/TSan reserve terabytes
        return
    limit = megabytes << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def worker(seed: int, start: int, stop: int, ops: list[str], progress_path: str, result_path: str) -> None:
    import ortsparse

    limit_memory()
    options = ortsparse.session_options(intra_op_num_threads=int(os.environ.get("FUZZ_THREADS", "2")))
    options.log_severity_level = 4
    counts: Counter[str] = Counter()
    tags: Counter[str] = Counter()
    samples: list[dict] = []
    findings: list[dict] = []
    sampled: Counter[str] = Counter()

    def save() -> None:  # also every 25 cases: after a crash the parent keeps what ran before it
        staged = result_path + ".part"
        Path(staged).write_text(json.dumps({"counts": counts, "tags": tags, "samples": samples,
                                            "findings": findings}))
        os.replace(staged, result_path)

    with open(progress_path, "w") as progress:
        for index in range(start, stop):
            if (index - start) % 25 == 0:
                save()
            progress.seek(0)
            progress.write(f"{index:12d}\n")
            progress.flush()
            case = generate(seed, index, ops)
            outcome, text = run_case(seed, index, ops, options, case)
            counts[outcome] += 1
            tags.update(case.tags)
            if outcome == "ok" and case.reference is not None:
                tags["checked_against_reference"] += 1
            if outcome in FINDINGS and len(findings) < 500:
                findings.append({"seed": seed, "index": index, "kind": outcome, "op": case.op_type,
                                 "tags": sorted(case.tags), "message": text[:400]})
            elif outcome != "ok" and sampled[outcome] < 3:
                sampled[outcome] += 1
                samples.append({"seed": seed, "index": index, "outcome": outcome, "message": text[:300]})
    save()


def fuzz(cases: int, seed: int, ops: list[str], chunk: int = 5000, timeout: float = 600.0,
         say=print) -> dict:
    """Run cases [0, cases) of ``seed`` in worker processes; returns counts and findings."""
    import tempfile

    counts: Counter[str] = Counter()
    tags: Counter[str] = Counter()
    findings: list[dict] = []
    samples: list[dict] = []
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
                proc = subprocess.run(command, timeout=timeout, capture_output=True, text=True, env=_worker_env())
                status = proc.returncode
                stderr = proc.stderr
            except subprocess.TimeoutExpired as expired:
                status, stderr = "hang", (expired.stderr or b"").decode(errors="replace") if isinstance(
                    expired.stderr, bytes) else (expired.stderr or "")
            if os.path.exists(result):  # all of the chunk, or (after a crash) up to the last save
                data = json.loads(Path(result).read_text())
                counts.update(data["counts"])
                tags.update(data["tags"])
                samples.extend(data["samples"])
                findings.extend(data["findings"])
                for finding in data["findings"]:
                    say(f"{finding['kind']} at case {seed}:{finding['index']} {finding['tags']}: {finding['message'][:200]}")
            if status == 0 and os.path.exists(result):
                index = stop
            else:
                last = int(Path(progress).read_text().strip()) if os.path.exists(progress) else index
                kind = "hang" if status == "hang" else "crash"
                counts[kind] += 1
                case = generate(seed, last, ops)
                findings.append({"seed": seed, "index": last, "kind": kind, "status": str(status), "op": case.op_type,
                                 "tags": sorted(case.tags), "message": stderr[-800:]})
                say(f"{kind} at case {seed}:{last} (status {status}); replay with --replay {seed}:{last}")
                index = last + 1  # up to 24 cases between the last save and `last` go uncounted
            say(f"{index}/{cases} cases, {time.time() - started:.0f} s, {dict(counts)}")
    # "samples": the first messages of each refusal outcome; "findings": every finding (FINDINGS).
    return {"seed": seed, "cases": cases, "ops": ops, "counts": dict(counts), "tags": dict(tags),
            "findings": findings, "samples": samples, "seconds": round(time.time() - started, 1)}


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
        case = generate(seed, index, ops)
        print(case.model.graph.node[0], {k: (v.dtype, v.shape) for k, v in case.feeds.items()})
        print([(t.name, t.data_type, list(t.dims)) for t in case.model.graph.initializer])
        print("tags:", sorted(case.tags), "| must refuse:", case.must_refuse, "| reference:", case.reference is not None)
        print(run_case(seed, index, ops, ortsparse.session_options()))
        return 0
    summary = fuzz(args.cases, args.seed, ops, chunk=args.chunk, timeout=args.timeout)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: summary[k] for k in ("cases", "counts", "tags", "seconds")}))
    return 1 if summary["findings"] else 0


if __name__ == "__main__":
    sys.exit(main())
