"""How tune cuts the text (ortsparse.tuning.windows): contiguous parts, the check windows only from
held-out parts spread over the text and a window's length away from any calibration window, every
window within the time budget, and a too-short text refused up front with the length it needs."""
import numpy as np
import pytest

from ortsparse.graph_rewrite.errors import ModelFileError
from ortsparse.tuning import windows


def test_roles_are_disjoint_and_spread_over_the_text():
    tokens = np.arange(40 * 512)
    plan = windows.plan_windows(tokens, 512)
    # 40 chunks in 8 parts of 5: parts 1, 5, 8 held out (15 check windows); the other 25 chunks
    # calibrate but for the 4 next to a held-out part (was 27 + 13, every third window a check).
    assert plan.available == (21, 15) and len(plan.calibration) == 21 and len(plan.check) == 15
    calibration = {int(w[0]) // 512 for w in plan.calibration}
    check = {int(w[0]) // 512 for w in plan.check}
    assert check == set(range(0, 5)) | set(range(20, 25)) | set(range(35, 40))
    assert calibration == set(range(6, 19)) | set(range(26, 34))
    assert (plan.probe == plan.calibration[:1]).all()
    assert plan.held_out == (0, 4, 7) and plan.parts[0] == (0, 2560) and plan.parts[-1] == (35 * 512, 40 * 512)
    assert plan.check_parts.tolist() == [0] * 5 + [4] * 5 + [7] * 5


def _windows_of(plan, starts_of):
    return [(int(w[0]), int(w[0]) + plan.text_len) for w in starts_of]


@pytest.mark.parametrize("chunks", [22, 23, 29, 40, 57, 96, 203])
def test_no_check_window_overlaps_or_touches_a_calibration_part(chunks):
    """Every check window lies in a held-out part, every calibration window in another part and at
    least a window's length from every held-out token (so from every check window too)."""
    text_len = 100
    plan = windows.plan_windows(np.arange(chunks * text_len + 37), text_len)
    held = [plan.parts[i] for i in plan.held_out]
    for (start, end), part in zip(_windows_of(plan, plan.check), plan.check_parts):
        assert part in plan.held_out and plan.parts[part][0] <= start and end <= plan.parts[part][1]
    for (start, end), part in zip(_windows_of(plan, plan.calibration), plan.calibration_parts):
        assert part not in plan.held_out and plan.parts[part][0] <= start and end <= plan.parts[part][1]
        assert all(end + text_len <= a or b + text_len <= start for a, b in held)
    assert len(plan.calibration) >= windows.MIN_CALIBRATION and len(plan.check) >= windows.MIN_CHECK


def test_the_held_out_parts_span_the_beginning_the_middle_and_the_end():
    plan = windows.plan_windows(np.arange(96 * 512), 512)
    total = 96 * 512
    starts = sorted(int(w[0]) for w in plan.check)
    assert starts[0] == 0 and starts[-1] + 512 == total  # the first and the last page
    assert any(0.4 * total <= s <= 0.6 * total for s in starts)  # and the middle
    assert len(set(plan.check_parts.tolist())) == windows.HELD_OUT_PARTS
    assert len(set(plan.calibration_parts.tolist())) == windows.PARTS - windows.HELD_OUT_PARTS
    assert "parts 1, 5, 8" in plan.split and "one window (512 tokens) apart" in plan.split
    report = plan.parts_report()
    assert [p["held_out"] for p in report] == [True, False, False, False, True, False, False, True]
    assert sum(p["check_windows"] for p in report) == len(plan.check)


def test_a_longer_text_never_gives_fewer_windows_of_a_role():
    """What makes the shortest length minimum_tokens names the length from which every text works."""
    counts = [windows.lay_out(chunks * 64, 64, answer_prefix=300) for chunks in range(10, 200)]
    for smaller, larger in zip(counts, counts[1:]):
        assert larger.calibration_starts.size >= smaller.calibration_starts.size
        assert larger.check_starts.size >= smaller.check_starts.size
        assert len(larger.answers.offsets) >= len(smaller.answers.offsets)
    needed = windows.minimum_tokens(64, 300)
    assert windows.lay_out(needed, 64, 300).enough() and not windows.lay_out(needed - 64, 64, 300).enough()


def test_the_time_budget_takes_an_even_subset_never_below_the_minimum():
    tokens = np.arange(200 * 512)
    fast = windows.plan_windows(tokens, 512, seconds_per_window=0.001)
    slow = windows.plan_windows(tokens, 512, seconds_per_window=1.0, budget_s=600)
    very_slow = windows.plan_windows(tokens, 512, seconds_per_window=100.0, budget_s=600)
    assert len(fast.calibration) == fast.available[0]
    assert windows.MIN_CALIBRATION < len(slow.calibration) < slow.available[0] and "min at" in slow.note
    assert (len(very_slow.calibration), len(very_slow.check)) == (windows.MIN_CALIBRATION, windows.MIN_CHECK)
    # The subsets spread over each role's whole range: the calibration parts (chunks 26..173, the
    # parts next to held-out ones less a chunk; was 0..199 interleaved) and the held-out parts.
    starts = sorted(int(w[0]) // 512 for w in slow.calibration)
    assert (starts[0], starts[-1]) == (26, 173)
    checked = sorted(int(w[0]) // 512 for w in slow.check)
    assert (checked[0], checked[-1]) == (0, 199)


def test_windows_given_by_the_user():
    plan = windows.plan_windows(np.arange(60 * 512), 512, windows=8)
    assert (len(plan.calibration), len(plan.check)) == (8, 8)


def test_a_short_text_is_refused_with_the_length_it_needs():
    with pytest.raises(ModelFileError) as error:
        windows.plan_windows(np.arange(5000), 512)
    message = str(error.value)
    assert "5000 tokens" in message and str(windows.minimum_tokens(512)) in message and "20000" in message
    assert "\n" not in message
    # 10 calibration + 6 check windows, the held-out parts and the gaps: 22 windows (was 16).
    assert windows.minimum_tokens(512) == 22 * 512
    windows.plan_windows(np.arange(22 * 512), 512)  # that many is enough


def test_the_answer_windows_of_a_long_context_lie_in_the_held_out_parts():
    """Each held-out part holds at least one answer window (prompt + answer tokens, contiguous),
    none overlaps another or comes within a window of a calibration window."""
    prefix = 4096
    span = prefix + windows.ANSWER_STEPS + 1
    needed = windows.minimum_tokens(512, prefix)
    plan = windows.plan_windows(np.arange(needed + 20_000), 512, answer_prefix=prefix)
    answers = plan.answers
    assert (answers.prefix, answers.answer) == (prefix, windows.ANSWER_STEPS) and len(answers.offsets) >= 3
    spans = [(o, o + span) for o in answers.offsets]
    assert all(b <= c for (_, b), (c, _) in zip(spans, spans[1:]))  # disjoint
    held = [plan.parts[i] for i in plan.held_out]
    assert all(any(a <= start and end <= b for a, b in held) for start, end in spans)
    assert {next(i for i in plan.held_out if plan.parts[i][0] <= s < plan.parts[i][1]) for s, _ in spans} == \
        set(plan.held_out)  # one in each held-out part at least
    for start, end in _windows_of(plan, plan.calibration):
        assert all(end + 512 <= a or b + 512 <= start for a, b in spans)
    assert windows.plan_windows(np.arange(needed + 20_000), 512).answers is None  # without a long context: none


def test_a_text_too_short_for_the_answer_windows_is_refused_with_the_length_it_needs():
    needed = windows.minimum_tokens(512, 4096)
    assert needed >= 3 * (4096 + windows.ANSWER_STEPS + 1)
    with pytest.raises(ModelFileError) as error:
        windows.plan_windows(np.arange(needed - 512), 512, answer_prefix=4096)
    message = str(error.value)
    assert f"tune needs at least {needed}" in message and "4096-token prompt + 256 answer tokens" in message
    assert "\n" not in message


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
    assert plan.text_len == 511 and plan.calibration.shape[1] == 511 and plan.available == (21, 15)
    assert plan.calibration[0].tolist() == list(range(6 * 511, 7 * 511))
