import numpy as np
import pytest


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture
def steady_tune_speed(monkeypatch):
    """``tune``'s speed check with a fixed result (a tiny model's decode speed is noise, and a test
    not about speed must not get exit status 3, "written but slower", by chance)."""
    from pathlib import Path

    from ortsparse.tuning import tune as tune_module

    def measured(models, *args, **kwargs):
        assert set(models) == {"input", "tuned"} and Path(models["tuned"]).exists()
        return {"input": {"tokens_per_s": 100.0}, "tuned": {"tokens_per_s": 110.0}}

    monkeypatch.setattr(tune_module, "decode_speed", measured)


@pytest.fixture(autouse=True)
def bytes_valued_layers(monkeypatch):
    """``tune`` values skipped bytes alike (``--no-speed-aware``) in tests: on a tiny model its
    layer speed measurement says gating pays nowhere (a node's fixed cost dominates a 64 x 64 layer),
    so every flow test would stop there. Tests of the measurement use ``measured_layer_speed``."""
    from ortsparse.tuning import layer_speed

    monkeypatch.setattr(layer_speed, "measure_model", lambda *args, **kwargs: None)


@pytest.fixture
def measured_layer_speed(monkeypatch):
    """``tune``'s real layer speed measurement, at a few rounds per class."""
    from ortsparse.tuning import layer_speed

    monkeypatch.setattr(layer_speed, "measure_model", MEASURE_MODEL)
    monkeypatch.setattr(layer_speed, "SECONDS_PER_CLASS", 0.0)


def _real_measure_model():
    from ortsparse.tuning import layer_speed

    return layer_speed.measure_model


MEASURE_MODEL = _real_measure_model()
