"""The ``ortsparse`` subcommands built on the measurement library (each module has ``add_arguments``
and ``run``; ``ortsparse.cli`` loads them by name) and the studies run like them.

Layers (top to bottom; pyproject.toml's [tool.importlinter] enforces them):

- ``bench`` (``ortsparse bench``), ``calibrate``, ``event_workloads``, ``sweep``, ``validate``
  (``ortsparse validate``: the zoo);
- ``quality`` (``ortsparse quality``; ``event_workloads`` borrows its in-memory rewrite).

Below them: :mod:`ortsparse.tuning` (``ortsparse tune``), :mod:`ortsparse.calibration`,
:mod:`ortsparse.measure`, :mod:`ortsparse.zoo`.
"""
