"""The measurement harness: real trained models fetched and exported into a cache, quality
(perplexity, embedding cosine, output error), speed (tokens/s in the real decode loop), zoo validation,
sweeps and calibration. The protocol is summarised in docs/measure.md.

Layers (top to bottom; a module imports only from rows below its own, and from the package below
the harness: runtime, graph_rewrite, verify, benchmarking, rewrite_flags; pyproject.toml's
[tool.importlinter] enforces it):

- commands and studies: ``bench`` (``ortsparse bench``), ``calibrate``, ``event_workloads``, ``sweep``,
  ``validate`` (``ortsparse validate``: the zoo);
- commands that are libraries too: ``quality``, and ``speed`` (decode tokens/s: ``bench``'s measurement,
  ``decode_speed``), ``allocation``; ``request`` (whole requests);
- measurements: ``perplexity``, ``embeddings``, ``output_error``, ``decode`` (the real decode loop),
  ``head_placement`` (where an ungated quantized LM head runs faster, timed on the machine);
- ``source``: the model a command names, resolved once (:class:`~.source.ModelSource`: folder, decoder
  file, graph, tokenizer, vocabulary, context length, KV layout, the rewriter's survey);
- data: ``corpus`` (token windows, sentence sets), ``op_metrics`` (keep ratios from the counters),
  ``text`` (a text's token ids and the BOS its tokenizer adds), ``genai_overrides``;
- ``models`` (``ortsparse models``: the registry of the cache's entries, ``model_path``, ``quantized_model``);
- builders: ``baselines`` (MatMulNBits int4/int8), ``export_corpus`` (the perplexity corpus),
  ``export_genai`` (onnxruntime-genai builder models), ``llama_cpp`` (the peer row);
- ``builds`` (how an entry is built and recorded: specs, manifests, staleness);
- ``packages`` (PyPI packages: installed, or downloaded archives);
- ``export_smollm2``, ``export_minilm`` (torch exporters);
- ``cache`` (where files live, atomic writes, build errors).

Heavy optional dependencies (torch, transformers, matplotlib) are imported inside the functions
that need them, so `ortsparse --help` and the fast tests do not load them.
"""
