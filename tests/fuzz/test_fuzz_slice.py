"""CI's bounded slice of the op fuzzer (tests/fuzz/fuzz_ops.py; the long run is documented in
README's reliability section): every case loads and runs or fails with a clear error."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fuzz_ops  # noqa: E402


def test_fuzz_slice_has_no_crash_hang_or_unclear_error():
    summary = fuzz_ops.fuzz(cases=3000, seed=20261126, ops=fuzz_ops.available_ops(), chunk=3000, timeout=300,
                            say=lambda _: None)
    counts = summary["counts"]
    assert not summary["findings"], summary["findings"]
    assert counts.get("unclear", 0) == 0, [u for u in summary["samples"] if u["outcome"] == "unclear"]
    # The generator must exercise both sides: valid models that run and invalid ones we refuse.
    assert counts.get("ok", 0) > 300 and counts.get("error_ours", 0) > 300, counts
