"""Zero-variance group filtering, including fractional rewards, and its counts."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from megatron_rl.algo import AlgoConfig, filter_groups, filter_groups_reference


def run(rewards, groups, **kwargs):
    keep, metrics = filter_groups(torch.tensor(rewards, dtype=torch.float64),
                                  torch.tensor(groups), AlgoConfig(**kwargs))
    return keep.tolist(), metrics


def test_all_correct_all_wrong_and_fractional_uniform_groups_dropped():
    rewards = [1, 1, 1, 0, 0, 0, 0.5, 0.5, 0.5, 1, 0, 0.5, 0.3, 0.3, 0.7]
    groups = [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4]
    keep, m = run(rewards, groups)
    assert keep == [False] * 9 + [True] * 6
    assert (m["filter/all_correct"], m["filter/all_wrong"], m["filter/uniform_other"]) == (1, 1, 1)
    assert (m["filter/zero_variance"], m["filter/kept_groups"], m["filter/groups"]) == (3, 2, 5)
    assert m["filter/kept_frac"] == pytest.approx(6 / 15)


def test_singleton_group_has_zero_variance():
    keep, m = run([0.4, 1, 0], [8, 9, 9])
    assert keep == [False, True, True] and m["filter/zero_variance"] == 1


def test_filter_off_keeps_everything_but_still_counts():
    keep, m = run([1, 1, 0, 1], [0, 0, 1, 1], filter_zero_variance_groups=False)
    assert keep == [True] * 4 and m["filter/all_correct"] == 1 and m["filter/kept_groups"] == 2


def test_thresholds_for_other_reward_scales():
    keep, m = run([-1, -1, 2, 2], [0, 0, 1, 1], correct_reward=2.0, wrong_reward=-1.0)
    assert keep == [False] * 4 and (m["filter/all_correct"], m["filter/all_wrong"]) == (1, 1)


@settings(max_examples=100, deadline=None)
@given(data=st.integers(1, 30).flatmap(lambda n: st.tuples(
    st.lists(st.sampled_from([0.0, 1.0, 0.5, 0.2]), min_size=n, max_size=n),
    st.lists(st.integers(0, 6), min_size=n, max_size=n))), on=st.booleans())
def test_vectorised_matches_loop_reference(data, on):
    rewards, groups = data
    keep, metrics = run(rewards, groups, filter_zero_variance_groups=on)
    ref_keep, ref_metrics = filter_groups_reference(
        rewards, groups, AlgoConfig(filter_zero_variance_groups=on))
    assert keep == ref_keep and metrics == pytest.approx(ref_metrics)


def test_bad_group_ids_named():
    with pytest.raises(ValueError, match="^group_ids:"):
        filter_groups(torch.tensor([1.0, 0.0]), torch.tensor([0, 0, 0]), AlgoConfig())
