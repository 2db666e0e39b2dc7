"""PopcountGroupQueryAttention on random inputs (no model needed): median microseconds per call of a
decode step or a prompt, 1 thread, for an A/B of two builds. Run it once with each checkout's Python
(each imports its own ortsparse) and compare the medians; alternate the runs on a loaded machine.

    python bench/bench_gqa_synthetic.py --runs 200 --cases exact exact_window256
    /path/to/other/.venv/bin/python bench/bench_gqa_synthetic.py --runs 200 --cases exact exact_window256

Cases (SmolLM2's attention shape: 9 query heads, 3 KV heads, D = 64; 4096 keys): exact (select=none,
decode), exact_window256 (select=none, local_window_size=256, decode), pages (the form's defaults,
decode), prompt512_exact (a 512-row first prompt, select=none).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.ops import gqa_graphs as G  # noqa: E402

H, HKV, D, KEYS = 9, 3, 64, 4096
CASES = {"exact": (-1, {"select": "none"}, 1), "exact_window256": (256, {"select": "none"}, 1),
         "pages": (-1, {}, 1), "prompt512_exact": (-1, {"select": "none"}, 512)}


def time_case(name: str, runs: int) -> float:
    window, attrs, rows = CASES[name]
    session = G.session(G.Gqa(num_heads=H, kv_num_heads=HKV, head_size=D, local_window=window), ours=True,
                        threads=1, **attrs)
    rng = np.random.default_rng(0)
    past = 0 if rows > 1 else KEYS - 1
    feeds = {"query": rng.standard_normal((1, rows, H * D), dtype=np.float32),
             "key": rng.standard_normal((1, rows, HKV * D), dtype=np.float32),
             "value": rng.standard_normal((1, rows, HKV * D), dtype=np.float32),
             "past_key": rng.standard_normal((1, HKV, past, D), dtype=np.float32),
             "past_value": rng.standard_normal((1, HKV, past, D), dtype=np.float32),
             "seqlens_k": np.array([rows + past - 1], np.int32), "total_sequence_length": np.array([rows + past], np.int32)}
    for _ in range(5):
        session.run(None, feeds)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=sorted(CASES))
    args = parser.parse_args()
    print({name: round(time_case(name, args.runs), 1) for name in args.cases})


if __name__ == "__main__":
    main()
