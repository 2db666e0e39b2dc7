"""The build without x86 SIMD kernels (aarch64 and other targets, or a compiler without the flags):
a configure forced to another processor names no x86 source or flag, and a library built with
ORTSPARSE_X86_KERNELS=OFF on this machine loads in ONNX Runtime, computes with the scalar kernels
and refuses ORTSPARSE_ISA=avx2 (its CPU features report nothing x86)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
X86_FLAGS = ("-mavx", "-mfma", "-mf16c", "-mpopcnt")
# A cross configure (CMake keeps CMAKE_SYSTEM_PROCESSOR only when CMAKE_SYSTEM_NAME is given too).
AARCH64 = ("-DCMAKE_SYSTEM_NAME=Linux", "-DCMAKE_SYSTEM_PROCESSOR=aarch64")



def _cmake() -> str:
    local = Path(sys.prefix) / "bin" / "cmake"  # the test extra's cmake
    return str(local) if local.exists() else shutil.which("cmake") or "cmake"


def _configure(build: Path, *options: str) -> subprocess.CompletedProcess:
    return subprocess.run([_cmake(), "-S", str(ROOT), "-B", str(build), "-DORTSPARSE_PYTHON_MODULE=OFF",
                           "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON", *options], capture_output=True, text=True, timeout=300)


def _compile_commands(build: Path) -> list[dict]:
    return json.loads((build / "compile_commands.json").read_text())


def test_a_configure_for_aarch64_names_no_x86_source_or_flag(tmp_path):
    done = _configure(tmp_path, *AARCH64)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "target aarch64, x86 SIMD kernels OFF" in done.stdout
    commands = _compile_commands(tmp_path)
    assert any(c["file"].endswith("matmul_kernels_scalar.cc") for c in commands)
    for command in commands:
        assert "_avx" not in Path(command["file"]).name and "popcount_popcnt" not in command["file"], command["file"]
        assert not any(flag in command["command"] for flag in X86_FLAGS), command["command"]
        assert "-DORTSPARSE_X86_KERNELS=0" in command["command"] or "engine" not in command["output"]


def test_x86_kernels_cannot_be_asked_for_on_another_processor(tmp_path):
    done = _configure(tmp_path, *AARCH64, "-DORTSPARSE_X86_KERNELS=ON")
    assert done.returncode != 0
    assert "ORTSPARSE_X86_KERNELS=ON but the target processor is aarch64" in done.stdout + done.stderr


def test_this_machine_configures_the_x86_kernels_by_default(tmp_path):
    if os.uname().machine not in ("x86_64", "AMD64"):
        pytest.skip("not an x86 machine")
    done = _configure(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    names = {Path(c["file"]).name for c in _compile_commands(tmp_path)}
    assert {"matmul_kernels_avx2.cc", "matmul_kernels_avx512.cc", "popcount_vpopcntdq.cc"} <= names


_RUN_ONE_NODE = r"""
import sys
import numpy as np
import onnxruntime as ort
sys.path.insert(0, sys.argv[1])
from tests.ops.onnx_builders import kwta_model
rng = np.random.default_rng(0)
w = rng.standard_normal((37, 21)).astype(np.float32)
x = rng.standard_normal((3, 37)).astype(np.float32)
options = ort.SessionOptions()
try:  # an ISA the library cannot run is refused when the library registers its ops
    options.register_custom_ops_library(sys.argv[2])
    session = ort.InferenceSession(kwta_model(w, k_frac=1.0).SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
except Exception as error:
    print("REFUSED", str(error).splitlines()[0][-200:])
    sys.exit(0)
(y,) = session.run(None, {"X": x})
print("MAXERR", float(np.abs(y - x @ w).max()))
"""


def test_a_library_built_without_x86_kernels_runs_scalar_and_refuses_avx2(tmp_path):
    """A real build (unoptimised, to keep it short) of the op library without the x86 kernels."""
    build = tmp_path / "build"
    done = _configure(build, "-DORTSPARSE_X86_KERNELS=OFF", "-DCMAKE_BUILD_TYPE=Debug",
                      "-DCMAKE_CXX_FLAGS_DEBUG=-O0")
    assert done.returncode == 0, done.stdout + done.stderr
    built = subprocess.run([_cmake(), "--build", str(build), "--target", "ortsparse_ops", "-j", "2"],
                           capture_output=True, text=True, timeout=1200)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    library = build / "libortsparse_ops.so"
    env = {k: v for k, v in os.environ.items() if k != "ORTSPARSE_ISA"}

    def run(**extra: str) -> str:
        out = subprocess.run([sys.executable, "-c", _RUN_ONE_NODE, str(ROOT), str(library)],
                             env={**env, **extra}, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.strip()

    scalar = run()
    assert scalar.startswith("MAXERR"), scalar
    assert float(scalar.split()[1]) < 1e-4
    refused = run(ORTSPARSE_ISA="avx2")
    assert refused.startswith("REFUSED") and "ORTSPARSE_ISA=avx2 but this CPU/OS does not support it" in refused
