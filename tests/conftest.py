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
