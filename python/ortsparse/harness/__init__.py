"""The measurement harness: real trained models fetched and exported into a cache, quality
(perplexity, embedding cosine, output error), speed (prefill / decode tokens/s), zoo validation,
sweeps and calibration. Protocol: ../shared/design/measure.md, summarised in docs/measure.md.

Modules import heavy dependencies (torch, transformers, matplotlib) inside functions only, so
`ortsparse --help` and the fast tests stay light.
"""
