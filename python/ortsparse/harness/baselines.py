"""Weight-only quantized baselines: what a CPU user would pick instead of ortsparse.

``quantize_matmul_nbits(src, dst, bits=4)`` turns every MatMul with a constant weight of an ONNX
model into ORT's com.microsoft MatMulNBits (``onnxruntime.quantization.matmul_nbits_quantizer``,
block-wise, symmetric by default). ``ortsparse models baselines`` applies it to the SmolLM2 KV
export (int4 and int8, block 32). Needs only onnx and onnxruntime (no torch).
"""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path

Log = Callable[[str], None]

BLOCK_SIZE = 32


def quantize_matmul_nbits(src: str | Path, dst: str | Path, bits: int = 4, block_size: int = BLOCK_SIZE,
                          symmetric: bool = True, accuracy_level: int | None = None,
                          nodes_to_exclude: list[str] | None = None) -> dict:
    """Quantize the constant-weight MatMuls of ``src`` to MatMulNBits and write ``dst`` (one file,
    weights embedded; written to a temporary name and renamed). Returns what it did: bits, block,
    op counts before and after, seconds. ``accuracy_level`` is ORT's compute type for
    MatMulNBits (None = ORT's default; 4 = int8 compute, faster, less exact)."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import (DefaultWeightOnlyQuantConfig,
                                                                 MatMulNBitsQuantizer)

    from .models import atomic_write

    if bits not in (2, 4, 8):
        raise ValueError(f"bits must be 2, 4 or 8 (MatMulNBits), not {bits}")
    started = time.perf_counter()
    model = onnx.load(str(src))
    before = Counter(node.op_type for node in model.graph.node)
    config = DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=symmetric,
                                          accuracy_level=accuracy_level, bits=bits)
    quantizer = MatMulNBitsQuantizer(model, bits=bits, block_size=block_size, is_symmetric=symmetric,
                                     accuracy_level=accuracy_level, nodes_to_exclude=nodes_to_exclude,
                                     algo_config=config)
    quantizer.process()
    result = quantizer.model.model
    after = Counter(node.op_type for node in result.graph.node)
    if after["MatMulNBits"] == 0:
        raise RuntimeError(f"{Path(src).name}: no MatMul was quantized to MatMulNBits (bits={bits})")
    atomic_write(Path(dst), lambda tmp: onnx.save_model(result, str(tmp)))
    return {"bits": bits, "block_size": block_size, "symmetric": symmetric, "accuracy_level": accuracy_level,
            "matmul_before": before["MatMul"], "matmul_after": after["MatMul"],
            "matmulnbits": after["MatMulNBits"], "seconds": round(time.perf_counter() - started, 1)}


def greedy_check(path: Path, tokenizer_path: Path, reference: list[int] | None = None) -> dict:
    """Greedy continuation of the standard prompt with a quantized KV export (torch-free)."""
    from tokenizers import Tokenizer

    from .export_smollm2 import GREEDY_TOKENS, PROMPT, ort_greedy_kv

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=False).ids
    tokens = ort_greedy_kv(path, prompt_ids, GREEDY_TOKENS)
    result = {"prompt": PROMPT, "tokens": tokens, "text": tokenizer.decode(tokens)}
    if reference is not None:
        same = 0
        for a, b in zip(tokens, reference):
            if a != b:
                break
            same += 1
        result["prefix_matching_fp32"] = same
    return result


def build(source: Path, out: Mapping[str, Path], log: Log) -> dict:
    """The ``baselines`` entry of ``ortsparse models``: int4 and int8 MatMulNBits of the KV export."""
    from .models import manifest, model_path

    reference = (((manifest("smollm2") or {}).get("checks") or {}).get("torch_greedy") or {}).get("tokens")
    tokenizer = model_path("smollm2", "tokenizer")
    checks: dict = {}
    failed: dict = {}
    for variant, bits in (("kv.torchscript.int4", 4), ("kv.torchscript.int8", 8)):
        log(f"  quantizing {source.name} -> {out[variant].name} (MatMulNBits, {bits} bits, block {BLOCK_SIZE}, symmetric) ...")
        try:
            info = quantize_matmul_nbits(source, out[variant], bits=bits)
        except Exception as error:
            if bits == 4:
                raise
            failed[variant] = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300]}"
            log(f"    FAILED: {failed[variant]}")
            continue
        info["greedy"] = greedy_check(out[variant], tokenizer, reference)
        checks[variant] = info
        log(f"    {info['matmulnbits']} MatMulNBits, {info['matmul_after']} MatMul left, {info['seconds']} s; "
            f"greedy: {info['greedy']['text']!r} ({info['greedy'].get('prefix_matching_fp32')} tokens as fp32 torch)")
    return {"checks": checks, "failed": failed}
