#!/usr/bin/env python
"""Build ``models/tiny/gemma3_tiny_genai/``: the onnxruntime-genai model builder's fp32 CPU folder of
a random-weight Gemma-3-style model (``ortsparse.zoo.export_genai.build_tiny_gemma3``: 3
sliding-window layers of 8 keys and 1 global layer, hidden 64, vocab 256), with the builder's
defaults, so its sliding-window layers use window-sized KV buffers (GroupQueryAttention with
``sliding_window_cache=1``). Tests of such folders (the harness feeds, rewrite-onnx --attn, every
command) use it without torch.

Run:  python models/make_tiny_gemma3_genai.py            (needs the models extra; ~40 s)
      python models/make_tiny_gemma3_genai.py --check    (the Generator's greedy tokens == torch's)
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

from ortsparse.zoo.export_genai import greedy_ids

HERE = Path(__file__).resolve().parent
OUT = HERE / "tiny" / "gemma3_tiny_genai"
PROMPT_IDS = [int(i) for i in np.random.default_rng(0).integers(3, 256, 13)]
TOKENS = 48  # > 24 buffer rows (window 8 + 16): the windows wrap twice


def generator_greedy(folder: Path, ids=PROMPT_IDS, tokens: int = TOKENS) -> list[int]:
    return greedy_ids(folder, ids, tokens)


def torch_greedy(ids=PROMPT_IDS, tokens: int = TOKENS) -> list[int]:
    import torch
    from transformers import Gemma3ForCausalLM

    from ortsparse.zoo.export_genai import save_tiny_gemma3_hf

    with tempfile.TemporaryDirectory() as tmp:
        save_tiny_gemma3_hf(Path(tmp))
        model = Gemma3ForCausalLM.from_pretrained(tmp).eval()
    out = model.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False)
    return out[0, len(ids):].tolist()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare the committed folder with torch")
    args = parser.parse_args(argv)
    if not args.check:
        sys.path.insert(0, str(HERE.parent / "python"))
        from ortsparse.zoo.export_genai import build_tiny_gemma3

        build_tiny_gemma3(OUT)
    genai, reference = generator_greedy(OUT), torch_greedy()
    print(f"Generator greedy {genai}\ntorch     greedy {reference}")
    return 0 if genai == reference else 1


if __name__ == "__main__":
    raise SystemExit(main())
