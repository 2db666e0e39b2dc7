"""How tune cuts the text (ortsparse.tuning.windows): disjoint roles spread over the text, every
window within the time budget, and a too-short text refused up front with the length it needs."""
import numpy as np
import pytest

from ortsparse.graph_rewrite.errors import ModelFileError
from ortsparse.tuning import windows


def test_roles_are_disjoint_and_spread_over_the_text():
    tokens = np.arange(40 * 512)
    plan = windows.plan_windows(tokens, 512)
    assert plan.available == (27, 13) and len(plan.calibration) == 27 and len(plan.check) == 13
    calibration = {int(w[0]) // 512 for w in plan.calibration}
    check = {int(w[0]) // 512 for w in plan.check}
    assert not calibration & check and len(calibration | check) == 40
    assert min(check) < 5 and max(check) > 35  # the check windows sample the whole text
    assert (plan.probe == plan.calibration[:1]).all()


def test_the_time_budget_takes_an_even_subset_never_below_the_minimum():
    tokens = np.arange(200 * 512)
    fast = windows.plan_windows(tokens, 512, seconds_per_window=0.001)
    slow = windows.plan_windows(tokens, 512, seconds_per_window=1.0, budget_s=600)
    very_slow = windows.plan_windows(tokens, 512, seconds_per_window=100.0, budget_s=600)
    assert len(fast.calibration) == fast.available[0]
    assert windows.MIN_CALIBRATION < len(slow.calibration) < slow.available[0] and "min at" in slow.note
    assert (len(very_slow.calibration), len(very_slow.check)) == (windows.MIN_CALIBRATION, windows.MIN_CHECK)
    starts = sorted(int(w[0]) // 512 for w in slow.calibration)
    assert starts[0] < 10 and starts[-1] > 190


def test_windows_given_by_the_user():
    plan = windows.plan_windows(np.arange(60 * 512), 512, windows=8)
    assert (len(plan.calibration), len(plan.check)) == (8, 8)


def test_a_short_text_is_refused_with_the_length_it_needs():
    with pytest.raises(ModelFileError) as error:
        windows.plan_windows(np.arange(5000), 512)
    message = str(error.value)
    assert "5000 tokens" in message and str(windows.minimum_tokens(512)) in message and "20000" in message
    assert "\n" not in message


def test_the_long_context_piece_is_contiguous_and_apart():
    tokens = np.arange(16 * 512 + 4096)
    plan = windows.plan_windows(tokens, 512, long_context=4096)
    assert plan.long_piece.tolist() == list(range(16 * 512, 16 * 512 + 4096))
    assert int(plan.calibration.max()) < 16 * 512 and int(plan.check.max()) < 16 * 512


def test_progress_says_the_time_left_at_the_pace_measured():
    now = iter([10.0, 14.0, 18.0])
    progress = windows.Progress("path", 40, clock=lambda: next(now))
    assert progress.advance(10) == "path: 10 window passes of ~40 in 4 s, ~12 s left at this pace"
    assert progress.advance(30) == ("path: 40 window passes of ~40 in 8 s (extending or refining the path: a point "
                                    "at a time)")


def test_the_estimate_tune_says_is_the_cost_the_time_budget_caps():
    slow = windows.plan_windows(np.arange(200 * 512), 512, seconds_per_window=1.0, budget_s=600)
    uncapped = windows.loss_pass_seconds(1.0, *slow.available)
    assert uncapped > 600 >= windows.loss_pass_seconds(1.0, len(slow.calibration), len(slow.check)) > 0.9 * 600


def test_windows_are_cut_in_text_lengths():
    """tune passes the text per window (a BOS takes a window's first position): chunks of that many."""
    plan = windows.plan_windows(np.arange(40 * 511), 511)
    assert plan.text_len == 511 and plan.calibration.shape[1] == 511 and plan.available == (27, 13)
