"""The optional llama.cpp peer row: parsing llama-bench's JSON, and a one-line skip (never a
failed benchmark) when it cannot be built."""
import json

import pytest

from ortsparse.harness import llama_cpp

SAMPLE = [
    {"model_type": "llama ?B Q8_0", "n_threads": 1, "n_prompt": 0, "n_gen": 64, "n_depth": 1024, "avg_ts": 75.8,
     "stddev_ts": 0.4},
    {"model_type": "llama ?B Q8_0", "n_threads": 1, "n_prompt": 512, "n_gen": 0, "n_depth": 0, "avg_ts": 389.0,
     "stddev_ts": 2.0},
]


def test_bench_json_becomes_decode_and_prompt_rows():
    rows = llama_cpp.parse_bench_json(json.dumps(SAMPLE))
    assert rows[0] == {"kind": "decode", "tokens": 64, "depth": 1024, "threads": 1, "tokens_per_s": 75.8,
                       "stddev": 0.4, "type": "llama ?B Q8_0"}
    assert rows[1]["kind"] == "prompt" and rows[1]["tokens"] == 512 and rows[1]["tokens_per_s"] == 389.0
    for bad in ("not json", "[]", "{}"):
        with pytest.raises(llama_cpp.PeerUnavailable):
            llama_cpp.parse_bench_json(bad)


def test_missing_cmake_skips_the_row_with_a_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("ORTSPARSE_CACHE", str(tmp_path))
    monkeypatch.setattr(llama_cpp.shutil, "which", lambda name: None)
    report = llama_cpp.peer_report(tmp_path / "hf", log=lambda *_: None)
    assert report == {"skipped": "cmake not found (pip install cmake, or apt-get install cmake)"}


def test_a_failing_tool_is_a_one_line_reason(tmp_path):
    with pytest.raises(llama_cpp.PeerUnavailable, match=r"^step failed \(exit 3\): last line$"):
        llama_cpp._run(["sh", "-c", "echo first >&2; echo last line >&2; exit 3"], lambda *_: None, "step")


def test_archive_members_cannot_leave_the_folder(tmp_path):
    import io
    import tarfile

    archive = tmp_path / "evil.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        data = b"x"
        info = tarfile.TarInfo("../outside.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    target = tmp_path / "unpacked"
    target.mkdir()
    with pytest.raises(llama_cpp.PeerUnavailable, match="evil.tar.gz"):
        llama_cpp._safe_extract(archive, target)
    assert not (tmp_path / "outside.txt").exists()


def test_the_build_asks_for_the_extensions_the_cpu_reports_not_native():
    cpuinfo = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma f16c avx512f avx512bw avx512_vnni\n"
    flags = llama_cpp.isa_flags(cpuinfo)
    assert flags[0] == "-DGGML_NATIVE=OFF"
    assert set(flags[1:]) == {"-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
                              "-DGGML_AVX512=ON", "-DGGML_AVX512_BW=ON", "-DGGML_AVX512_VNNI=ON"}
    assert llama_cpp.isa_flags("processor\t: 0\n") == ["-DGGML_NATIVE=OFF"]
