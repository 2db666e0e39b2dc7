"""Per-block seed search (SeedLM-style), estimated before building it: how much of a weight block's
energy the best of S hash vectors (with a fitted scale) captures, on SmolLM2 layer 5's MLP
down-projection, block 32; and how a plain hash base changes ||W - base||. Numbers quoted in README
("Proc-sparse on SmolLM2").

usage: python bench/proc_seed_search.py   (needs the cached SmolLM2 export; ~1 min)
"""
from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ortsparse.graph_rewrite.layers import survey
from ortsparse.zoo.models import model_path
from ortsparse.proc_sparse import hash_base

BLOCK = 32


def main() -> None:
    model = ir.load(str(model_path("smollm2", "full.torchscript")))
    layer = [x for x in survey(model).layers if x.role == "down" and x.rule is not None][5]
    w = layer.operands.weight.matrix().astype(np.float64)  # [K, N]
    k, n = w.shape
    blocks = w[: k // BLOCK * BLOCK].reshape(k // BLOCK, BLOCK, n).transpose(2, 0, 1).reshape(-1, BLOCK)
    energy = (blocks ** 2).sum(1)
    print(layer.name, w.shape, "weight std", w.std())
    for seeds in (1, 16, 256):
        # a codebook of `seeds` hash vectors (seed s, unit 0, k = 0..BLOCK-1), as SeedLM searches
        cand = np.stack([hash_base(s, 1.0, 0, np.arange(BLOCK)) for s in range(seeds)]).astype(np.float64)
        gain = (blocks @ cand.T) ** 2 / (cand ** 2).sum(1)  # energy captured with the best scale
        best = gain.max(1)
        print(f"S={seeds}: best-of-S seed + fitted scale captures {best.sum() / energy.sum():.3f} of block energy "
              f"(median per block {np.median(best / energy):.3f})")
    for scale in (0.01, 0.05):
        base = np.stack([hash_base(0, scale, j, np.arange(k)) for j in range(n)], axis=1)
        print(f"base_scale {scale}: ||W - base||^2 / ||W||^2 = {((w - base) ** 2).sum() / (w ** 2).sum():.3f}")


if __name__ == "__main__":
    main()
