#!/usr/bin/env python
"""Build ``models/tiny/llama_tiny_genai/``: the onnxruntime-genai model builder's fp32 CPU model of
``llama_tiny`` (same config and fixed-seed weights as ``make_tiny_models.py``), for tests of genai
folders (rewrite-onnx on a folder, the Generator path of the decode loop, quality on a
GroupQueryAttention graph) without torch.

The builder needs an HF folder with a tokenizer: the weights are saved with ``save_pretrained`` and
a word-level tokenizer of the 256 ids (one character per id) is made with ``tokenizers``.

Run:  python models/make_tiny_genai.py             (needs torch, transformers, onnxruntime-genai)
      python models/make_tiny_genai.py --check     (ORT on the folder's graph == llama_tiny's full export)
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
OUT = HERE / "tiny" / "llama_tiny_genai"
KEEP = ("genai_config.json", "model.onnx", "model.onnx.data", "tokenizer.json", "tokenizer_config.json")


def save_hf_folder(dest: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    sys.path.insert(0, str(HERE))
    import make_tiny_models as tiny

    spec = next(s for s in tiny.SPECS if s.name == "llama_tiny")
    model, _ = tiny.build_model(spec)
    model.config.use_cache = True
    model.save_pretrained(dest)
    vocab = {(f"<{i}>" if i < 3 else chr(0x100 + i)): i for i in range(tiny.VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<1>", eos_token="<2>", unk_token="<0>")
    fast.save_pretrained(dest)


def build(out: Path = OUT) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        hf, built = Path(tmp) / "hf", Path(tmp) / "genai"
        save_hf_folder(hf)
        subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-m", str(hf), "-o", str(built),
                        "-p", "fp32", "-e", "cpu", "-c", str(Path(tmp) / "cache")], check=True, capture_output=True)
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        for name in KEEP:
            shutil.copy2(built / name, out / name)
    print(f"wrote {out}: {', '.join(KEEP)}")


def check(out: Path = OUT) -> float:
    """Max |logits| difference between the genai graph (empty past) and llama_tiny's full export."""
    import onnxruntime as ort

    tokens = np.random.default_rng(0).integers(0, 256, size=(1, 40))
    config = json.loads((out / "genai_config.json").read_text())["model"]["decoder"]
    genai = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    feeds = {"input_ids": tokens, "attention_mask": np.ones_like(tokens)}
    for spec in genai.get_inputs():
        if spec.name.startswith("past_key_values."):
            feeds[spec.name] = np.zeros((1, config["num_key_value_heads"], 0, config["head_size"]), np.float32)
    got = genai.run(["logits"], feeds)[0]
    full = ort.InferenceSession(str(HERE / "tiny" / "llama_tiny.torchscript.onnx"), providers=["CPUExecutionProvider"])
    want = full.run(["logits"], {"input_ids": tokens, "attention_mask": np.ones_like(tokens),
                                 "position_ids": np.arange(40)[None]})[0]
    return float(np.abs(got - want).max())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare the committed folder with llama_tiny")
    args = parser.parse_args(argv)
    if not args.check:
        build()
    diff = check()
    print(f"genai graph vs llama_tiny.torchscript logits: max abs diff {diff:.2e}")
    return 0 if diff < 1e-4 else 1


if __name__ == "__main__":
    raise SystemExit(main())
