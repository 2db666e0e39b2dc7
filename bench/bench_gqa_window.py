#!/usr/bin/env python
"""Decode steps of one sliding-window layer on window-sized KV buffers (GroupQueryAttention
sliding_window_cache=1): onnxruntime's op against PopcountGroupQueryAttention with exact attention
(select=none), one buffer bound as past and present (as onnxruntime-genai binds it), 1 thread,
alternating A/B every step; prints median microseconds per step and the largest output difference.

Default shape: a Gemma-3-1B layer (4 query / 1 KV heads, head size 256, window 512, buffer
512 + 16 rows as the Generator sizes it on CPU), 1024 steps after a 512-token prompt.

Run:  python bench/bench_gqa_window.py [--steps N] [--window W] [--heads H] [--kv-heads HKV] [--head-size D]
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

import ortsparse


def session(args, ours: bool) -> ort.InferenceSession:
    attrs = dict(num_heads=args.heads, kv_num_heads=args.kv_heads, local_window_size=args.window, do_rotary=1,
                 sliding_window_cache=1)
    if ours:
        attrs["select"] = "none"
    inputs = ["query", "key", "value", "past_key", "past_value", "seqlens_k", "total", "cos", "sin"]
    node = helper.make_node("PopcountGroupQueryAttention" if ours else "GroupQueryAttention", inputs,
                            ["output", "present_key", "present_value"], domain="ai.ortsparse" if ours else "com.microsoft",
                            **attrs)
    f, d = TensorProto.FLOAT, args.head_size
    graph = helper.make_graph([node], "layer", [
        helper.make_tensor_value_info("query", f, [1, "s", args.heads * d]),
        helper.make_tensor_value_info("key", f, [1, "s", args.kv_heads * d]),
        helper.make_tensor_value_info("value", f, [1, "s", args.kv_heads * d]),
        helper.make_tensor_value_info("past_key", f, [1, args.kv_heads, "c", d]),
        helper.make_tensor_value_info("past_value", f, [1, args.kv_heads, "c", d]),
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
        helper.make_tensor_value_info("total", TensorProto.INT32, [1]),
        helper.make_tensor_value_info("cos", f, ["r", d // 2]), helper.make_tensor_value_info("sin", f, ["r", d // 2])],
        [helper.make_tensor_value_info(n, f, None) for n in ("output", "present_key", "present_value")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1),
                                                    helper.make_opsetid("ai.ortsparse", 1)], ir_version=9)
    options = ortsparse.session_options() if ours else ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


class Layer:
    """One session with its shared K/V buffer."""

    def __init__(self, sess, args, tables):
        self.sess, self.tables = sess, tables
        shape = (1, args.kv_heads, args.window + 16, args.head_size)
        self.k = ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, np.float32))
        self.v = ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, np.float32))

    def step(self, q, k, v, total: int) -> np.ndarray:
        binding = self.sess.io_binding()
        feeds = {"query": q, "key": k, "value": v, "seqlens_k": np.array([total - 1], np.int32),
                 "total": np.array([total], np.int32), "cos": self.tables[0], "sin": self.tables[1]}
        for name, array in feeds.items():
            binding.bind_cpu_input(name, array)
        binding.bind_ortvalue_input("past_key", self.k)
        binding.bind_ortvalue_input("past_value", self.v)
        binding.bind_output("output")
        binding.bind_ortvalue_output("present_key", self.k)
        binding.bind_ortvalue_output("present_value", self.v)
        self.sess.run_with_iobinding(binding)
        return binding.copy_outputs_to_cpu()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1024)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--head-size", type=int, default=256)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    angle = rng.random((args.prompt + args.steps + 1, args.head_size // 2), dtype=np.float32) * np.float32(6.2832)
    tables = (np.cos(angle), np.sin(angle))
    layers = {"onnxruntime": Layer(session(args, False), args, tables), "ortsparse": Layer(session(args, True), args, tables)}

    def rows(s):
        return tuple(rng.standard_normal((1, s, n * args.head_size), dtype=np.float32)
                     for n in (args.heads, args.kv_heads, args.kv_heads))

    prompt = rows(args.prompt)
    for layer in layers.values():
        layer.step(*prompt, args.prompt)
    times = {name: [] for name in layers}
    diff = 0.0
    for total in range(args.prompt + 1, args.prompt + args.steps + 1):
        step = rows(1)
        out = {}
        for name in (list(layers) if total % 2 else list(layers)[::-1]):
            started = time.perf_counter()
            out[name] = layers[name].step(*step, total)
            times[name].append(time.perf_counter() - started)
        diff = max(diff, float(np.abs(out["ortsparse"] - out["onnxruntime"]).max() / np.abs(out["onnxruntime"]).max()))
    median = {name: 1e6 * float(np.median(t)) for name, t in times.items()}
    print(f"H={args.heads} Hkv={args.kv_heads} D={args.head_size} window {args.window} (buffer {args.window + 16}), "
          f"{args.steps} steps after {args.prompt}: median us/step onnxruntime {median['onnxruntime']:.1f}, "
          f"ortsparse {median['ortsparse']:.1f} ({median['onnxruntime'] / median['ortsparse']:.2f}x); "
          f"max |diff| / max |out| {diff:.1e}")


if __name__ == "__main__":
    main()
