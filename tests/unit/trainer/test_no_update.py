"""The no-update watch: the reason a step made no update, and the stop after a streak of them."""

from megatron_rl.trainer.no_update import NoUpdateWatch, no_update_reason

STALE = {"filter/groups": 4.0, "filter/all_correct": 0.0, "filter/all_wrong": 4.0,
         "filter/uniform_other": 0.0, "reward/unparsable": 29.0, "reward/wrong": 3.0,
         "reward/correct": 0.0, "reward/timeouts": 0.0, "reward/errors": 0.0}


def test_reason_names_the_zero_variance_groups():
    assert no_update_reason(STALE) == ("no update: all 4 groups have zero reward variance "
                                       "(0 all-correct, 4 all-wrong, 0 other equal rewards)")


def test_streak_stops_with_counts_and_a_sample_and_an_update_resets_it():
    w = NoUpdateWatch(limit=3)
    w.record(False, STALE, "\\boxed{}")
    w.record(False, STALE, "\\boxed{}")
    assert not w.exhausted
    w.record(True, {})  # an update resets the streak and its counts
    assert w.streak == 0 and w.counts["unparsable"] == 0
    for _ in range(3):
        w.record(False, STALE, "The answer is \\boxed{}")
    assert w.exhausted
    text = w.diagnosis()
    assert "3 consecutive steps without an update" in text
    assert "unparsable 87, wrong 9, correct 0, timeouts 0, errors 0" in text
    assert text.endswith("A sample response: The answer is \\boxed{}")


def test_zero_never_stops():
    w = NoUpdateWatch(0)
    for _ in range(100):
        w.record(False, STALE)
    assert not w.exhausted
