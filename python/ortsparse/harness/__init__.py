"""The measurement harness: real trained models fetched and exported into a cache, quality
(perplexity, embedding cosine, output error), speed (tokens/s in the real decode loop), zoo validation,
sweeps and calibration. The protocol is summarised in docs/measure.md.

Layers (top to bottom; a module imports only from rows below its own, and from the package below
the harness: runtime, graph_rewrite, verify, benchmarking, rewrite_flags; pyproject.toml's
[tool.importlinter] enforces it):

- studies: ``calibrate``, ``event_workloads``, ``sweep``, ``zoo`` (``ortsparse validate``);
- commands that are libraries too: ``quality``, ``speed`` (``ortsparse bench``);
- measurements: ``perplexity``, ``embeddings``, ``output_error``, ``decode`` (the real decode loop),
  ``head_placement`` (where an ungated quantized LM head runs faster, timed on the machine);
- data: ``corpus`` (token windows, sentence sets), ``op_metrics`` (keep ratios from the counters),
  ``text`` (a text's token ids and the BOS its tokenizer adds);
- ``models`` (``ortsparse models``: the registry, ``model_path``, ``quantized_model``);
- ``baselines`` (MatMulNBits int4/int8), ``export_genai`` (onnxruntime-genai builder models);
- ``export_smollm2``, ``export_minilm`` (torch exporters);
- ``cache`` (where files live, atomic writes, build errors).

Heavy optional dependencies (torch, transformers, matplotlib) are imported inside the functions
that need them, so `ortsparse --help` and the fast tests do not load them.
"""
