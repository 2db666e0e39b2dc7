"""A model `ortsparse tune` wrote, measured on windows of its text that tune used neither to
calibrate nor to check (issue 26's target: within 2.5% there too).

usage: python bench/tune_unused_windows.py TEXT WRITTEN_DECODER REFERENCE_DECODER N M [--count 24]
N, M: the calibration and check window counts tune printed ("-> N calibration and M check windows
of 512"); the windows are recomputed as ortsparse.tuning.windows cut them (no long context).
"""
import argparse
import math

import numpy as np

from ortsparse.measure.perplexity import perplexity
from ortsparse.measure.text import text_tokens
from ortsparse.tuning.tune import every_row_gated
from ortsparse.tuning.windows import WINDOW_LEN, spread_indices

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("text")
parser.add_argument("written")
parser.add_argument("reference")
parser.add_argument("n", type=int)
parser.add_argument("m", type=int)
parser.add_argument("--count", type=int, default=24)
args = parser.parse_args()
tokens = text_tokens(args.text, args.reference)
count = tokens.size // WINDOW_LEN
cut = tokens[:count * WINDOW_LEN].reshape(count, WINDOW_LEN)
is_check = np.arange(count) % 3 == 1
calibration, check = np.flatnonzero(~is_check), np.flatnonzero(is_check)
used = set(calibration[spread_indices(len(calibration), args.n)]) | set(check[spread_indices(len(check), args.m)])
unused = [i for i in range(count) if i not in used]
pick = [unused[j] for j in spread_indices(len(unused), min(args.count, len(unused)))]
windows = cut[pick]
print(f"{count} windows, {len(used)} used by tune, measuring {len(pick)} unused: {pick}")
reference = perplexity(args.reference, windows.reshape(-1), len(pick), WINDOW_LEN)
written = perplexity(every_row_gated(args.written), windows.reshape(-1), len(pick), WINDOW_LEN)
loss = written["window_nll"] - reference["window_nll"]
error = loss.std(ddof=1) / math.sqrt(loss.size)
print(f"dppl {math.expm1(loss.mean()):+.2%} (-/+1.645 s.e.: {math.expm1(loss.mean() - 1.645 * error):+.2%} .. "
      f"{math.expm1(loss.mean() + 1.645 * error):+.2%}), top-1 {np.mean(written['predictions'] == reference['predictions']):.3f}")
