"""PopcountGroupQueryAttention on real SmolLM2 attention (the onnxruntime-genai fp32 decoder):
speed per layer against com.microsoft.GroupQueryAttention, output cosine against exact attention,
perplexity through the whole model, decode tokens/s of genai folders.

    python bench/bench_gqa.py capture --length 4096 --offset 0 -o /tmp/capture_4k.npz
    python bench/bench_gqa.py layer /tmp/capture_4k.npz --contexts 1024 2048 4096 --variants select=none \\
        select=pages,topk=256,candidates=3,keep_first=4,keep_recent=256,min_keys=2048
    python bench/bench_gqa.py cosine /tmp/capture_4k.npz --variants select=pages,topk=256,...
    python bench/bench_gqa.py ppl --windows 2 --length 4096 --variants select=pages,topk=256,...
    python bench/bench_gqa.py e2e --prompt 4032 --tokens 64 --rounds 4 FOLDER_A FOLDER_B ...

capture: one window of corpus tokens through the decoder as one prompt (onnxruntime); keeps per
layer the present K/V (rotated) and the packed QKV of every position, and the rotary caches.
layer: 30 nodes (one per layer, own KV buffer bound as past and present, as genai does) per
session; each buffer is filled by a first prompt through the node itself (so the kernel wrote
every row, as in a real decode), then the decode step at position context-1 is timed; sessions
alternate within a round, and speedups are medians over rounds of the paired ratio.
cosine: per layer, the last Q positions as one later-prompt call over the captured past; each
query row selects over its own causal prefix, as at decode.
ppl: teacher-forced windows, each one prompt (every row selects over its prefix as the decode step
at its position would; rows with fewer than min_keys keys are exact, as at decode).
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

from ortsparse.benchmarking import op_attributes
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

import ortsparse

MODELS = Path.home() / ".cache" / "ortsparse" / "models" / "smollm2"
DECODER = MODELS / "genai-fp32" / "model.onnx"
CORPUS = MODELS / "corpus_britannica.npy"
H, HKV, D, LAYERS = 9, 3, 64, 30


def attributes(text: str) -> dict:
    """'select=pages,topk=256' -> {'select': 'pages', 'topk': 256} (ortsparse.benchmarking.op_attributes)."""
    try:
        return op_attributes(text)
    except ValueError as error:
        raise SystemExit(f"bench_gqa: --variants entry {error}") from None


def external_initializer(graph, name: str, data_path: Path) -> np.ndarray:
    for init in graph.initializer:
        if init.name == name:
            info = {e.key: e.value for e in init.external_data}
            with open(data_path, "rb") as f:
                f.seek(int(info.get("offset", 0)))
                raw = f.read(int(info["length"]))
            return np.frombuffer(raw, np.float32).reshape(tuple(init.dims)).copy()
    raise KeyError(name)


def capture(args) -> None:
    model = onnx.load(str(DECODER), load_external_data=False)
    qkv = [n.input[0] for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    for name in qkv:
        model.graph.output.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, None))
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    session = edited_session(model, options)
    ids = np.load(CORPUS)[args.offset:args.offset + args.length].astype(np.int64)[None]
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    for spec in session.get_inputs():
        if spec.name.startswith("past_key_values"):
            feeds[spec.name] = np.zeros((1, HKV, 0, D), np.float32)
    outputs = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    saved = {}
    for layer in range(LAYERS):
        saved[f"k{layer}"] = outputs[f"present.{layer}.key"][0]
        saved[f"v{layer}"] = outputs[f"present.{layer}.value"][0]
        saved[f"qkv{layer}"] = outputs[qkv[layer]][0]
    for name in ("cos_cache", "sin_cache"):
        saved[name] = external_initializer(model.graph, name, DECODER.parent / "model.onnx.data")
    np.savez(args.output, **saved)
    print(f"{args.output}: {args.length} tokens from offset {args.offset}")


def layer_model(ours: bool, attrs: dict, layers: int, name: str) -> bytes:
    f, i32 = TensorProto.FLOAT, TensorProto.INT32
    inputs = [helper.make_tensor_value_info("seqlens_k", i32, [1]), helper.make_tensor_value_info("total", i32, [1]),
              helper.make_tensor_value_info("cos", f, ["r", 32]), helper.make_tensor_value_info("sin", f, ["r", 32])]
    outputs, nodes = [], []
    for layer in range(layers):
        inputs += [helper.make_tensor_value_info(f"q{layer}", f, [1, "S", (H + 2 * HKV) * D]),
                   helper.make_tensor_value_info(f"pk{layer}", f, [1, HKV, "L", D]),
                   helper.make_tensor_value_info(f"pv{layer}", f, [1, HKV, "L", D])]
        outputs += [helper.make_tensor_value_info(f"y{layer}", f, [1, "S", H * D]),
                    helper.make_tensor_value_info(f"k{layer}", f, [1, HKV, "L", D]),
                    helper.make_tensor_value_info(f"v{layer}", f, [1, HKV, "L", D])]
        nodes.append(helper.make_node(
            "PopcountGroupQueryAttention" if ours else "GroupQueryAttention",
            [f"q{layer}", "", "", f"pk{layer}", f"pv{layer}", "seqlens_k", "total", "cos", "sin"],
            [f"y{layer}", f"k{layer}", f"v{layer}"], name=f"{name}_{layer}",
            domain="ai.ortsparse" if ours else "com.microsoft", num_heads=H, kv_num_heads=HKV, scale=0.125,
            do_rotary=1, rotary_interleaved=0, local_window_size=-1, softcap=0.0, **(attrs if ours else {})))
    graph = helper.make_graph(nodes, "layers", inputs, outputs)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1), helper.make_opsetid("ai.ortsparse", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=9).SerializeToString()


def layer(args) -> None:
    cap = np.load(args.capture)
    variants = [("ort_gqa", False, {})] + [(v, True, attributes(v)) for v in args.variants]
    for context in args.contexts:
        runs = []
        for index, (name, ours, attrs) in enumerate(variants):
            options = ortsparse.session_options() if ours else ort.SessionOptions()
            options.intra_op_num_threads, options.inter_op_num_threads = args.threads, 1
            session = ort.InferenceSession(layer_model(ours, attrs, args.layers, f"v{index}"), options,
                                           providers=["CPUExecutionProvider"])
            buffers = [[np.zeros((1, HKV, context, D), np.float32) for _ in range(2)] for _ in range(args.layers)]
            values = [[ort.OrtValue.ortvalue_from_numpy(b) for b in pair] for pair in buffers]

            def binding(first, count, session=session, values=values):
                b = session.io_binding()
                b.bind_cpu_input("seqlens_k", np.array([first + count - 1], np.int32))
                b.bind_cpu_input("total", np.array([first + count], np.int32))
                b.bind_cpu_input("cos", cap["cos_cache"])
                b.bind_cpu_input("sin", cap["sin_cache"])
                for i in range(args.layers):
                    b.bind_cpu_input(f"q{i}", np.ascontiguousarray(cap[f"qkv{i}"][first:first + count][None]))
                    b.bind_ortvalue_input(f"pk{i}", values[i][0])
                    b.bind_ortvalue_input(f"pv{i}", values[i][1])
                    b.bind_output(f"y{i}")
                    b.bind_ortvalue_output(f"k{i}", values[i][0])
                    b.bind_ortvalue_output(f"v{i}", values[i][1])
                return b

            session.run_with_iobinding(binding(0, context - 1))  # the prompt: the node writes every row
            runs.append((name, session, binding(context - 1, 1), buffers, values))
        times = {name: [] for name, *_ in runs}
        for round_ in range(args.rounds + 2):
            for name, session, b, *_ in runs:
                start = time.perf_counter()
                session.run_with_iobinding(b)
                if round_ >= 2:
                    times[name].append(time.perf_counter() - start)
        base = np.array(times["ort_gqa"])
        cells = [f"{name}: {np.median(t) / args.layers * 1e6:.0f} us ({np.median(base / np.array(t)):.2f}x)"
                 for name, t in times.items()]
        print(f"context {context}, per layer: " + "; ".join(cells), flush=True)


def cosine(args) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.ops import gqa_graphs as G

    cap = np.load(args.capture)
    length, q = cap["k0"].shape[1], args.queries
    cfg = G.Gqa(num_heads=H, kv_num_heads=HKV, head_size=D, packed=True, rotary=True, scale=0.125)
    sessions = {v: G.session(cfg, ours=True, **attributes(v)) for v in ["select=none", *args.variants]}
    cos = {v: [] for v in args.variants}
    for layer_ in range(LAYERS):
        outs = {}
        for v, session in sessions.items():
            past_k = np.zeros((1, HKV, length, D), np.float32)
            past_v = np.zeros((1, HKV, length, D), np.float32)
            past_k[0, :, :length - q] = cap[f"k{layer_}"][:, :length - q]
            past_v[0, :, :length - q] = cap[f"v{layer_}"][:, :length - q]
            stepper = G.Stepper(session, cfg, batch=1, buffer=length, shared=True, cos=cap["cos_cache"],
                                sin=cap["sin_cache"], past_k=past_k, past_v=past_v)
            outs[v] = stepper.step(cap[f"qkv{layer_}"][length - q:][None], None, None, [length - 1], length)[0]
        exact = outs["select=none"].reshape(q, H, D)
        for v in args.variants:
            y = outs[v].reshape(q, H, D)
            cos[v].append(((y * exact).sum(-1) / np.linalg.norm(y, axis=-1) / np.linalg.norm(exact, axis=-1)).ravel())
    for v, values in cos.items():
        c = np.concatenate(values)
        print(f"context {length}, {v}: cosine mean {c.mean():.4f} p01 {np.percentile(c, 1):.4f} min {c.min():.4f} "
              f"({c.size} query rows x heads)")


def perplexity(args) -> None:
    corpus = np.load(CORPUS)

    def run(v):
        model = onnx.load(str(DECODER), load_external_data=False)
        if v is not None:
            for node in model.graph.node:
                if node.op_type == "GroupQueryAttention":
                    node.op_type, node.domain = "PopcountGroupQueryAttention", "ai.ortsparse"
                    node.attribute.extend(helper.make_attribute(k, x) for k, x in attributes(v).items())
            model.opset_import.append(helper.make_opsetid("ai.ortsparse", 1))
        options = ortsparse.session_options() if v else ort.SessionOptions()
        options.intra_op_num_threads = args.threads
        session = edited_session(model, options)
        ortsparse.reset_metrics()
        nll, predictions = [], []
        for w in range(args.windows):
            ids = corpus[args.offset + w * args.length: args.offset + (w + 1) * args.length].astype(np.int64)[None]
            feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
            for spec in session.get_inputs():
                if spec.name.startswith("past_key_values"):
                    feeds[spec.name] = np.zeros((1, HKV, 0, D), np.float32)
            logits = session.run(["logits"], feeds)[0][0, :-1].astype(np.float64)
            top = logits.max(-1, keepdims=True)
            lse = np.log(np.exp(logits - top).sum(-1)) + top[:, 0]
            nll.append(lse - logits[np.arange(len(logits)), ids[0, 1:]])
            predictions.append(logits.argmax(-1))
        metrics = ortsparse.metrics().get("total/PopcountGroupQueryAttention", {})
        return math.exp(np.concatenate(nll).mean()), np.concatenate(predictions), metrics

    base, base_pred, _ = run(None)
    print(f"onnxruntime GroupQueryAttention: ppl {base:.4f}")
    for v in args.variants:
        ppl, pred, m = run(v)
        print(f"{v}: ppl {ppl:.4f} dppl {100 * (ppl / base - 1):+.2f}% top1 {np.mean(pred == base_pred):.4f} "
              f"keys scored {m.get('pack.keys_exact_ratio', 1):.3f} pages visited {m.get('pages.visited_ratio', 0):.3f}",
              flush=True)


def edited_session(model, options):
    """A session of an edited copy of the decoder: its weights (external data in the model folder,
    which is never written) are loaded into the graph in memory."""
    from onnx.external_data_helper import load_external_data_for_model

    load_external_data_for_model(model, str(DECODER.parent))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def e2e(args) -> None:
    import onnxruntime_genai as og

    ids = np.load(CORPUS)[:args.prompt].astype(np.int32)
    models = {f: og.Model(f) for f in args.folders}
    steps, tokens = {f: [] for f in args.folders}, {}
    for round_ in range(args.rounds):
        for folder in args.folders:
            params = og.GeneratorParams(models[folder])
            params.set_search_options(do_sample=False, max_length=args.prompt + args.tokens + 1, batch_size=1)
            generator = og.Generator(models[folder], params)
            generator.append_tokens(ids)
            times, out = [], []
            for _ in range(args.tokens):
                start = time.perf_counter()
                generator.generate_next_token()
                times.append(time.perf_counter() - start)
                out.append(int(generator.get_next_tokens()[0]))
            if round_ > 0 or args.rounds == 1:  # round 0 warms the models up
                steps[folder].append(np.median(times))
            tokens[folder] = out
    base = args.folders[0]
    for folder in args.folders:
        agree = np.mean(np.array(tokens[folder]) == np.array(tokens[base]))
        print(f"{Path(folder).name}: {1 / np.median(steps[folder]):.1f} tok/s "
              f"({np.median(steps[base]) / np.median(steps[folder]):.2f}x), greedy tokens equal to the first "
              f"folder's: {agree:.2f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("capture")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--offset", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("-o", "--output", required=True)
    p.set_defaults(run=capture)
    p = sub.add_parser("layer")
    p.add_argument("capture")
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--variants", nargs="+", default=["select=none"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--layers", type=int, default=LAYERS)
    p.set_defaults(run=layer)
    p = sub.add_parser("cosine")
    p.add_argument("capture")
    p.add_argument("--queries", type=int, default=64)
    p.add_argument("--variants", nargs="+", required=True)
    p.set_defaults(run=cosine)
    p = sub.add_parser("ppl")
    p.add_argument("--windows", type=int, default=2)
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--offset", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--variants", nargs="+", required=True)
    p.set_defaults(run=perplexity)
    p = sub.add_parser("e2e")
    p.add_argument("--prompt", type=int, default=4032)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("folders", nargs="+")
    p.set_defaults(run=e2e)
    args = parser.parse_args(argv)
    args.run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
