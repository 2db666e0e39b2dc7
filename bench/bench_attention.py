"""Decode-step attention: PopcountAttention vs ONNX Runtime's own attention, same process,
alternating A B A B, medians.

One decode step = one query token per head against a KV cache of `ctx` tokens, for `--layers`
layers (one node per layer, each with its own K/V, so the caches stream from memory as in a real
model and Python's per-Run overhead is amortised). Shapes default to SmolLM2-135M (9 query heads,
3 KV heads, head dim 64, 30 layers). Inputs are generated (Gaussian), so the timing is realistic but
the output cosine of top-k variants is not: random keys give near-uniform attention, where any
top-k is a poor approximation. Quality on real attention: bench/attention_quality.py.

Candidates:
- ort_decomposed: MatMul(Q, K^T) -> Mul(scale) -> Softmax -> MatMul(P, V), with repeat_kv as
  Unsqueeze/Expand/Reshape (the pattern of a torch export of a GQA model);
- ort_mha: com.microsoft MultiHeadAttention with K/V already repeated to H heads (BNSH);
- ort_gqa: com.microsoft GroupQueryAttention with past_key/past_value of ctx-1 tokens + 1 new token
  (it also writes present_key/present_value, as it does in a real decode loop);
- pop_exact: PopcountAttention select=none;
- pop[<attributes>]: PopcountAttention variants (--variants). Packed keys are reused across calls:
  the timed calls see an unchanged cache, i.e. the steady state where one row per step is packed;
  a variant with pack_cache=0 packs all keys every call (the first decode step after a prefill).

usage: python bench/bench_attention.py [--quick] [--contexts 512 2048 4096 8192] [--threads 1]
       [--variants "mode=sign,topk=256" ...] [-o reports/attention]
"""
from __future__ import annotations

import argparse
import math
import sys

import numpy as np
from onnx import TensorProto, helper

from ortsparse.benchmarking import command_line, machine_info, median, report_header, session, time_sessions, write_report

MS = "com.microsoft"


def opsets():
    return [helper.make_opsetid("", 17), helper.make_opsetid("ai.ortsparse", 1), helper.make_opsetid(MS, 1)]


def tensor(name, dims, elem=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem, dims)


def decomposed_model(layers, h, hkv, d, scale):
    nodes, inits = [], []
    g = h // hkv
    inits.append(helper.make_tensor("axes2", TensorProto.INT64, [1], [2]))
    inits.append(helper.make_tensor("scale", TensorProto.FLOAT, [], [scale]))
    inits.append(helper.make_tensor("expand_shape", TensorProto.INT64, [5], [1, 1, g, 1, 1]))
    inits.append(helper.make_tensor("flat_shape", TensorProto.INT64, [4], [0, h, -1, d]))
    inputs = [tensor("Q", [1, h, 1, d])]
    outputs = []
    for i in range(layers):
        inputs += [tensor(f"K{i}", [1, hkv, "ctx", d]), tensor(f"V{i}", [1, hkv, "ctx", d])]
        for x in ("K", "V"):
            nodes += [helper.make_node("Unsqueeze", [f"{x}{i}", "axes2"], [f"{x}{i}_u"]),
                      helper.make_node("Expand", [f"{x}{i}_u", "expand_shape"], [f"{x}{i}_e"]),
                      helper.make_node("Reshape", [f"{x}{i}_e", "flat_shape"], [f"{x}{i}_r"])]
        nodes += [helper.make_node("Transpose", [f"K{i}_r"], [f"K{i}_t"], perm=[0, 1, 3, 2]),
                  helper.make_node("MatMul", ["Q", f"K{i}_t"], [f"S{i}"]),
                  helper.make_node("Mul", [f"S{i}", "scale"], [f"S{i}_s"]),
                  helper.make_node("Softmax", [f"S{i}_s"], [f"P{i}"], axis=-1),
                  helper.make_node("MatMul", [f"P{i}", f"V{i}_r"], [f"Y{i}"])]
        outputs.append(tensor(f"Y{i}", None))
    graph = helper.make_graph(nodes, "decomposed", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=opsets())


def mha_model(layers, h, d):
    nodes, inputs, outputs = [], [tensor("Q3", [1, 1, h * d])], []
    for i in range(layers):
        inputs += [tensor(f"KE{i}", [1, h, "ctx", d]), tensor(f"VE{i}", [1, h, "ctx", d])]
        nodes.append(helper.make_node("MultiHeadAttention", ["Q3", f"KE{i}", f"VE{i}"], [f"Y{i}"], domain=MS,
                                      num_heads=h))
        outputs.append(tensor(f"Y{i}", None))
    return helper.make_model(helper.make_graph(nodes, "mha", inputs, outputs), opset_imports=opsets())


def gqa_model(layers, h, hkv, d):
    nodes, outputs = [], []
    inputs = [tensor("Q3", [1, 1, h * d]), tensor("seqlens_k", [1], TensorProto.INT32),
              tensor("total_len", [], TensorProto.INT32)]
    for i in range(layers):
        inputs += [tensor(f"Knew{i}", [1, 1, hkv * d]), tensor(f"Vnew{i}", [1, 1, hkv * d]),
                   tensor(f"PK{i}", [1, hkv, "past", d]), tensor(f"PV{i}", [1, hkv, "past", d])]
        nodes.append(helper.make_node(
            "GroupQueryAttention", ["Q3", f"Knew{i}", f"Vnew{i}", f"PK{i}", f"PV{i}", "seqlens_k", "total_len"],
            [f"Y{i}", f"PKo{i}", f"PVo{i}"], domain=MS, num_heads=h, kv_num_heads=hkv))
        outputs += [tensor(f"Y{i}", None), tensor(f"PKo{i}", None), tensor(f"PVo{i}", None)]
    return helper.make_model(helper.make_graph(nodes, "gqa", inputs, outputs), opset_imports=opsets())


def pop_model(layers, h, hkv, d, **attrs):
    nodes, inputs, outputs = [], [tensor("Q", [1, h, 1, d])], []
    for i in range(layers):
        inputs += [tensor(f"K{i}", [1, hkv, "ctx", d]), tensor(f"V{i}", [1, hkv, "ctx", d])]
        nodes.append(helper.make_node("PopcountAttention", ["Q", f"K{i}", f"V{i}"], [f"Y{i}"], name=f"pop{i}",
                                      domain="ai.ortsparse", **attrs))
        outputs.append(tensor(f"Y{i}", None))
    return helper.make_model(helper.make_graph(nodes, "pop", inputs, outputs), opset_imports=opsets())


def cosine(a, b):
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))


DEFAULT_VARIANTS = [
    "mode=sign,topk=256,center=0",
    "mode=sign,topk=256",
    "mode=sign,topk=256,candidates=4,keep_first=4,keep_recent=64",
    "mode=sign,topk=256,proj_bits=256,candidates=4,keep_first=4,keep_recent=64",
    "mode=sign,topk=128,proj_bits=256,candidates=4,keep_first=4,keep_recent=64",
    "mode=sign,topk=128,proj_bits=256,candidates=2,keep_first=4,keep_recent=32",
    "mode=ternary,eps=0.5,topk=256,candidates=4,keep_first=4,keep_recent=64",
    "select=energy,topk=256,keep_first=4,keep_recent=64",
    "mode=sign,topk=256,proj_bits=256,candidates=4,keep_first=4,keep_recent=64,pack_cache=0",
]
_INTS = {"topk", "keep_first", "keep_recent", "proj_bits", "center", "min_keys", "pack_cache"}


def parse_variant(text):
    """Comma-separated attribute=value pairs of PopcountAttention (select defaults to popcount)."""
    out = {"select": "popcount", "density_max": 1.0}
    for part in text.split(","):
        key, _, value = part.partition("=")
        out[key] = value if key in ("select", "mode") else int(value) if key in _INTS else float(value)
    return out


def pop_variants(args):
    out = {"pop_exact": dict(select="none")}
    for text in args.variants:
        out["pop[" + text + "]"] = parse_variant(text)
    for attrs in out.values():
        attrs["min_keys"] = 0
        attrs["is_causal"] = 1
    return out


def run_context(ctx, threads, args, rng):
    h, hkv, d, layers = args.heads, args.kv_heads, args.head_dim, args.layers
    scale = 1.0 / math.sqrt(d)
    q = rng.standard_normal((1, h, 1, d)).astype(np.float32)
    ks = [rng.standard_normal((1, hkv, ctx, d)).astype(np.float32) for _ in range(layers)]
    vs = [rng.standard_normal((1, hkv, ctx, d)).astype(np.float32) for _ in range(layers)]
    q3 = q.transpose(0, 2, 1, 3).reshape(1, 1, h * d).copy()
    feeds_kv = {}
    for i in range(layers):
        feeds_kv[f"K{i}"], feeds_kv[f"V{i}"] = ks[i], vs[i]
    sessions, feeds = {}, {}

    sessions["ort_decomposed"] = session(decomposed_model(layers, h, hkv, d, scale), threads)
    feeds["ort_decomposed"] = dict(feeds_kv, Q=q)

    if not args.no_contrib:
        g = h // hkv
        f_mha = {"Q3": q3}
        for i in range(layers):
            f_mha[f"KE{i}"] = np.repeat(ks[i], g, axis=1)
            f_mha[f"VE{i}"] = np.repeat(vs[i], g, axis=1)
        sessions["ort_mha"], feeds["ort_mha"] = session(mha_model(layers, h, d), threads), f_mha
        f_gqa = {"Q3": q3, "seqlens_k": np.array([ctx - 1], np.int32), "total_len": np.array(ctx, np.int32)}
        for i in range(layers):
            f_gqa[f"Knew{i}"] = ks[i][:, :, -1:].transpose(0, 2, 1, 3).reshape(1, 1, hkv * d).copy()
            f_gqa[f"Vnew{i}"] = vs[i][:, :, -1:].transpose(0, 2, 1, 3).reshape(1, 1, hkv * d).copy()
            f_gqa[f"PK{i}"] = np.ascontiguousarray(ks[i][:, :, :-1])
            f_gqa[f"PV{i}"] = np.ascontiguousarray(vs[i][:, :, :-1])
        sessions["ort_gqa"], feeds["ort_gqa"] = session(gqa_model(layers, h, hkv, d), threads), f_gqa

    f_pop = dict(feeds_kv, Q=q)
    for name, attrs in pop_variants(args).items():
        sessions[name], feeds[name] = session(pop_model(layers, h, hkv, d, **attrs), threads), f_pop

    outputs = {name: s.run(None, feeds[name])[0] for name, s in sessions.items()}
    reference = outputs["ort_decomposed"].reshape(1, h, 1, d)
    times = time_sessions(sessions, feeds, repeats=args.repeats, warmup=2, min_seconds=args.min_seconds,
                          per_session=True)
    rows = []
    for name in sessions:
        y = outputs[name]
        y = y.reshape(1, 1, h, d).transpose(0, 2, 1, 3) if name in ("ort_mha", "ort_gqa") else y.reshape(1, h, 1, d)
        rows.append({"ctx": ctx, "threads": threads, "candidate": name,
                     "us_per_layer": median(times[name]) / layers * 1e6, "cosine_vs_exact": cosine(y, reference)})
    base = {r["candidate"]: r["us_per_layer"] for r in rows}
    for r in rows:
        for ref_name in ("ort_decomposed", "ort_mha", "ort_gqa"):
            if ref_name in base:
                r[f"speedup_vs_{ref_name}"] = base[ref_name] / r["us_per_layer"]
    return rows


def markdown(rows, args, command, info):
    refs = [r for r in ("ort_decomposed", "ort_mha", "ort_gqa") if any(f"speedup_vs_{r}" in x for x in rows)]
    lines = report_header("Decode attention: PopcountAttention vs ORT", command, info)
    lines += [f"H={args.heads} Hkv={args.kv_heads} D={args.head_dim}, {args.layers} layers per Run, generated "
             "Gaussian inputs (cosine vs exact is NOT representative of real attention; see "
             "bench/attention_quality.py).", "",
             "| ctx | threads | candidate | us/layer | " + " | ".join(f"x vs {r}" for r in refs) + " | cosine |",
             "|---|---|---|---|" + "---|" * len(refs) + "---|"]
    for r in rows:
        lines.append(f"| {r['ctx']} | {r['threads']} | {r['candidate']} | {r['us_per_layer']:.1f} | "
                     + " | ".join(f"{r.get(f'speedup_vs_{x}', float('nan')):.2f}" for x in refs)
                     + f" | {r['cosine_vs_exact']:.4f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 4096, 8192])
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--variants", nargs="*", default=DEFAULT_VARIANTS,
                        help="PopcountAttention attribute sets, 'attr=value,...' (select=popcount, min_keys=0, "
                             "is_causal=1, density_max=1 unless given)")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--min-seconds", type=float, default=2.0, help="per context and thread count")
    parser.add_argument("--no-contrib", action="store_true", help="skip MultiHeadAttention / GroupQueryAttention")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, few repeats")
    parser.add_argument("-o", "--output", default="reports/attention")
    args = parser.parse_args(argv)
    if args.quick:
        args.contexts, args.layers, args.repeats, args.min_seconds = [300], 2, 3, 0.0
        args.variants = ["mode=sign,topk=64", "mode=sign,topk=32,proj_bits=128,candidates=2,keep_first=2,keep_recent=8",
                         "select=energy,topk=64"]
    if args.heads % args.kv_heads:
        parser.error("--heads must be a multiple of --kv-heads")
    rng = np.random.default_rng(0)
    rows = []
    for threads in args.threads:
        for ctx in args.contexts:
            rows += run_context(ctx, threads, args, rng)
            print(f"ctx {ctx} threads {threads} done", file=sys.stderr)
    command, info = command_line("python bench/bench_attention.py", argv), machine_info()
    md = markdown(rows, args, command, info)
    payload = {"machine": info, "command": command, "args": vars(args), "rows": rows}
    json_path, md_path = write_report(args.output, payload, md)
    print(md)
    print(f"wrote {json_path} and {md_path}", file=sys.stderr)
    bad = [r for r in rows if r["candidate"] in ("pop_exact", "ort_mha", "ort_gqa") and r["cosine_vs_exact"] < 0.9999]
    if bad:
        print(f"exact candidates disagree with ort_decomposed: {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
