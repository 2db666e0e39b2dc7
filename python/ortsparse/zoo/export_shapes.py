"""Shape models: onnxruntime-genai int8 and int4 CPU folders of published LLM configurations
(0.5B-3B parameters) with RANDOM weights, for speed measurements only.

No trained model of these sizes is reachable offline, but a decode step's cost depends on the
graph's shapes (layers, widths, heads, vocabulary), not on the weights' values. So each published
configuration is written into transformers' config class (:data:`SHAPES`: the values of its
released config.json, stated with where they come from), the model is initialised with a fixed
seed, saved as an HF folder in a temporary folder, and handed to onnxruntime-genai's builder
(``-p int8`` / ``-p int4 -e cpu --extra_options accuracy_level=4``, as the ``genai`` entry's
quantized folders). Only the builder's folders are kept. Their text is meaningless: never use them
for a quality figure.

- Weights: every matrix (embeddings, projections) N(0, 0.02²) — the published configs'
  ``initializer_range``, so activations have the magnitude of an initialised model of that size;
  norm scales and biases as the transformers class initialises them (1 / 0, Gemma's 0 = scale 1).
  The output rows of the EOS ids are zero (the tied embedding's rows), so their logit is 0 while
  the maximum of the others is positive: greedy decoding never stops early.
- Tokenizer: no tokenizer of these models is reachable offline, so each folder gets a generated
  byte-level one of the model's vocabulary size (:func:`save_byte_tokenizer`): ids of the 256
  bytes, the config's special ids as special tokens, every other id a placeholder that encoding
  never produces. Any UTF-8 text encodes (one token per byte) and any id decodes, so ``ortsparse
  bench --text`` and the Generator run; the ids say nothing about the real tokenizer's.

Needs the ``models`` extra (torch, transformers, onnxruntime-genai).
"""
from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .cache import ModelBuildError
from .export_genai import builder_options, greedy_ids, run_builder, write_folder

Log = Callable[[str], None]

PRECISIONS = ("int8", "int4")
SEED = 0
INIT_STD = 0.02  # initializer_range of every config below
CHECK_TOKENS = 16
CHECK_PROMPT = "The capital of France is"


@dataclasses.dataclass(frozen=True)
class Shape:
    """A published configuration: ``config`` holds the values of its config.json that fix the graph
    (passed as they are to ``transformers.<config_class>``); ``published_parameters`` is the model
    card's total."""

    title: str
    source: str
    config_class: str
    architecture: str
    config: Mapping[str, Any]
    published_parameters: float


SHAPES: dict[str, Shape] = {
    "qwen2.5-0.5b": Shape(
        "Qwen2.5-0.5B", "config.json of Qwen/Qwen2.5-0.5B; model card: 0.49B parameters (0.36B non-embedding)",
        "Qwen2Config", "Qwen2ForCausalLM",
        {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
         "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
         "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": True, "use_sliding_window": False,
         "sliding_window": 32768, "max_window_layers": 24, "bos_token_id": 151643, "eos_token_id": 151643,
         "initializer_range": 0.02},
        0.49e9),
    "llama3.2-1b": Shape(
        "Llama-3.2-1B", "config.json of meta-llama/Llama-3.2-1B; model card: 1.23B parameters",
        "LlamaConfig", "LlamaForCausalLM",
        {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
         "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256, "max_position_embeddings": 131072,
         "rope_theta": 500000.0,
         "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                          "original_max_position_embeddings": 8192, "rope_type": "llama3"},
         "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": True, "attention_bias": False,
         "mlp_bias": False, "bos_token_id": 128000, "eos_token_id": 128001, "initializer_range": 0.02},
        1.23e9),
    "qwen2.5-1.5b": Shape(
        "Qwen2.5-1.5B", "config.json of Qwen/Qwen2.5-1.5B; model card: 1.54B parameters (1.31B non-embedding)",
        "Qwen2Config", "Qwen2ForCausalLM",
        {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
         "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 131072, "rope_theta": 1000000.0,
         "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": True, "use_sliding_window": False,
         "sliding_window": 131072, "max_window_layers": 28, "bos_token_id": 151643, "eos_token_id": 151643,
         "initializer_range": 0.02},
        1.54e9),
    "gemma3-1b": Shape(
        "Gemma-3-1B", "config.json of google/gemma-3-1b-pt; model card: 1B parameters (999,885,952)",
        "Gemma3TextConfig", "Gemma3ForCausalLM",
        {"hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4,
         "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 262144, "max_position_embeddings": 32768,
         "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "sliding_window": 512,
         "sliding_window_pattern": 6, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-6,
         "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True, "attention_bias": False,
         "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0, "initializer_range": 0.02},
        1.0e9),
}


def head_dim(config: Mapping[str, Any]) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def parameter_count(shape: Shape) -> int:
    """Parameters of the configuration, from its sizes (a tied output matrix counted once): what
    the transformers model of ``shape`` holds."""
    c = shape.config
    d, layers, vocab, size = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"], head_dim(c)
    q, kv = c["num_attention_heads"] * size, c["num_key_value_heads"] * size
    attention = d * q + 2 * d * kv + q * d
    if shape.architecture == "Qwen2ForCausalLM":  # q/k/v biases, hard-wired in Qwen2
        attention += q + 2 * kv
    elif c.get("attention_bias"):
        attention += q + 2 * kv + d
    mlp = 3 * d * c["intermediate_size"]
    if c.get("mlp_bias"):
        mlp += 2 * c["intermediate_size"] + d
    norms = 4 * d + 2 * size if shape.architecture == "Gemma3ForCausalLM" else 2 * d  # Gemma: +pre/post FF, q/k norms
    embeddings = vocab * d * (1 if c.get("tie_word_embeddings", True) else 2)
    return embeddings + layers * (attention + mlp + norms) + d


def special_ids(config: Mapping[str, Any]) -> dict[int, str]:
    """The config's special ids and their tokens' names: ``<|eos|>``, a role's further ids
    ``<|eos_1|>`` ...; an id with several roles is named by the first."""
    named: dict[int, str] = {}
    for role in ("bos", "eos", "pad"):
        ids = config.get(f"{role}_token_id")
        for index, token in enumerate(ids if isinstance(ids, list) else [] if ids is None else [ids]):
            named.setdefault(int(token), f"<|{role}{f'_{index}' if index else ''}|>")
    return named


def save_byte_tokenizer(dest: Path, config: Mapping[str, Any]) -> None:
    """A byte-level tokenizer of the config's vocabulary size in ``dest`` (tokenizer.json,
    tokenizer_config.json): the config's special ids as special tokens, the 256 bytes at the lowest
    other ids, every remaining id a placeholder ``<unused_N>`` (a BPE without merges never produces
    one). Encodes any text, one token per byte; decodes any id."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers  # the models extra
    from transformers import PreTrainedTokenizerFast  # the models extra

    vocab_size = config["vocab_size"]
    specials = special_ids(config)
    if len(specials) + 256 > vocab_size:
        raise ModelBuildError(f"a vocabulary of {vocab_size} has no room for 256 bytes and {len(specials)} special ids")
    free = (i for i in range(vocab_size) if i not in specials)
    vocab = {char: next(free) for char in sorted(pre_tokenizers.ByteLevel.alphabet())}
    vocab.update({name: i for i, name in specials.items()})
    vocab.update({f"<unused_{i}>": i for i in free})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(name, special=True) for name in dict.fromkeys(specials.values())])
    roles = {role: specials[int(ids[0] if isinstance(ids, list) else ids)]
             for role in ("bos", "eos", "pad") if (ids := config.get(f"{role}_token_id")) is not None}
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, **{f"{role}_token": name for role, name in roles.items()},
                            model_max_length=config["max_position_embeddings"]).save_pretrained(dest)


def save_hf_folder(shape: Shape, dest: Path, *, seed: int = SEED) -> None:
    """The random-weight transformers model of ``shape`` as an HF folder (fp32 safetensors, config.json,
    the byte-level tokenizer)."""
    import torch  # the models extra
    import transformers  # the models extra

    config = getattr(transformers, shape.config_class)(**shape.config)
    config.architectures = [shape.architecture]
    model = getattr(transformers, shape.architecture)(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, parameter in sorted(model.named_parameters()):
            if parameter.dim() >= 2:
                parameter.normal_(0.0, INIT_STD, generator=generator)
        eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
        model.get_output_embeddings().weight[eos] = 0.0  # EOS never wins the argmax: decoding runs its steps
    model.save_pretrained(dest, safe_serialization=True)
    save_byte_tokenizer(dest, shape.config)


def check_folder(folder: Path, vocab_size: int, tokens: int = CHECK_TOKENS) -> dict:
    """The folder's tokenizer encodes a fixed prompt and the Generator decodes ``tokens`` greedy steps
    after it, every id in the vocabulary."""
    from tokenizers import Tokenizer  # the models extra

    prompt = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(CHECK_PROMPT).ids
    out = greedy_ids(folder, prompt, tokens)
    if len(out) != tokens or not all(0 <= t < vocab_size for t in out):
        raise ModelBuildError(f"{folder.name}: the Generator decoded {out} after {len(prompt)} prompt ids "
                              f"(wanted {tokens} ids below {vocab_size})")
    return {"prompt": CHECK_PROMPT, "prompt_ids": prompt, "tokens": out}


def build(shape: Shape, folders: Mapping[str, Path], tmp: Path, log: Log, *, seed: int = SEED) -> dict:
    """The builder's folders of ``shape`` in ``folders`` (precision -> folder, each written atomically),
    from an HF folder saved in ``tmp``; returns what goes into the manifest."""
    import onnxruntime_genai as og  # the models extra

    started = time.perf_counter()
    seconds: dict[str, float] = {}
    checks: dict[str, dict] = {}
    count = parameter_count(shape)
    log(f"  {shape.title}: random weights (seed {seed}, N(0, {INIT_STD}^2)), {count / 1e9:.2f}B parameters ...")
    hf = tmp / "hf"
    save_hf_folder(shape, hf, seed=seed)
    seconds["hf folder"] = round(time.perf_counter() - started, 1)
    for precision, target in folders.items():
        seconds[f"builder {precision}"] = round(
            write_folder(target, lambda t, p=precision: run_builder(hf, t, p, tmp / "builder-cache", log)), 1)
        t0 = time.perf_counter()
        checks[f"genai-{precision}"] = {"builder_options": builder_options(precision),
                                        "generator": check_folder(target, shape.config["vocab_size"])}
        seconds[f"check {precision}"] = round(time.perf_counter() - t0, 1)
        log(f"    genai-{precision}: the Generator decodes {CHECK_TOKENS} tokens ({seconds[f'builder {precision}']} s)")
    seconds["total"] = round(time.perf_counter() - started, 1)
    return {"shape": {"title": shape.title, "source": shape.source, "architecture": shape.architecture,
                      "config": json.loads(json.dumps(dict(shape.config))), "parameters": count,
                      "published_parameters": shape.published_parameters},
            "weights": {"random": True, "seed": seed, "std": INIT_STD, "use": "speed only"},
            "tokenizer": "generated byte-level tokenizer of the model's vocabulary size (not the model's own)",
            "checks": checks, "seconds": seconds, "onnxruntime_genai": og.__version__,
            "builder_options": {p: builder_options(p) for p in folders}}


def tiny(shape: Shape) -> Shape:
    """``shape`` at tiny sizes (2 layers, width 64, heads of 16, vocabulary 384) with its other settings
    (rope, ties, biases, sliding windows): the same build path in seconds, for tests."""
    config = dict(shape.config)
    config.update(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=min(2, config["num_key_value_heads"]), vocab_size=384,
                  max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
    if "head_dim" in config:
        config["head_dim"] = 16
    if "query_pre_attn_scalar" in config:
        config["query_pre_attn_scalar"] = 16
    if "sliding_window" in config:  # longer than the build's check (prompt + steps), as the real windows are
        config["sliding_window"] = min(config["sliding_window"], 64)
    if "pad_token_id" in config:
        config["pad_token_id"] = 0
    if "rope_scaling" in config:
        config["rope_scaling"] = {**config["rope_scaling"], "original_max_position_embeddings": 128}
    return dataclasses.replace(shape, title=f"tiny {shape.title}", config=config, published_parameters=0.0)
