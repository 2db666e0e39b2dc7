"""Weight-only quantized baselines: what a CPU user would pick instead of ortsparse.

``quantize_matmul_nbits(src, dst, bits=4)`` (file to file) and ``quantize_proto`` (in memory)
turn every MatMul with a constant weight of an ONNX model into ORT's com.microsoft MatMulNBits
(``onnxruntime.quantization.matmul_nbits_quantizer``, block-wise, symmetric by default).
``ortsparse models baselines`` applies it to the SmolLM2 KV export (int4 and int8, block 32);
``ortsparse.zoo.models.quantized_model`` hands benchmarks the cached file when there is one.
Needs only onnx and onnxruntime (no torch).
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path

import onnx

from .cache import atomic_write
from .export_smollm2 import GREEDY_TOKENS, PROMPT, ort_greedy_kv

Log = Callable[[str], None]

BLOCK_SIZE = 32


def quantize_proto(model, bits: int = 4, block_size: int = BLOCK_SIZE, symmetric: bool = True,
                   accuracy_level: int | None = None, nodes_to_exclude: list[str] | None = None):
    """(quantized onnx.ModelProto, stats): every MatMul with a constant weight of ``model`` (a
    path or ModelProto, not modified) becomes com.microsoft MatMulNBits. ``accuracy_level`` is
    ORT's compute type for MatMulNBits (None = ORT's default; 4 = int8 compute, faster, less
    exact)."""
    # Imported only when quantizing: it calls logging.basicConfig on import (reconfiguring the
    # process's logging) and adds ~0.3 s.
    from onnxruntime.quantization.matmul_nbits_quantizer import (DefaultWeightOnlyQuantConfig,
                                                                 MatMulNBitsQuantizer)

    if bits not in (2, 4, 8):
        raise ValueError(f"bits must be 2, 4 or 8 (MatMulNBits), not {bits}")
    # The quantizer module logs every node at INFO (it calls logging.basicConfig on import).
    logging.getLogger(MatMulNBitsQuantizer.__module__).setLevel(logging.WARNING)
    started = time.perf_counter()
    if isinstance(model, onnx.ModelProto):
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        model = copy
    else:
        model = onnx.load(str(model))
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
        raise RuntimeError(f"no MatMul with a constant weight was quantized to MatMulNBits (bits={bits})")
    return result, {"bits": bits, "block_size": block_size, "symmetric": symmetric,
                    "accuracy_level": accuracy_level, "matmul_before": before["MatMul"],
                    "matmul_after": after["MatMul"], "matmulnbits": after["MatMulNBits"],
                    "seconds": round(time.perf_counter() - started, 1)}


def quantize_matmul_nbits(src: str | Path, dst: str | Path, bits: int = 4, block_size: int = BLOCK_SIZE,
                          symmetric: bool = True, accuracy_level: int | None = None,
                          nodes_to_exclude: list[str] | None = None) -> dict:
    """Quantize ``src`` (see :func:`quantize_proto`) and write ``dst`` as one file (weights
    embedded; a temporary name renamed at the end). Returns the stats."""
    result, stats = quantize_proto(src, bits, block_size, symmetric, accuracy_level, nodes_to_exclude)
    atomic_write(Path(dst), lambda tmp: onnx.save_model(result, str(tmp)))
    return stats


def greedy_check(path: Path, tokenizer_path: Path, reference: list[int] | None = None) -> dict:
    """Greedy continuation of the standard prompt with a quantized KV export (torch-free)."""
    from tokenizers import Tokenizer  # the models extra (with transformers); quantizing needs none

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


# The cached baselines: variant -> (bits, accuracy_level). Level 4 (int8 compute) is ORT's fast CPU
# path and what every speed comparison uses; the default level (None: fp32 compute) is kept for the
# record (its int8 decodes several times slower).
VARIANTS = {"kv.torchscript.int4": (4, None), "kv.torchscript.int8": (8, None),
            "kv.torchscript.int4.acc4": (4, 4), "kv.torchscript.int8.acc4": (8, 4)}


def build(source: Path, out: Mapping[str, Path], log: Log, *, tokenizer: Path,
          reference: list[int] | None = None) -> dict:
    """The ``baselines`` entry of ``ortsparse models``: MatMulNBits of the KV export ``source`` for
    every variant of ``out`` (:data:`VARIANTS`: bits and accuracy level), each checked by a greedy
    continuation (``tokenizer``: its tokenizer.json; ``reference``: fp32 torch's greedy tokens, to
    count the matching prefix)."""
    checks: dict = {}
    failed: dict = {}
    for variant, target in out.items():
        bits, level = VARIANTS[variant]
        log(f"  quantizing {source.name} -> {target.name} (MatMulNBits, {bits} bits, block {BLOCK_SIZE}, symmetric, "
            f"accuracy_level {level if level is not None else 'default'}) ...")
        try:
            info = quantize_matmul_nbits(source, target, bits=bits, accuracy_level=level)
        except Exception as error:
            if bits == 4:
                raise
            failed[variant] = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300]}"
            log(f"    FAILED: {failed[variant]}")
            continue
        info["greedy"] = greedy_check(target, tokenizer, reference)
        checks[variant] = info
        log(f"    {info['matmulnbits']} MatMulNBits, {info['matmul_after']} MatMul left, {info['seconds']} s; "
            f"greedy: {info['greedy']['text']!r} ({info['greedy'].get('prefix_matching_fp32')} tokens as fp32 torch)")
    return {"checks": checks, "failed": failed}
