"""Tune's algorithms, run on the machine and the model at hand: the per-layer sparsity allocation
(``allocation``: capture, cost curves, probes, the Lagrangian price and its bisection) and where an
ungated quantized LM head runs faster (``head_placement``, timed here).

Layers: ``allocation`` > ``head_placement``; below: :mod:`ortsparse.measure`, :mod:`ortsparse.zoo`.
"""
