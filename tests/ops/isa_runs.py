"""Running a test file again under each ISA's kernels: ORTSPARSE_ISA is read once per process, so a
child pytest process per ISA runs the file's other tests with it set."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ISAS = ("scalar", "avx2", "avx512")


def run_file_under_isa(path: str, isa: str, deselect: str = "every_isa") -> None:
    """Runs the tests of ``path`` not matching ``deselect`` with ORTSPARSE_ISA=isa; skips inside
    such a run and where the CPU lacks the ISA; fails with the child's output."""
    if os.environ.get("ORTSPARSE_ISA"):
        pytest.skip("already inside an ISA run")
    if isa == "avx512" and "avx512f" not in open("/proc/cpuinfo").read():
        pytest.skip("no AVX-512 on this CPU")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", path, "-k",
                           f"not {deselect}"], env={**os.environ, "ORTSPARSE_ISA": isa}, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:]
