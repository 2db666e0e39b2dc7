"""The measurement library: quality (perplexity, embedding cosine, output error, answers at the point
of use) and speed (tokens/s in the real decode loop, whole requests) of a model against its rewrite.
The protocol is summarised in docs/measure.md.

Layers (top to bottom; a module imports only from rows below its own, and from :mod:`ortsparse.zoo`
and the packages below it; pyproject.toml's [tool.importlinter] enforces it):

- ``speed`` (decode tokens/s: ``ortsparse bench``'s measurement, ``decode_speed``), ``request``
  (whole requests), ``answer_quality`` (answers teacher-forced at the point of use);
- ``perplexity``, ``embeddings``, ``output_error``, ``decode`` (the real decode loop);
- ``source``: the model a command names, resolved once (:class:`~.source.ModelSource`: folder, decoder
  file, graph, tokenizer, vocabulary, context length, KV layout, the rewriter's survey);
- data: ``corpus`` (token windows, sentence sets), ``op_metrics`` (keep ratios from the counters),
  ``text`` (a text's token ids and the BOS its tokenizer adds).

Heavy optional dependencies (torch, transformers, matplotlib) are imported inside the functions
that need them, so `ortsparse --help` and the fast tests do not load them.
"""
