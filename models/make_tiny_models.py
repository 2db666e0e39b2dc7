#!/usr/bin/env python
"""Build tiny transformer models with random weights and export them to ONNX.

Writes ``models/tiny/<name>.<exporter>.onnx`` plus ``models/tiny/manifest.json``.

Every model is a ``transformers`` class built from a tiny config (never ``from_pretrained``: no hub is
reachable). ALL parameters are drawn from a fixed-seed generator -- linear weights, biases, embeddings
and the weights/biases of LayerNorm/RMSNorm -- so no parameter is trivially 0 or 1 and a rewrite that
drops a bias or a norm scale is caught by a numeric test.

Each model is exported with
  * the legacy TorchScript exporter (``torch.onnx.export(..., dynamo=False, opset_version=17)``),
  * the dynamo exporter (``torch.onnx.export(..., dynamo=True)``, exporter's default opset, weights
    embedded in one file, no external data; the per-node ``pkg.torch.onnx.stack_trace`` metadata is
    dropped because it holds absolute paths of the exporting machine),
  * for the SDPA variants also the dynamo exporter at opset 23, where SDPA becomes one ONNX
    ``Attention`` node.

After export each file is checked with ``onnx.checker.check_model(full_check=True)`` and run in
onnxruntime against the torch output on a fixed input (max abs diff printed and recorded). The manifest
keeps, per file: sha256, size, exporter, opset, versions, config, input/output names, shapes and dtypes,
how to rebuild the fixed inputs with numpy (seeds; the small integer inputs are also stored verbatim),
and summary numbers of the torch output (sum, L2 norm, max |x|, first values) so a test without torch
can check that ORT reproduces torch.

Run:  python models/make_tiny_models.py            (all models; needs torch + transformers)
      python models/make_tiny_models.py --only llama_tiny_kv --out-dir /tmp/tiny
      python models/make_tiny_models.py --check    (verify committed files; numpy + onnxruntime only)

Importing this module needs only numpy: tests use ``reference_inputs(entry)`` and
``check_file(path, entry, tol)`` without torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import inspect
import json
import math
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "tiny"
MAX_BYTES = 1 << 20  # every committed file must stay below 1 MiB
TORCHSCRIPT_OPSET = 17
DYNAMO_ATTENTION_OPSET = 23
MANIFEST_VERSION = 1
# Element-wise |ORT - torch| accepted when checking against the stored summaries (seen: <= 1e-5).
SUMMARY_TOL = 1e-4
# Summary of a torch output stored in the manifest: a few numbers, never the full tensor.
N_FIRST_VALUES = 8

# ----------------------------------------------------------------------------------------------
# Model specs
# ----------------------------------------------------------------------------------------------

VOCAB = 256


@dataclasses.dataclass(frozen=True)
class Spec:
    name: str  # file stem, e.g. "gpt2_tiny"
    family: str  # "gpt2" | "bert" | "llama"
    model_class: str  # transformers class name
    config: dict  # kwargs of the transformers config (attn implementation excluded)
    attn_implementation: str  # "eager" (decomposed MatMul-Softmax-MatMul) or "sdpa"
    kind: str  # "causal_lm" | "encoder" | "causal_lm_kv"
    exporters: tuple  # subset of ("torchscript", "dynamo", "dynamo_opset23")
    seed: int  # weight seed
    description: str


GPT2_CONFIG = dict(
    n_layer=2, n_embd=64, n_head=4, n_inner=None, vocab_size=VOCAB, n_positions=128,
    bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1, tie_word_embeddings=True, use_cache=False,
)
BERT_CONFIG = dict(
    num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
    vocab_size=VOCAB, max_position_embeddings=128, type_vocab_size=2, pad_token_id=0,
)
LLAMA_CONFIG = dict(
    num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=128, rope_theta=10000.0,
    rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=None,
    hidden_act="silu", attention_bias=False, mlp_bias=False, use_cache=False,
)

SPECS: list[Spec] = [
    Spec("gpt2_tiny", "gpt2", "GPT2LMHeadModel", GPT2_CONFIG, "eager", "causal_lm",
         ("torchscript", "dynamo"), 1001,
         "GPT-2 layout: Conv1D linears, LayerNorm, gelu_new MLP, tied lm_head, eager attention"),
    Spec("gpt2_tiny_sdpa", "gpt2", "GPT2LMHeadModel", GPT2_CONFIG, "sdpa", "causal_lm",
         ("torchscript", "dynamo", "dynamo_opset23"), 1001,
         "same weights as gpt2_tiny, attention through torch SDPA"),
    Spec("bert_tiny", "bert", "BertModel", BERT_CONFIG, "eager", "encoder",
         ("torchscript", "dynamo"), 2002,
         "BERT encoder: post-LN, GELU MLP, pooler (Linear+Tanh), eager attention"),
    Spec("bert_tiny_sdpa", "bert", "BertModel", BERT_CONFIG, "sdpa", "encoder",
         ("torchscript", "dynamo", "dynamo_opset23"), 2002,
         "same weights as bert_tiny, attention through torch SDPA"),
    Spec("llama_tiny", "llama", "LlamaForCausalLM", LLAMA_CONFIG, "eager", "causal_lm",
         ("torchscript", "dynamo"), 3003,
         "Llama/SmolLM2 layout: RMSNorm, rotary, GQA 4q/2kv heads, SwiGLU MLP, tied lm_head, eager"),
    Spec("llama_tiny_sdpa", "llama", "LlamaForCausalLM", LLAMA_CONFIG, "sdpa", "causal_lm",
         ("torchscript", "dynamo", "dynamo_opset23"), 3003,
         "same weights as llama_tiny, attention through torch SDPA"),
    Spec("llama_tiny_kv", "llama", "LlamaForCausalLM", LLAMA_CONFIG, "eager", "causal_lm_kv",
         ("torchscript", "dynamo"), 3003,
         "llama_tiny weights, KV-cache decode graph: past K/V in, present K/V out"),
]

# Fixed inputs. Causal LMs: batch 2, row 1 right-padded (no query row is fully masked, so padded
# positions stay finite and comparable). Encoder: same padding, token types split in two segments.
BATCH, SEQ, N_PAD = 2, 7, 2
KV_PAST, KV_NEW = 5, 1
INPUT_SEED = 1235  # (1234 draws token 250 twice first: the KV rows would get the same token)

# ----------------------------------------------------------------------------------------------
# Weights
# ----------------------------------------------------------------------------------------------


def randomize_parameters(model, seed: int) -> dict:
    """Overwrite every parameter with fixed-seed random values; returns a description of the scheme.

    * Linear / Conv1D weights: normal, std 1/sqrt(fan_in) (unit gain, so attention logits are O(1) and
      the softmax is neither uniform nor one-hot),
    * embeddings: normal, std 0.5,
    * norm scales (LayerNorm / RMSNorm ``weight``): uniform [0.5, 1.5),
    * every bias (linears and norms): normal, std 0.1.
    Tied parameters (lm_head = embeddings) are listed once by ``named_parameters`` and stay tied.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    owners = {}
    for mod_name, mod in model.named_modules():
        for p_name, p in mod.named_parameters(recurse=False):
            owners.setdefault(id(p), (mod, p_name))
    with torch.no_grad():
        for name, p in model.named_parameters():
            mod, p_name = owners[id(p)]
            cls = type(mod).__name__
            if p_name == "bias":
                new = torch.randn(p.shape, generator=gen) * 0.1
            elif "Norm" in cls:
                new = torch.rand(p.shape, generator=gen) + 0.5
            elif isinstance(mod, torch.nn.Embedding):
                new = torch.randn(p.shape, generator=gen) * 0.5
            elif isinstance(mod, torch.nn.Linear):
                new = torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1])
            elif cls == "Conv1D":  # GPT-2: weight is (in, out)
                new = torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[0])
            else:
                raise TypeError(f"no init rule for parameter {name} of {cls}")
            p.copy_(new.to(p.dtype))
        for name, p in model.named_parameters():
            if bool((p == 0).all()) or bool((p == 1).all()) or int((p == 0).sum()) > 0:
                raise AssertionError(f"parameter {name} has trivial values after init")
    return {
        "generator": "torch.Generator().manual_seed(seed), parameters in named_parameters() order",
        "seed": seed,
        "linear_weight": "normal, mean 0, std 1/sqrt(fan_in)",
        "embedding": "normal, mean 0, std 0.5",
        "norm_weight": "uniform [0.5, 1.5)",
        "bias": "normal, mean 0, std 0.1 (linear and norm biases)",
    }


def build_model(spec: Spec):
    import torch
    import transformers

    cls = getattr(transformers, spec.model_class)
    config_cls = cls.config_class
    cfg = config_cls(**spec.config)
    cfg._attn_implementation = spec.attn_implementation  # noqa: SLF001 (documented way in v4/v5)
    torch.manual_seed(spec.seed)  # __init__ draws from the global RNG; everything is overwritten below
    model = cls(cfg)
    model.eval()
    if model.config._attn_implementation != spec.attn_implementation:  # noqa: SLF001
        raise RuntimeError(f"{spec.name}: attention implementation not honoured")
    init = randomize_parameters(model, spec.seed)
    return model, init


# ----------------------------------------------------------------------------------------------
# Wrappers: fixed, flat signatures for both exporters
# ----------------------------------------------------------------------------------------------


def make_wrapper(spec: Spec, model):
    import torch

    if spec.kind == "causal_lm" and not has_position_ids(spec):

        class CausalLM(torch.nn.Module):
            def __init__(self, model):
                super().__init__()
                self.model = model

            def forward(self, input_ids, attention_mask):
                return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

        return CausalLM(model).eval()

    if spec.kind == "causal_lm":

        class CausalLMWithPositions(torch.nn.Module):
            def __init__(self, model):
                super().__init__()
                self.model = model

            def forward(self, input_ids, attention_mask, position_ids):
                return self.model(
                    input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
                ).logits

        return CausalLMWithPositions(model).eval()

    if spec.kind == "encoder":

        class Encoder(torch.nn.Module):
            def __init__(self, model):
                super().__init__()
                self.model = model

            def forward(self, input_ids, attention_mask, token_type_ids):
                out = self.model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
                return out.last_hidden_state, out.pooler_output

        return Encoder(model).eval()

    if spec.kind == "causal_lm_kv":
        from transformers import DynamicCache

        n_layers = model.config.num_hidden_layers
        # transformers 5.2x renames `past_key_values` to `cache` (the old name warns); accept both.
        cache_kw = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"

        class CausalLMWithPast(torch.nn.Module):
            """Flat past tensors in (k0, v0, k1, v1, ...), logits + flat present tensors out."""

            def __init__(self, model):
                super().__init__()
                self.model = model

            def forward(self, input_ids, attention_mask, position_ids, past_key_values):
                cache = DynamicCache(config=self.model.config)
                for i in range(n_layers):
                    cache.update(past_key_values[2 * i], past_key_values[2 * i + 1], i)
                out = self.model(
                    input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                    use_cache=True, **{cache_kw: cache},
                )
                present = []
                for layer in out.past_key_values.layers:
                    present += [layer.keys, layer.values]
                return (out.logits, *present)

        return CausalLMWithPast(model).eval()

    raise ValueError(spec.kind)


# ----------------------------------------------------------------------------------------------
# Inputs (numpy, reproducible without torch)
# ----------------------------------------------------------------------------------------------


def has_position_ids(spec: Spec) -> bool:
    """Llama graphs take explicit position_ids (as optimum / onnxruntime-genai exports do).

    Without them the rotary cos/sin get batch dim 1, and the opset-23 dynamo export (whose optimizer
    fuses rotary into ONNX RotaryEmbedding) fails in onnxruntime for batch > 1: "Inputs 'cos_cache'
    and 'sin_cache' are expected to have the same shape as input 'x'".
    """
    return spec.family == "llama"


def kv_dims(spec: Spec) -> tuple[int, int]:
    cfg = spec.config
    return cfg["num_key_value_heads"], cfg["hidden_size"] // cfg["num_attention_heads"]


def _draw(rng: np.random.Generator, dist: str, shape: list, dtype: str, high: int | None = None) -> np.ndarray:
    if dist == "integers":
        return rng.integers(0, high, size=tuple(shape), dtype=np.dtype(dtype))
    if dist == "standard_normal":
        return rng.standard_normal(tuple(shape), dtype=np.dtype(dtype))
    raise ValueError(dist)


def draw(rng, recipe: dict, name: str, dist: str, shape: list, dtype: str, high: int | None = None) -> np.ndarray:
    step = {"name": name, "dist": dist, "shape": list(shape), "dtype": dtype}
    if high is not None:
        step["low"], step["high"] = 0, high
    recipe["order"].append(step)
    return _draw(rng, dist, shape, dtype, high)


def reference_inputs(entry: dict) -> dict[str, np.ndarray]:
    """Rebuild a manifest entry's fixed inputs with numpy only (no torch needed).

    Random tensors are redrawn from the recipe (one generator, draws in ``order``); integer inputs are
    stored verbatim in ``int_values`` and taken from there (their recipe draws are still replayed so
    the generator advances exactly as in the export run).
    """
    inp = entry["reference"]["inputs"]
    recipe = inp["recipe"]
    rng = np.random.default_rng(recipe["seed"])
    feeds: dict[str, np.ndarray] = {}
    for step in recipe["order"]:
        feeds[step["name"]] = _draw(rng, step["dist"], step["shape"], step["dtype"], step.get("high"))
    for name, values in inp["int_values"].items():
        arr = np.asarray(values, dtype=np.dtype(inp["dtypes"][name]))
        if name in feeds and not np.array_equal(feeds[name], arr):
            raise AssertionError(f"{name}: numpy redraw differs from the stored values (numpy RNG changed?)")
        feeds[name] = arr
    for name, shape in inp["shapes"].items():
        if list(feeds[name].shape) != list(shape):
            raise AssertionError(f"{name}: rebuilt shape {feeds[name].shape} != {shape}")
    return feeds


def check_outputs_against_summary(outputs: dict[str, np.ndarray], entry: dict, tol: float) -> dict[str, float]:
    """Compare outputs with the stored torch summaries, numpy only.

    ``tol`` bounds the element-wise |ort - torch|; the checked quantities follow from it exactly:
    |d sum| <= n tol, |d l2| <= sqrt(n) tol, |d max_abs| <= tol, |d first[i]| <= tol.
    Returns the worst ratio (error / allowed) per output; raises AssertionError when one exceeds 1.
    """
    worst = {}
    for name, ref in entry["reference"]["torch_outputs"].items():
        x = outputs[name]
        if list(x.shape) != ref["shape"]:
            raise AssertionError(f"{name}: shape {list(x.shape)} != reference {ref['shape']}")
        got = summary(x)
        n = x.size
        bounds = {"sum": n * tol, "l2": math.sqrt(n) * tol, "max_abs": tol}
        ratios = [abs(got[k] - ref[k]) / b for k, b in bounds.items()]
        ratios += [abs(a - b) / tol for a, b in zip(got["first"], ref["first"])]
        worst[name] = max(ratios)
        if worst[name] > 1:
            raise AssertionError(f"{name}: differs from the torch reference: got {got}, reference {ref}")
    return worst


def make_inputs(spec: Spec) -> tuple[dict[str, np.ndarray], dict]:
    """Fixed inputs for the reference run, and a recipe that rebuilds them with numpy."""
    rng = np.random.default_rng(INPUT_SEED)
    recipe: dict[str, Any] = {
        "rng": "numpy.random.default_rng", "seed": INPUT_SEED,
        "order": [],  # draws from ONE generator, in this order; see reference_inputs()
    }
    if spec.kind in ("causal_lm", "encoder"):
        ids = draw(rng, recipe, "input_ids", "integers", [BATCH, SEQ], "int64", high=VOCAB)
        mask = np.ones((BATCH, SEQ), dtype=np.int64)
        mask[1, SEQ - N_PAD:] = 0
        feeds = {"input_ids": ids, "attention_mask": mask}
        recipe["attention_mask"] = f"ones, row 1 right-padded: mask[1, {SEQ - N_PAD}:] = 0"
        if has_position_ids(spec):
            feeds["position_ids"] = np.tile(np.arange(SEQ, dtype=np.int64), (BATCH, 1))
            recipe["position_ids"] = f"arange({SEQ}) for each row"
        if spec.kind == "encoder":
            tt = np.zeros((BATCH, SEQ), dtype=np.int64)
            tt[:, SEQ // 2:] = 1
            feeds["token_type_ids"] = tt
            recipe["token_type_ids"] = f"zeros, token_type_ids[:, {SEQ // 2}:] = 1"
        return feeds, recipe

    if spec.kind == "causal_lm_kv":
        n_layers = spec.config["num_hidden_layers"]
        kvh, hd = kv_dims(spec)
        ids = draw(rng, recipe, "input_ids", "integers", [BATCH, KV_NEW], "int64", high=VOCAB)
        total = KV_PAST + KV_NEW
        mask = np.ones((BATCH, total), dtype=np.int64)
        mask[1, 0] = 0  # row 1: first past position is padding (left padding)
        recipe["attention_mask"] = f"ones of shape {[BATCH, total]}, mask[1, 0] = 0 (left padding)"
        pos = np.tile(np.arange(KV_PAST, total, dtype=np.int64), (BATCH, 1))
        recipe["position_ids"] = f"arange({KV_PAST}, {total}) for each row"
        feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": pos}
        for i in range(n_layers):
            for kv in ("key", "value"):
                name = f"past_key_values.{i}.{kv}"
                feeds[name] = draw(rng, recipe, name, "standard_normal", [BATCH, kvh, KV_PAST, hd], "float32")
        return feeds, recipe

    raise ValueError(spec.kind)


def io_names(spec: Spec) -> tuple[list[str], list[str]]:
    if spec.kind == "causal_lm":
        if has_position_ids(spec):
            return ["input_ids", "attention_mask", "position_ids"], ["logits"]
        return ["input_ids", "attention_mask"], ["logits"]
    if spec.kind == "encoder":
        return ["input_ids", "attention_mask", "token_type_ids"], ["last_hidden_state", "pooler_output"]
    n_layers = spec.config["num_hidden_layers"]
    past = [f"past_key_values.{i}.{kv}" for i in range(n_layers) for kv in ("key", "value")]
    present = [f"present.{i}.{kv}" for i in range(n_layers) for kv in ("key", "value")]
    return ["input_ids", "attention_mask", "position_ids", *past], ["logits", *present]


def torch_args(spec: Spec, feeds: dict[str, np.ndarray]) -> tuple:
    import torch

    t = {k: torch.from_numpy(v.copy()) for k, v in feeds.items()}
    if spec.kind == "causal_lm":
        if has_position_ids(spec):
            return (t["input_ids"], t["attention_mask"], t["position_ids"])
        return (t["input_ids"], t["attention_mask"])
    if spec.kind == "encoder":
        return (t["input_ids"], t["attention_mask"], t["token_type_ids"])
    n_layers = spec.config["num_hidden_layers"]
    past = tuple(t[f"past_key_values.{i}.{kv}"] for i in range(n_layers) for kv in ("key", "value"))
    return (t["input_ids"], t["attention_mask"], t["position_ids"], past)


def legacy_dynamic_axes(spec: Spec) -> dict:
    bs = {0: "batch", 1: "seq"}
    if spec.kind == "causal_lm":
        axes = {"input_ids": bs, "attention_mask": bs, "logits": bs}
        if has_position_ids(spec):
            axes["position_ids"] = bs
        return axes
    if spec.kind == "encoder":
        return {"input_ids": bs, "attention_mask": bs, "token_type_ids": bs,
                "last_hidden_state": bs, "pooler_output": {0: "batch"}}
    ins, outs = io_names(spec)
    axes = {"input_ids": bs, "position_ids": bs, "attention_mask": {0: "batch", 1: "total_seq"}, "logits": bs}
    for n in ins[3:]:
        axes[n] = {0: "batch", 2: "past_seq"}
    for n in outs[1:]:
        axes[n] = {0: "batch", 2: "total_seq"}
    return axes


def dynamo_dynamic_shapes(spec: Spec) -> dict:
    from torch.export import Dim

    batch, seq = Dim("batch"), Dim("seq")
    bs = {0: batch, 1: seq}
    if spec.kind == "causal_lm":
        shapes = {"input_ids": bs, "attention_mask": bs}
        if has_position_ids(spec):
            shapes["position_ids"] = bs
        return shapes
    if spec.kind == "encoder":
        return {"input_ids": bs, "attention_mask": bs, "token_type_ids": bs}
    # Decode graph: one new token (traced with seq 1, so seq is static 1); total = past + 1.
    past_seq = Dim("past_seq")
    n_layers = spec.config["num_hidden_layers"]
    return {
        "input_ids": {0: batch}, "attention_mask": {0: batch, 1: past_seq + 1}, "position_ids": {0: batch},
        "past_key_values": tuple({0: batch, 2: past_seq} for _ in range(2 * n_layers)),
    }


# ----------------------------------------------------------------------------------------------
# Export
# ----------------------------------------------------------------------------------------------


def export_torchscript(spec: Spec, wrapper, args, path: Path) -> None:
    import torch

    ins, outs = io_names(spec)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            wrapper, args, str(path), dynamo=False, opset_version=TORCHSCRIPT_OPSET,
            input_names=ins, output_names=outs, dynamic_axes=legacy_dynamic_axes(spec),
            do_constant_folding=True,
        )


def strip_machine_metadata(model_proto) -> int:
    """Drop per-node stack traces (absolute paths of the exporting machine). Returns how many."""
    import onnx

    dropped = 0

    def visit(graph):
        nonlocal dropped
        for node in graph.node:
            keep = [p for p in node.metadata_props if p.key != "pkg.torch.onnx.stack_trace"]
            dropped += len(node.metadata_props) - len(keep)
            del node.metadata_props[:]
            node.metadata_props.extend(keep)
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    visit(attr.g)
                for g in attr.graphs:
                    visit(g)

    visit(model_proto.graph)
    for f in model_proto.functions:
        for node in f.node:
            keep = [p for p in node.metadata_props if p.key != "pkg.torch.onnx.stack_trace"]
            dropped += len(node.metadata_props) - len(keep)
            del node.metadata_props[:]
            node.metadata_props.extend(keep)
    return dropped


def export_dynamo(spec: Spec, wrapper, args, path: Path, opset: int | None) -> None:
    import onnx
    import torch

    ins, outs = io_names(spec)
    kwargs = {} if opset is None else {"opset_version": opset}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog = torch.onnx.export(
            wrapper, args, dynamo=True, input_names=ins, output_names=outs,
            dynamic_shapes=dynamo_dynamic_shapes(spec), external_data=False, verbose=False, **kwargs,
        )
    proto = prog.model_proto
    strip_machine_metadata(proto)
    onnx.save_model(proto, str(path), save_as_external_data=False)


# ----------------------------------------------------------------------------------------------
# Verification and manifest
# ----------------------------------------------------------------------------------------------

ONNX_DTYPES = {1: "float32", 6: "int32", 7: "int64", 9: "bool", 10: "float16", 11: "float64"}


def value_info(vi) -> dict:
    tt = vi.type.tensor_type
    shape = [d.dim_param if d.HasField("dim_param") else (d.dim_value if d.HasField("dim_value") else None)
             for d in tt.shape.dim]
    return {"name": vi.name, "dtype": ONNX_DTYPES.get(tt.elem_type, str(tt.elem_type)), "shape": shape}


def summary(x: np.ndarray) -> dict:
    x64 = x.astype(np.float64)
    return {
        "shape": list(x.shape), "dtype": str(x.dtype),
        "sum": float(x64.sum()), "l2": float(np.sqrt((x64 * x64).sum())),
        "max_abs": float(np.abs(x64).max()), "mean": float(x64.mean()),
        "first": [float(v) for v in x.reshape(-1)[:N_FIRST_VALUES]],
    }


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def op_histogram(model_proto) -> dict:
    counts: dict[str, int] = {}
    for n in model_proto.graph.node:
        key = n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}::{n.op_type}"
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def run_ort(path: Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    return sess.run(None, {n: feeds[n] for n in names})


def verify(path: Path, feeds, ref_outputs: list[np.ndarray], out_names: list[str]) -> dict:
    import onnx

    onnx.checker.check_model(str(path), full_check=True)
    got = run_ort(path, feeds)
    diffs = {}
    for name, r, g in zip(out_names, ref_outputs, got):
        if r.shape != g.shape:
            raise AssertionError(f"{path.name}:{name}: shape {g.shape} != torch {r.shape}")
        diffs[name] = float(np.abs(r.astype(np.float64) - g.astype(np.float64)).max())
    return diffs


KV_EXTRA_CASES = (  # (label, batch, past, new)
    ("batch1_past0_new1", 1, 0, 1),
    ("batch3_past9_new1", 3, 9, 1),
    ("batch1_past0_new4_prefill", 1, 0, 4),
    ("batch2_past5_new3_chunk", 2, 5, 3),
)


def extra_kv_checks(spec: Spec, exporter: str, path: Path, wrapper) -> dict:
    """Run the KV graph on shapes other than the traced one (ORT vs torch max abs diff per case).

    The legacy graph keeps the new-token axis dynamic, so it also serves prefill (past 0) and chunks.
    The dynamo graph is traced with one new token and torch.export specialises that axis to 1.
    """
    import torch

    n_layers = spec.config["num_hidden_layers"]
    kvh, hd = kv_dims(spec)
    rng = np.random.default_rng(INPUT_SEED + 1)
    results = {}
    for label, batch, past, new in KV_EXTRA_CASES:
        feeds = {
            "input_ids": rng.integers(0, VOCAB, size=(batch, new), dtype=np.int64),
            "attention_mask": np.ones((batch, past + new), dtype=np.int64),
            "position_ids": np.tile(np.arange(past, past + new, dtype=np.int64), (batch, 1)),
        }
        for i in range(n_layers):
            for kv in ("key", "value"):
                feeds[f"past_key_values.{i}.{kv}"] = rng.standard_normal((batch, kvh, past, hd), dtype=np.float32)
        if exporter != "torchscript" and new != 1:
            results[label] = "skipped: dynamo KV graph has a static new-token axis of 1"
            continue
        with torch.no_grad():
            ref = [t.numpy() for t in flatten(wrapper(*torch_args(spec, feeds)))]
        try:
            got = run_ort(path, feeds)
            results[label] = max(float(np.abs(r - g).max()) for r, g in zip(ref, got))
        except Exception as e:  # noqa: BLE001 -- recorded, reported, not fatal
            results[label] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return results


def flatten(out) -> list:
    if isinstance(out, (tuple, list)):
        res = []
        for o in out:
            res += flatten(o)
        return res
    return [out]


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------


def file_name(spec: Spec, exporter: str) -> str:
    return f"{spec.name}.{exporter}.onnx"


def process(spec: Spec, out_dir: Path, versions: dict, log: Callable[[str], None]) -> tuple[dict, dict]:
    import onnx
    import torch

    model, init = build_model(spec)
    wrapper = make_wrapper(spec, model)
    feeds, recipe = make_inputs(spec)
    args = torch_args(spec, feeds)
    with torch.no_grad():
        ref = [t.detach().numpy().copy() for t in flatten(wrapper(*args))]
    ins, outs = io_names(spec)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"[{spec.name}] {spec.model_class} attn={spec.attn_implementation} kind={spec.kind} "
        f"params={n_params} ref outputs " + ", ".join(f"{n}{list(r.shape)}" for n, r in zip(outs, ref)))

    entries, failures = {}, {}
    for exporter in spec.exporters:
        fname = file_name(spec, exporter)
        path = out_dir / fname
        t0 = time.perf_counter()
        try:
            with tempfile.TemporaryDirectory() as td:
                tmp = Path(td) / fname
                if exporter == "torchscript":
                    export_torchscript(spec, wrapper, args, tmp)
                    opset_req = TORCHSCRIPT_OPSET
                elif exporter == "dynamo":
                    export_dynamo(spec, wrapper, args, tmp, None)
                    opset_req = None
                elif exporter == "dynamo_opset23":
                    export_dynamo(spec, wrapper, args, tmp, DYNAMO_ATTENTION_OPSET)
                    opset_req = DYNAMO_ATTENTION_OPSET
                else:
                    raise ValueError(exporter)
                if wrapper.training or model.training:
                    raise RuntimeError("exporter left the model in training mode")
                size = tmp.stat().st_size
                if size >= MAX_BYTES:
                    raise RuntimeError(f"{fname} is {size} bytes (limit {MAX_BYTES})")
                diffs = verify(tmp, feeds, ref, outs)
                extra = extra_kv_checks(spec, exporter, tmp, wrapper) if spec.kind == "causal_lm_kv" else None
                os.replace(tmp, path)
        except Exception as e:  # noqa: BLE001 -- one failed export must not stop the others
            msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:500]
            failures[fname] = msg
            log(f"  FAILED {fname}: {msg}")
            if path.exists():
                path.unlink()
            continue
        dt = time.perf_counter() - t0
        proto = onnx.load(str(path))
        opset = next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))
        hist = op_histogram(proto)
        entry = {
            "model": spec.name,
            "family": spec.family,
            "description": spec.description,
            "kind": spec.kind,
            "exporter": exporter,
            "export_call": {
                "torchscript": f"torch.onnx.export(dynamo=False, opset_version={TORCHSCRIPT_OPSET})",
                "dynamo": "torch.onnx.export(dynamo=True) default opset, external_data=False",
                "dynamo_opset23": f"torch.onnx.export(dynamo=True, opset_version={DYNAMO_ATTENTION_OPSET})",
            }[exporter],
            "opset": opset,
            "opset_requested": opset_req,
            "sha256": sha256(path),
            "size": path.stat().st_size,
            "versions": versions,
            "model_class": spec.model_class,
            "attn_implementation": spec.attn_implementation,
            "config": spec.config,
            "n_parameters": n_params,
            "weight_init": init,
            "inputs": [value_info(v) for v in proto.graph.input],
            "outputs": [value_info(v) for v in proto.graph.output],
            "reference": {
                "inputs": {
                    "recipe": recipe,
                    "shapes": {k: list(v.shape) for k, v in feeds.items()},
                    "dtypes": {k: str(v.dtype) for k, v in feeds.items()},
                    "int_values": {k: v.tolist() for k, v in feeds.items() if v.dtype == np.int64},
                },
                "torch_outputs": {n: summary(r) for n, r in zip(outs, ref)},
                "ort_max_abs_diff": diffs,
            },
            "op_types": hist,
        }
        if extra is not None:
            entry["reference"]["kv_other_shapes_max_abs_diff"] = extra
        # The manifest alone (numpy + onnxruntime) must reproduce this check: rebuild the inputs from it.
        rebuilt = reference_inputs(entry)
        for k, v in feeds.items():
            if not np.array_equal(rebuilt[k], v):
                raise AssertionError(f"{fname}: reference_inputs() does not rebuild {k}")
        check_file(path, entry, SUMMARY_TOL)
        entries[fname] = entry
        worst = max(diffs.values())
        log(f"  {fname}: {entry['size']} B, opset {opset}, {sum(hist.values())} nodes, "
            f"checker ok, ORT max|diff| {worst:.2e} ({dt:.1f} s)"
            + (f", other shapes {extra}" if extra else ""))
    return entries, failures


def check_file(path: Path, entry: dict, tol: float) -> dict[str, float]:
    """Run ``path`` in onnxruntime on the manifest's inputs and compare with the torch summaries.

    numpy + onnxruntime only. Returns worst error/allowed ratio per output (raises above 1).
    """
    feeds = reference_inputs(entry)
    names = [o["name"] for o in entry["outputs"]]
    outputs = dict(zip(names, run_ort(path, feeds)))
    return check_outputs_against_summary(outputs, entry, tol)


def check_manifest(out_dir: Path, tol: float) -> int:
    """``--check``: verify committed files (sha256, ORT vs stored torch summaries) without torch."""
    manifest = json.loads((out_dir / "manifest.json").read_text())
    bad = 0
    for fname, entry in manifest["files"].items():
        path = out_dir / fname
        problems = []
        if not path.exists():
            print(f"  {fname:45s} MISSING")
            bad += 1
            continue
        if sha256(path) != entry["sha256"]:
            problems.append("sha256 differs from manifest")
        try:
            worst = check_file(path, entry, tol)
            status = f"ok (worst error/allowed {max(worst.values()):.3f})"
        except Exception as e:  # noqa: BLE001 -- report every file, then fail
            problems.append(f"{type(e).__name__}: {str(e)[:300]}")
            status = "FAILED"
        bad += bool(problems)
        print(f"  {fname:45s} {status} {'; '.join(problems)}")
    print(f"checked {len(manifest['files'])} files, {bad} with problems")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--only", nargs="*", default=None, help="spec names to build (default: all)")
    ap.add_argument("--tolerance", type=float, default=SUMMARY_TOL, help="max ORT-vs-torch abs diff accepted")
    ap.add_argument("--check", action="store_true",
                    help="do not export: verify the files in --out-dir against manifest.json (no torch needed)")
    args = ap.parse_args(argv)
    if args.check:
        return check_manifest(args.out_dir, args.tolerance)

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import onnx
    import onnxruntime
    import onnxscript
    import torch
    import transformers

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    versions = {
        "torch": torch.__version__, "transformers": transformers.__version__, "onnx": onnx.__version__,
        "onnxscript": onnxscript.__version__, "onnxruntime": onnxruntime.__version__, "numpy": np.__version__,
    }
    out_dir: Path = args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"writing to {out_dir}  versions: {versions}", flush=True)

    specs = [s for s in SPECS if args.only is None or s.name in args.only]
    if args.only and len(specs) != len(args.only):
        print(f"unknown spec in --only; known: {[s.name for s in SPECS]}", file=sys.stderr)
        return 2

    manifest_path = out_dir / "manifest.json"
    files: dict[str, dict] = {}
    failures: dict[str, str] = {}
    if args.only is not None and manifest_path.exists():  # partial rebuild keeps the other entries
        old = json.loads(manifest_path.read_text())
        files.update(old.get("files", {}))
        failures.update(old.get("failures", {}))
    for spec in specs:
        for exporter in spec.exporters:
            files.pop(file_name(spec, exporter), None)
            failures.pop(file_name(spec, exporter), None)
        e, f = process(spec, out_dir, versions, lambda s: print(s, flush=True))
        files.update(e)
        failures.update(f)

    manifest = {
        "manifest_version": MANIFEST_VERSION,
        "generated_by": "python models/make_tiny_models.py",
        "note": "tiny random-weight models for fast tests; reference = torch output summary on fixed inputs",
        "summary_fields": "sum, l2, max_abs, mean over all elements (float64), first = first values in C order",
        "suggested_tolerance": SUMMARY_TOL,
        "how_to_check": "reference_inputs(entry) and check_file(path, entry, tol) in models/make_tiny_models.py "
                        "(numpy + onnxruntime only), or: python models/make_tiny_models.py --check",
        "files": dict(sorted(files.items())),
        "failures": dict(sorted(failures.items())),
    }
    manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=False) + "\n")
    print(f"wrote {manifest_path} ({len(files)} models, {len(failures)} failures)")

    bad = False
    for fname, entry in sorted(files.items()):
        worst = max(entry["reference"]["ort_max_abs_diff"].values())
        flag = "" if worst <= args.tolerance else f"  <-- above tolerance {args.tolerance}"
        bad |= bool(flag)
        print(f"  {fname:45s} {entry['size']:>8d} B  opset {entry['opset']:>2d}  ORT max|diff| {worst:.2e}{flag}")
    for fname, msg in sorted(failures.items()):
        print(f"  {fname:45s} FAILED: {msg}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
