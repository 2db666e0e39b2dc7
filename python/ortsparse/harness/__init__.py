"""The measurement harness: real trained models fetched and exported into a cache, quality
(perplexity, embedding cosine, output error), speed (prefill / decode tokens/s), zoo validation,
sweeps and calibration. The protocol is summarised in docs/measure.md.

Layout (each module imports only those listed before it, and the package below: runtime, the
rewriter, verify, benchmarking, rewrite_flags):

- data and the cache: ``cache`` (paths, atomic writes), ``export_smollm2`` / ``export_minilm``
  (torch exporters), ``baselines`` (MatMulNBits int4/int8), ``models`` (``ortsparse models``:
  the registry, ``model_path``), ``corpus`` (token windows, sentence sets);
- measurements: ``op_metrics`` (keep ratios from the op counters), ``perplexity``, ``embeddings``,
  ``output_error``, ``speed`` (``ortsparse bench``);
- commands and studies: ``quality``, ``zoo`` (``validate``), ``sweep``, ``calibrate``,
  ``event_workloads``.

Heavy optional dependencies (torch, transformers, matplotlib) are imported inside the functions
that need them, so `ortsparse --help` and the fast tests do not load them.
"""
